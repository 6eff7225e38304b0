"""One demo layout and its run: the scenario's settings, a `Trial` (a layout under them) and the `Entry` its
runs leave (measured peak and breakdown, loss, the planner's prediction). Both scenes use these."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from meshfit.config import Config, load_config
from meshfit.layout.layout import Layout, Workload
from meshfit.memory.tracker import over_budget_text
from meshfit.planner.memory.estimate import MemoryEstimate, estimate_memory
from meshfit.train.launch import Outcome, launch
from meshfit.util.units import fmt_bytes

# 5.5M parameters: 16 bytes/parameter of fp32 weights, gradients and AdamW states ≈ 84 MiB per replica.
DEMO_MODEL = ["model.preset=small", "model.dim=256", "model.n_layers=6", "model.vocab_size=2048",
              "model.ffn_hidden=704", "model.n_heads=8", "model.n_kv_heads=4"]
DEMO_GLOBAL_BATCH = 8
DEMO_SEQ_LEN = 128
# Every layout reaches its peak in step 2 (DDP's buckets and AdamW's moments exist from then on); steps 3
# and 4 show it stays there, and give the fitting layouts' losses a few updates to agree on.
DEMO_STEPS = 4
DEMO_TRAIN = [f"train.steps={DEMO_STEPS}", f"train.seq_len={DEMO_SEQ_LEN}", "train.lr=3e-3",
              "train.warmup_steps=2",
              "checkpoint.at_end=false",  # the demo compares memory; its runs are not continued
              "train.log_every=2"]
# Planned per rank: DDP ~105 MiB, ZeRO-1 ~92, ZeRO-2 ~82, ZeRO-3 ~71, ZeRO-3 + checkpointing ~61.
DEMO_BUDGET = "80MiB"
PROBE_STEPS = 2  # unbudgeted re-run of a failing layout: its peak is step 2's (see DEMO_STEPS)
# Rank counts the demo runs on: at least 2 (on one rank ZeRO shards nothing and tp/pp split nothing), and
# dividing the global batch (8) and the KV heads (4).
DEMO_NPROC = (2, 4)


@dataclass(frozen=True)
class Trial:
    name: str
    layout: Layout  # the same object `meshfit plan` produces and `meshfit train --plan` runs
    why: str  # what the layout keeps per rank, for the table
    global_batch: int = DEMO_GLOBAL_BATCH
    seq_len: int = DEMO_SEQ_LEN
    model: tuple[str, ...] = ()  # model.* overrides on top of the demo's model (another scene's model)

    @property
    def sections(self) -> dict[str, dict[str, Any]]:
        sections = self.layout.config_sections(self.global_batch)
        sections["train"]["global_batch"] = self.global_batch
        return sections

    @property
    def overrides(self) -> list[str]:
        """On top of the demo's own settings (which a config section would not override)."""
        if self.seq_len == DEMO_SEQ_LEN:
            return list(self.model)
        return [*self.model, f"train.seq_len={self.seq_len}",
                f"model.max_seq_len={max(self.seq_len, demo_config().model.resolve().max_seq_len)}"]

    def config(self, *overrides: str) -> Config:
        return demo_config(*self.overrides, *overrides, sections=self.sections)

    @property
    def nproc(self) -> int:
        return self.layout.world_size


def demo_config(*overrides: str, sections: dict[str, dict[str, Any]] | None = None) -> Config:
    return load_config(None, DEMO_MODEL + DEMO_TRAIN + list(overrides), sections)


def predict(trial: Trial) -> MemoryEstimate:
    """The planner's per-rank peak for a demo layout: CPU ranks (gloo), fp32, as `meshfit plan --gpu cpu`."""
    model = trial.config().model.resolve()
    workload = Workload(seq_len=trial.seq_len, global_batch=trial.global_batch, precision="fp32")
    return estimate_memory(model, trial.layout, workload, backend="gloo")


