"""`meshfit demo`: the seed scenario on local CPU ranks.

A model whose weights + gradients + optimizer states + activations do not fit one rank's memory budget.
Every layout trains the same model on the same data under the same per-rank budget. A layout that goes over
is stopped by the budget at the operator that would not have fit; it is then run once more for a few steps
without the budget, so the table shows how much it really needs. Results go to DIR/summary.json and a
chart of the per-rank breakdown to DIR/memory.png. Each layout runs in DIR/<layout> (DIR/<layout>-unbounded
for the run without the budget); a rerun into the same DIR with --overwrite replaces those folders. DIR
is never a training run's folder, and the demo runs on 2 or 4 ranks (check_demo_args). A second scene
(demo_long.py) runs the same model on long sequences, where activations rather than weights exceed a rank.

The console output fits 100 columns. Python warnings of the demo's own process (torch's among them) go to
DIR/warnings.log; the ranks keep theirs in their run folders (DIR/<layout>/warnings.log), and the
launcher's own lines go to DIR/<layout>/launch.log. The end of the output says where warnings were kept.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from meshfit.config import Config, ConfigError, load_config
from meshfit.planner.estimate import MemoryEstimate, estimate_memory
from meshfit.planner.layout import Layout, Workload
from meshfit.memory.tracker import over_budget_text
from meshfit.train.launch import Outcome, launch
from meshfit.train.preflight import check_location, run_contents
from meshfit.charts import memory_chart
from meshfit.demo_compare import category_note
from meshfit.kept_warnings import KeptWarnings, warning_logs
from meshfit.units import fmt_bytes, parse_bytes

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
WIDTH = 100  # console columns: tables and lines fit in this
MIB = 2**20


@dataclass(frozen=True)
class Trial:
    name: str
    layout: Layout  # the same object `meshfit plan` produces and `meshfit train --plan` runs
    why: str  # what the layout keeps per rank, for the table
    global_batch: int = DEMO_GLOBAL_BATCH
    seq_len: int = DEMO_SEQ_LEN

    @property
    def sections(self) -> dict[str, dict[str, Any]]:
        sections = self.layout.config_sections(self.global_batch)
        sections["train"]["global_batch"] = self.global_batch
        return sections

    @property
    def overrides(self) -> list[str]:
        """On top of the demo's own settings (which a config section would not override)."""
        if self.seq_len == DEMO_SEQ_LEN:
            return []
        return [f"train.seq_len={self.seq_len}",
                f"model.max_seq_len={max(self.seq_len, demo_config().model.resolve().max_seq_len)}"]

    def config(self, *overrides: str) -> Config:
        return demo_config(*self.overrides, *overrides, sections=self.sections)

    @property
    def nproc(self) -> int:
        return self.layout.world_size


def demo_trials(nproc: int) -> list[Trial]:
    shard = dict(dp_shard=nproc, micro_batch=1)
    return [
        Trial("ddp", Layout(dp_replicate=nproc, micro_batch=1),
              "a full replica of weights, grads (DDP's buckets) and AdamW states per rank"),
        Trial("ddp-4x-batch", Layout(dp_replicate=nproc, micro_batch=4),
              "the same replica with a 4× larger micro-batch: more activations", global_batch=4 * DEMO_GLOBAL_BATCH),
        Trial("zero1", Layout(zero_stage=1, **shard),
              "AdamW states sharded; gathered weights and full grads kept for the step"),
        Trial("zero2", Layout(zero_stage=2, **shard), "+ grads reduce-scattered to 1/N after every micro-batch"),
        Trial("zero3", Layout(zero_stage=3, **shard), "+ weights sharded, gathered block by block (FSDP)"),
        Trial("fsdp-ac", Layout(zero_stage=3, activation_checkpointing="full", **shard),
              "ZeRO-3 + full activation checkpointing: blocks keep only their inputs"),
        # Every tensor-parallel rank sees the whole batch; micro-batches of 2 keep the step count low.
        Trial("tp", Layout(tp=nproc, sp=True, loss_parallel=True, micro_batch=2),
              "every matrix split across ranks (Megatron), sequence- and loss-parallel"),
        Trial("pp", Layout(pp=nproc, schedule="1f1b", micro_batch=1),
              "layers split into stages, 1F1B schedule over 8 micro-batches"),
        # Always 8 ranks: the three techniques on one mesh, as large runs compose them.
        Trial("3d", Layout(pp=2, dp_shard=2, tp=2, zero_stage=3, sp=True, loss_parallel=True, micro_batch=1),
              "pp 2 × FSDP 2 × tp 2: the three techniques on one mesh"),
    ]


