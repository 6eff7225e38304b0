"""`meshfit demo`: the seed scenario on local CPU ranks.

A model whose weights + gradients + optimizer states + activations do not fit one rank's memory budget.
Every layout trains the same model on the same data under the same per-rank budget. A layout that goes over
is stopped by the budget at the operator that would not have fit; it is then run once more for a few steps
without the budget, so the table shows how much it really needs. Results go to DIR/summary.json and a
chart of the per-rank breakdown to DIR/memory.png.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from meshfit.config import load_config
from meshfit.planner.estimate import MemoryEstimate, estimate_memory
from meshfit.planner.layout import Layout, Workload
from meshfit.train.launch import Outcome, launch
from meshfit.charts import memory_chart
from meshfit.units import fmt_bytes, parse_bytes

# ~4.3M parameters: 16 bytes/parameter of fp32 weights, gradients and AdamW states ≈ 69 MB per replica.
DEMO_MODEL = ["model.preset=small", "model.dim=256", "model.n_layers=6", "model.vocab_size=2048",
              "model.ffn_hidden=704", "model.n_heads=8", "model.n_kv_heads=4"]
DEMO_GLOBAL_BATCH = 8
DEMO_SEQ_LEN = 128
DEMO_TRAIN = ["train.steps=8", f"train.seq_len={DEMO_SEQ_LEN}", "train.lr=3e-3", "train.warmup_steps=2",
              "checkpoint.at_end=false",  # the demo compares memory; its runs are not continued
              "train.log_every=2"]
# Planned per rank: DDP ~105 MiB, ZeRO-1 ~94, ZeRO-2 ~84, ZeRO-3 ~73, ZeRO-3 + checkpointing ~62.
DEMO_BUDGET = "80MiB"
PROBE_STEPS = 3  # unbudgeted re-run of a failing layout; DDP's buckets settle after step 2


@dataclass(frozen=True)
class Trial:
    name: str
    layout: Layout  # the same object `meshfit plan` produces and `meshfit train --plan` runs
    why: str  # what the layout keeps per rank, for the table
    global_batch: int = DEMO_GLOBAL_BATCH

    @property
    def sections(self) -> dict[str, dict[str, Any]]:
        sections = self.layout.config_sections(self.global_batch)
        sections["train"]["global_batch"] = self.global_batch
        return sections

    @property
    def nproc(self) -> int:
        return self.layout.world_size


def demo_trials(nproc: int) -> list[Trial]:
    shard = dict(dp_shard=nproc, micro_batch=1)
    return [
        Trial("ddp", Layout(dp_replicate=nproc, micro_batch=1),
              "full replica of weights, grads (DDP's buckets) and AdamW states on every rank"),
        Trial("ddp-4x-batch", Layout(dp_replicate=nproc, micro_batch=4),
              "the same replica with a 4× larger micro-batch: more activations", global_batch=4 * DEMO_GLOBAL_BATCH),
        Trial("zero1", Layout(zero_stage=1, **shard),
              "optimizer states sharded; weights gathered and full grads kept until the last micro-batch"),
        Trial("zero2", Layout(zero_stage=2, **shard), "+ grads reduce-scattered to 1/N after every micro-batch"),
        Trial("zero3", Layout(zero_stage=3, **shard), "+ weights sharded, gathered block by block (FSDP)"),
        Trial("fsdp-ac", Layout(zero_stage=3, activation_checkpointing="full", **shard),
              "ZeRO-3 + full activation checkpointing: blocks keep only their inputs"),
    ] + ([] if nproc == 1 else [
        # Every tensor-parallel rank sees the whole batch; micro-batches of 2 keep the step count low.
        Trial("tp", Layout(tp=nproc, sp=True, loss_parallel=True, micro_batch=2),
              "every matrix split across ranks (Megatron), sequence- and loss-parallel"),
        Trial("pp", Layout(pp=nproc, schedule="1f1b", micro_batch=1),
              "layers split into stages, 1F1B schedule over 8 micro-batches"),
    ]) + [
        # Always 8 ranks: the three techniques on one mesh, as large runs compose them.
        Trial("3d", Layout(pp=2, dp_shard=2, tp=2, zero_stage=3, sp=True, loss_parallel=True, micro_batch=1),
              "pp 2 × FSDP 2 × tp 2 on 8 ranks"),
    ]


def predict(trial: Trial) -> MemoryEstimate:
    """The planner's per-rank peak for a demo layout (CPU ranks: per-parameter AdamW, fp32)."""
    model = load_config(None, DEMO_MODEL).model.resolve()
    workload = Workload(seq_len=DEMO_SEQ_LEN, global_batch=trial.global_batch, precision="fp32")
    return estimate_memory(model, trial.layout, workload)


@dataclass
class Entry:
    layout: str
    fits: bool
    peak_mem_bytes: int | None
    final_loss: float | None
    why: str
    mem: list[dict[str, int]] = field(default_factory=list)
    error: str | None = None
    predicted: dict[str, int] = field(default_factory=dict)  # the planner's breakdown of the most-loaded rank

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "fits": self.fits, "peak_mem_bytes": self.peak_mem_bytes,
                "predicted_peak_mem_bytes": self.predicted.get("total"), "predicted_mem": self.predicted,
                "final_loss": self.final_loss, "mem": self.mem, "error": self.error, "why": self.why}