@dataclass
class Entry:
    layout: str
    fits: bool
    peak_mem_bytes: int | None
    final_loss: float | None
    why: str
    ranks: int = 0
    wall_s: float = 0.0  # the layout's runs, start to end (with the run without the budget)
    mem: list[dict[str, int]] = field(default_factory=list)  # every rank's breakdown in the peak step
    error: str | None = None
    predicted: dict[str, int] = field(default_factory=dict)  # the planner's breakdown of the most-loaded rank
    predicted_phase: str = ""  # the phase of the step where the planner puts that rank's peak

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "ranks": self.ranks, "fits": self.fits,
                "peak_mem_bytes": self.peak_mem_bytes, "predicted_peak_mem_bytes": self.predicted.get("total"),
                "predicted_mem": self.predicted, "predicted_phase": self.predicted_phase,
                "final_loss": self.final_loss, "mem": self.mem,
                "error": self.error, "why": self.why, "wall_s": round(self.wall_s, 1)}


def peak_step(run_dir: Path, result: dict[str, Any]) -> tuple[int, list[dict[str, int]]]:
    """The peak and every rank's breakdown in the step that reached it (metrics.jsonl); result.json's `mem`
    is the last step's, which can sit below the peak."""
    records = []
    with contextlib.suppress(OSError):
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict) and rec.get("mem") and "peak_mem_bytes" in rec:
                    records.append(rec)
    if not records:
        return result["peak_mem_bytes"], result["mem"]
    best = max(records, key=lambda r: r["peak_mem_bytes"])
    return best["peak_mem_bytes"], best["mem"]


def failure_line(outcome: Outcome) -> str:
    """What stopped a run, in one line: for the budget, the first rank that went over, the phase and how
    far over (the other ranks' reports, and their console lines, would say the same)."""
    budget = (outcome.failure or {}).get("budget")
    if budget:
        return (f"rank {budget['rank']} needed {fmt_bytes(budget['needed'])} during {budget['phase']}, "
                f"{over_budget_text(budget['needed'], budget['budget'])} the {fmt_bytes(budget['budget'])} budget")
    return outcome.message or "failed without a report"


class DemoStopped(Exception):
    """A signal (Ctrl-C, SIGTERM) reached the launcher during a layout's run: the demo ends there."""

    def __init__(self, signal_name: str, run_dir: Path) -> None:
        super().__init__(signal_name)
        self.signal_name, self.run_dir = signal_name, run_dir


def _launch(cfg: Config, run_dir: Path, nproc: int) -> Outcome:
    """launch() into a fresh run_dir; the launcher's own lines (banner, notes) go to run_dir/launch.log.
    Raises DemoStopped when a signal stopped the run: the launcher passed it on to the ranks, and the
    user meant the demo, not one layout."""
    if run_dir.is_dir():
        shutil.rmtree(run_dir)  # an earlier demo's run of this layout (run_demo was told to overwrite)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            outcome = launch(cfg, run_dir, nproc)
    finally:
        if said.getvalue():
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "launch.log").write_text(said.getvalue())
    if outcome.signal:
        raise DemoStopped(outcome.signal, run_dir)
    return outcome


def run_trial(trial: Trial, root: Path, budget: str, console: Console) -> Entry:
    nproc, estimate = trial.nproc, predict(trial)
    start = time.monotonic()
    console.print(f"[bold]{trial.name}[/bold] ({nproc} ranks): {trial.why}")
    outcome = _launch(trial.config(f"train.memory_budget={budget}"), root / trial.name, nproc)
    if outcome.ok:
        res = outcome.result
        peak, mem = peak_step(root / trial.name, res)
        return Entry(trial.name, True, peak, res["final_loss"], trial.why, nproc, time.monotonic() - start, mem,
                     predicted=estimate.as_dict(), predicted_phase=estimate.phase)
    label = "over budget" if (outcome.failure or {}).get("budget") else "failed"
    console.print(f"  [red]{label}[/red]: {failure_line(outcome)}")
    console.print(f"  measuring what it needs: {PROBE_STEPS} steps without the budget")
    probe_dir = root / f"{trial.name}-unbounded"
    probe = _launch(trial.config(f"train.steps={PROBE_STEPS}"), probe_dir, nproc)
    peak, mem = peak_step(probe_dir, probe.result) if probe.ok else (None, [])
    error = outcome.message
    if not probe.ok:
        console.print(f"  [red]the run without the budget failed too[/red]: {failure_line(probe)}")
        error += f"; without the budget it failed too: {probe.message}"
    return Entry(trial.name, False, peak, None, trial.why, nproc, time.monotonic() - start, mem, error,
                 estimate.as_dict(), estimate.phase)