def demo_config(*overrides: str, sections: dict[str, dict[str, Any]] | None = None) -> Config:
    return load_config(None, DEMO_MODEL + DEMO_TRAIN + list(overrides), sections)


def predict(trial: Trial) -> MemoryEstimate:
    """The planner's per-rank peak for a demo layout: CPU ranks (gloo), fp32, as `meshfit plan --gpu cpu`."""
    model = trial.config().model.resolve()
    workload = Workload(seq_len=trial.seq_len, global_batch=trial.global_batch, precision="fp32")
    return estimate_memory(model, trial.layout, workload, backend="gloo")


def loss_floor(cfg: Config) -> dict[str, float] | None:
    """The synthetic data's entropy rate (nats/token), from the generator the ranks build: the lowest mean
    loss any model can reach on it. None for other data sources."""
    if cfg.data.source != "synthetic":
        return None
    from meshfit.data import make_source
    from meshfit.data.synthetic import RESTART

    vocab = cfg.model.resolve().vocab_size
    source = make_source("synthetic", path=None, vocab_size=vocab, seed=cfg.train.seed)
    return {"floor": source.entropy_floor(), "uniform": math.log(vocab), "vocab": vocab,
            "successors": source.successors, "alpha": source.alpha, "restart": RESTART}


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


def _peak_step(run_dir: Path, result: dict[str, Any]) -> tuple[int, list[dict[str, int]]]:
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


def _run_trial(trial: Trial, root: Path, budget: str, console: Console) -> Entry:
    nproc, estimate = trial.nproc, predict(trial)
    start = time.monotonic()
    console.print(f"[bold]{trial.name}[/bold] ({nproc} ranks): {trial.why}")
    outcome = _launch(trial.config(f"train.memory_budget={budget}"), root / trial.name, nproc)
    if outcome.ok:
        res = outcome.result
        peak, mem = _peak_step(root / trial.name, res)
        return Entry(trial.name, True, peak, res["final_loss"], trial.why, nproc, time.monotonic() - start, mem,
                     predicted=estimate.as_dict(), predicted_phase=estimate.phase)
    label = "over budget" if (outcome.failure or {}).get("budget") else "failed"
    console.print(f"  [red]{label}[/red]: {failure_line(outcome)}")
    console.print(f"  measuring what it needs: {PROBE_STEPS} steps without the budget")
    probe_dir = root / f"{trial.name}-unbounded"
    probe = _launch(trial.config(f"train.steps={PROBE_STEPS}"), probe_dir, nproc)
    peak, mem = _peak_step(probe_dir, probe.result) if probe.ok else (None, [])
    error = outcome.message
    if not probe.ok:
        console.print(f"  [red]the run without the budget failed too[/red]: {failure_line(probe)}")
        error += f"; without the budget it failed too: {probe.message}"
    return Entry(trial.name, False, peak, None, trial.why, nproc, time.monotonic() - start, mem, error,
                 estimate.as_dict(), estimate.phase)


def _mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def _table(title: str, columns: list[str], left: tuple[str, ...] = ("layout", "fits?")) -> Table:
    table = Table(title=title, title_justify="left", caption_justify="left")
    for col in columns:
        # Cells never wrap: a value is one token ("104.6"), and the table is narrower than WIDTH.
        table.add_column(col, justify="left" if col in left else "right", no_wrap=True, overflow="ellipsis")
    return table


def _plan_table(trials: list[Trial], budget: int) -> Table:
    table = _table(f"the plan: predicted MiB per rank (most-loaded rank) vs the {_mib(budget)} MiB budget",
                   ["layout", "ranks", "peak", "params", "grads", "optim", "activ.", "buffers", "fits?"])
    for t in trials:
        m = predict(t).as_dict()
        table.add_row(t.name, str(t.nproc), _mib(m["total"]),
                      *(_mib(m[k]) for k in ("params", "grads", "optim", "activations", "buffers")),
                      "[green]yes[/green]" if m["total"] <= budget else "[red]no[/red]")
    return table