def _run_trial(trial: Trial, root: Path, budget: str, console: Console) -> Entry:
    base, sections = DEMO_MODEL + DEMO_TRAIN, trial.sections
    nproc, predicted = trial.nproc, predict(trial).as_dict()
    console.print(f"[bold]{trial.name}[/bold]: {trial.why} — training under a {budget} per-rank budget")
    outcome = launch(load_config(None, base + [f"train.memory_budget={budget}"], sections), root / trial.name,
                     nproc)
    if outcome.ok:
        res = outcome.result
        return Entry(trial.name, True, res["peak_mem_bytes"], res["final_loss"], trial.why, res["mem"],
                     predicted=predicted)
    console.print(f"  [red]does not fit[/red]: {outcome.message}")
    console.print(f"  measuring what it needs: {PROBE_STEPS} steps without the budget")
    probe: Outcome = launch(load_config(None, base + [f"train.steps={PROBE_STEPS}"], sections),
                            root / f"{trial.name}-unbounded", nproc)
    peak = probe.result["peak_mem_bytes"] if probe.ok else None
    error = outcome.message
    if not probe.ok:
        console.print(f"  [red]the run without the budget failed too[/red]: {probe.message}")
        error += f"; without the budget it failed too: {probe.message}"
    return Entry(trial.name, False, peak, None, trial.why, probe.result["mem"] if probe.ok else [], error, predicted)


def _plan_table(trials: list[Trial], budget: int) -> Table:
    table = Table(title=f"the plan: predicted per-rank memory of each layout (most-loaded rank) vs the "
                        f"{fmt_bytes(budget)} budget")
    for col in ("layout", "ranks", "predicted peak", "params", "grads", "optim", "activations", "buffers",
                "fits?"):
        table.add_column(col, justify="left" if col in ("layout", "fits?") else "right")
    for t in trials:
        m = predict(t).as_dict()
        table.add_row(t.name, str(t.nproc), fmt_bytes(m["total"]),
                      *(fmt_bytes(m[k]) for k in ("params", "grads", "optim", "activations", "buffers")),
                      "[green]yes[/green]" if m["total"] <= budget else "[red]no[/red]")
    return table


def _accuracy_table(entries: list[Entry]) -> Table:
    table = Table(title="predicted (planner) vs measured (tracker) peak per rank")
    for col in ("layout", "predicted", "measured", "error"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for e in entries:
        pred, meas = e.predicted.get("total"), e.peak_mem_bytes
        table.add_row(e.layout, fmt_bytes(pred), fmt_bytes(meas), f"{(pred - meas) / meas:+.1%}" if meas else "-")
    return table


def _table(entries: list[Entry], budget: str) -> Table:
    table = Table(title=f"per-rank memory under a {budget} budget (measured; most-loaded rank)")
    for col in ("layout", "fits?", "peak", "params", "grads", "optim", "activations", "other", "final loss"):
        table.add_column(col, justify="left" if col in ("layout", "fits?") else "right")
    for e in entries:
        worst = max(e.mem, key=lambda m: m["peak"]) if e.mem else {}
        table.add_row(e.layout, "[green]yes[/green]" if e.fits else "[red]no[/red]", fmt_bytes(e.peak_mem_bytes),
                      *(fmt_bytes(worst.get(k)) for k in ("params", "grads", "optim", "activations", "other")),
                      f"{e.final_loss:.4f}" if e.final_loss is not None else "-")
    return table


def run_demo(run_dir: Path, nproc: int = 2, budget: str = DEMO_BUDGET) -> int:
    """Run every demo layout; print the table and write summary.json. Returns the exit code."""
    console = Console(width=None if Console().is_terminal else 120)
    if nproc not in (1, 2, 4):
        console.print("[red]error:[/red] --nproc must be 1, 2 or 4 (it must divide the demo's batch and heads)")
        return 2
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trials = demo_trials(nproc)
    console.print(_plan_table(trials, parse_bytes(budget)))
    entries = [_run_trial(t, run_dir, budget, console) for t in trials]
    console.print(_table(entries, budget))
    console.print(_accuracy_table(entries))
    ddp, big = entries[0], entries[1]
    if ddp.peak_mem_bytes and big.peak_mem_bytes:
        console.print(f"A 4× larger micro-batch needs {fmt_bytes(big.peak_mem_bytes)} per rank instead of "
                      f"{fmt_bytes(ddp.peak_mem_bytes)}: more activations, the same replicated model states.")
    fitting = [e.layout for e in entries if e.fits]
    console.print(f"Fit under {budget}: {', '.join(fitting) or 'none'}; did not fit: "
                  f"{', '.join(e.layout for e in entries if not e.fits) or 'none'}.")
    (run_dir / "summary.json").write_text(json.dumps([e.to_json() for e in entries], indent=2))
    memory_chart([e.to_json() for e in entries], parse_bytes(budget), run_dir / "memory.png")
    console.print(f"summary: {run_dir / 'summary.json'}; chart: {run_dir / 'memory.png'}")
    return 0