def _accuracy_table(entries: list[Entry]) -> Table:
    table = _table("predicted (planner) vs measured MiB per rank",
                   ["layout", "predicted", "measured", "error"])
    for e in entries:
        pred, meas = e.predicted.get("total"), e.peak_mem_bytes
        table.add_row(e.layout, _mib(pred), _mib(meas), f"{(pred - meas) / meas:+.1%}" if meas else "-")
    return table


def _measured_table(entries: list[Entry], budget: str) -> Table:
    table = _table(f"measured MiB per rank (most-loaded rank, at its peak) under the {budget} budget",
                   ["layout", "ranks", "fits?", "peak", "params", "grads", "optim", "activ.", "other",
                    "final loss"])
    for e in entries:
        worst = max(e.mem, key=lambda m: m["peak"]) if e.mem else {}
        table.add_row(e.layout, str(e.ranks), "[green]yes[/green]" if e.fits else "[red]no*[/red]",
                      _mib(e.peak_mem_bytes),
                      *(_mib(worst.get(k)) for k in ("params", "grads", "optim", "activations", "other")),
                      f"{e.final_loss:.4f}" if e.final_loss is not None else "-")
    if not all(e.fits for e in entries):
        table.caption = f"* over the budget: measured in a {PROBE_STEPS}-step run without it"
    return table


def parity_text(entries: list[Entry]) -> str | None:
    """Why every layout that fits ends at the same loss, with the measured spread of those losses."""
    losses = [e.final_loss for e in entries if e.fits and e.final_loss is not None]
    if len(losses) < 2:
        return None
    spread = max(losses) - min(losses)
    return (f"Every layout that fits ends at the same loss, {min(losses):.4f} (largest difference between them: "
            f"{spread:.1e}). Each trains the same model, initialised from the same seed, on the same batches "
            f"in the same order; a layout changes only where tensors live and how ranks exchange them, so each "
            f"computes what one device would, up to float rounding (sums added in another order; the parity "
            f"tests hold every layout to 1e-5 of a one-process run).")


def floor_text(floor: dict[str, float] | None, losses: list[float]) -> str | None:
    """What the synthetic data's loss floor is, and how far the demo's short runs are from it."""
    if floor is None:
        return None
    where = f" ({min(losses):.4f} after {DEMO_STEPS} steps)" if losses else ""
    return (f"The loss floor: the data is a synthetic Markov chain over {floor['vocab']} tokens (each token has "
            f"{floor['successors']} likely successors with Dirichlet({floor['alpha']:g}) weights, and a "
            f"{floor['restart']:g} chance of any token instead). Its entropy rate, {floor['floor']:.2f} "
            f"nats/token, is the lowest loss any model can reach on it. Training starts near ln "
            f"{floor['vocab']} = {floor['uniform']:.2f} (a uniform guess); the demo's runs measure memory, so "
            f"their loss{where} has only begun to fall toward the floor.")


def make_console() -> Console:
    """At most WIDTH columns: the terminal's width when narrower; WIDTH when stdout is not a terminal."""
    probe = Console()
    return Console(width=min(probe.width, WIDTH) if probe.is_terminal else WIDTH)


def check_demo_args(run_dir: Path, nproc: int, overwrite: bool) -> None:
    """Refuse, before anything runs or is written: a rank count the comparison means nothing at, a folder
    that holds a training run (the demo's folder holds its summary and one run folder per layout), and an
    earlier demo's output unless `overwrite` (then its layouts' runs are replaced one by one)."""
    if nproc not in DEMO_NPROC:
        raise ConfigError(f"--nproc {nproc}: the demo runs on 2 or 4 ranks. It compares how layouts split one "
                          "model over ranks (on 1 rank ZeRO shards nothing and tp and pp split nothing), and "
                          "the rank count must divide its batch (8) and key-value heads (4)")
    run_dir = Path(run_dir)
    check_location(run_dir)
    training = run_contents(run_dir, run_dir / "checkpoints")
    if training:
        raise ConfigError(f"--run-dir {run_dir} holds a training run ({'; '.join(training)}), not a demo's "
                          "output: choose another --run-dir for the demo (--overwrite replaces only an earlier "
                          "demo's output)")
    from meshfit.demo_long import long_trials

    trials = [*demo_trials(nproc), *long_trials(nproc)]
    earlier = [p.name for p in (run_dir / "summary.json", run_dir / "long_sequences.json",
                                *(run_dir / t.name for t in trials)) if p.exists()]
    if earlier and not overwrite:
        raise ConfigError(f"--run-dir {run_dir} holds an earlier demo's output ({', '.join(earlier)}): replace it "
                          "with --overwrite, or choose another --run-dir")


def run_demo(run_dir: Path, nproc: int = 2, budget: str = DEMO_BUDGET, overwrite: bool = False) -> int:
    """Run every demo layout; print the table and write summary.json. Returns the exit code (bad arguments
    raise ConfigError first: see check_demo_args)."""
    run_dir = Path(run_dir)
    check_demo_args(run_dir, nproc, overwrite)
    console = make_console()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "warnings.log").unlink(missing_ok=True)
    with KeptWarnings(run_dir / "warnings.log"):
        try:
            return _run(run_dir, nproc, budget, console)
        except DemoStopped as stop:
            console.print(f"stopped by {stop.signal_name} during {stop.run_dir.name}; no summary was written "
                          f"(the layouts' runs so far are in {run_dir})")
            known = signal.Signals.__members__.get(stop.signal_name)
            return 128 + known.value if known else 1


def _run(run_dir: Path, nproc: int, budget: str, console: Console) -> int:
    from meshfit.models.config import num_params

    trials, limit, start = demo_trials(nproc), parse_bytes(budget), time.monotonic()
    model = demo_config().model.resolve()
    family = {"llama": "Llama", "gpt": "GPT"}.get(model.family, model.family)
    console.print(f"meshfit demo: a {num_params(model) / 1e6:.1f}M-parameter {family}-style model (dim "
                  f"{model.dim}, {model.n_layers} layers, vocabulary {model.vocab_size}), fp32 + AdamW, with "
                  f"a per-rank budget of {fmt_bytes(limit)}. A layout that goes over is stopped at the "
                  f"operator that would not fit, then measured in a {PROBE_STEPS}-step run without the budget; "
                  f"the others train {DEMO_STEPS} steps under it.")
    console.print(_plan_table(trials, limit))
    entries = [_run_trial(t, run_dir, budget, console) for t in trials]
    console.print(_measured_table(entries, fmt_bytes(limit)))
    if note := category_note(trials, entries):
        console.print(note)
    console.print(_accuracy_table(entries))
    ddp, big = entries[0], entries[1]
    if ddp.peak_mem_bytes and big.peak_mem_bytes:
        console.print(f"A 4× larger micro-batch needs {fmt_bytes(big.peak_mem_bytes)} per rank instead of "
                      f"{fmt_bytes(ddp.peak_mem_bytes)}: more activations, the same replicated model states.")
    fitting = [e.layout for e in entries if e.fits]
    console.print(f"Fit under {fmt_bytes(limit)}: {', '.join(fitting) or 'none'}; did not fit: "
                  f"{', '.join(e.layout for e in entries if not e.fits) or 'none'}.")
    losses = [e.final_loss for e in entries if e.fits and e.final_loss is not None]
    for text in (parity_text(entries), floor_text(loss_floor(demo_config()), losses)):
        if text:
            console.print(text)
    (run_dir / "summary.json").write_text(json.dumps([e.to_json() for e in entries], indent=2))
    memory_chart([e.to_json() for e in entries], limit, run_dir / "memory.png")
    from meshfit.demo_long import run_long_scene  # the second scene builds on this module's pieces

    run_long_scene(run_dir, nproc, console)
    logs = warning_logs(run_dir)
    if logs:
        where = ", ".join(str(p.relative_to(run_dir)) for p, _ in logs)
        console.print(f"Warnings kept off the console: {sum(n for _, n in logs)} lines in {run_dir}: {where}")
    console.print(f"Done in {time.monotonic() - start:.0f} s. summaries: {run_dir / 'summary.json'}, "
                  f"{run_dir / 'long_sequences.json'}; charts: {run_dir / 'memory.png'}, {run_dir / 'long_memory.png'}")
    return 0
