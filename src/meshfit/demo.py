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
from meshfit.train.launch import Outcome, launch
from meshfit.charts import memory_chart
from meshfit.units import fmt_bytes, parse_bytes

# ~4.3M parameters: 16 bytes/parameter of fp32 weights, gradients and AdamW states ≈ 69 MB per replica.
DEMO_MODEL = ["model.preset=small", "model.dim=256", "model.n_layers=6", "model.vocab_size=2048",
              "model.ffn_hidden=704", "model.n_heads=8", "model.n_kv_heads=4"]
DEMO_TRAIN = ["train.steps=8", "train.global_batch=8", "train.micro_batch=1", "train.seq_len=128",
              "train.lr=3e-3", "train.warmup_steps=2", "train.log_every=2"]
# DDP needs ~125 MiB per rank, ZeRO-1 ~104, ZeRO-2 ~84, ZeRO-3 ~73, ZeRO-3 + checkpointing ~62 (measured).
DEMO_BUDGET = "80MiB"
PROBE_STEPS = 3  # unbudgeted re-run of a failing layout; DDP's buckets settle after step 2


@dataclass(frozen=True)
class Trial:
    name: str
    overrides: list[str]
    why: str  # what the layout keeps per rank, for the table
    nproc: int | None = None  # ranks of this layout; None = the demo's --nproc


def demo_trials(nproc: int) -> list[Trial]:
    shard = [f"parallel.dp_shard={nproc}"]
    return [
        Trial("ddp", [f"parallel.dp_replicate={nproc}"],
              "full replica of weights, grads (+ DDP buckets) and AdamW states on every rank"),
        Trial("ddp-4x-batch", [f"parallel.dp_replicate={nproc}", "train.global_batch=32",
                               "train.micro_batch=4"],
              "the same replica with a 4× larger micro-batch: more activations"),
        Trial("zero1", shard + ["parallel.zero_stage=1"], "optimizer states sharded, grads and weights replicated"),
        Trial("zero2", shard + ["parallel.zero_stage=2"],
              "+ grads sharded; gathered weights kept from forward to backward"),
        Trial("zero3", shard + ["parallel.zero_stage=3"], "+ weights sharded, gathered block by block (FSDP)"),
        Trial("fsdp-ac", shard + ["parallel.zero_stage=3", "parallel.activation_checkpointing=full"],
              "ZeRO-3 + full activation checkpointing: blocks keep only their inputs"),
    ] + ([] if nproc == 1 else [
        # Every tensor-parallel rank sees the whole batch; micro-batches of 2 keep the step count low.
        Trial("tp", [f"parallel.tp={nproc}", "parallel.sp=true", "parallel.loss_parallel=true",
                     "train.micro_batch=2"],
              "every matrix split across ranks (Megatron), sequence- and loss-parallel"),
        Trial("pp", [f"parallel.pp={nproc}", "pipeline.schedule=1f1b", "pipeline.microbatches=8",
                     "train.micro_batch=null"],
              "layers split into stages, 1F1B schedule over 8 micro-batches"),
    ]) + [
        # Always 8 ranks: the three techniques on one mesh, as large runs compose them.
        Trial("3d", ["parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2", "parallel.sp=true",
                     "parallel.loss_parallel=true", "pipeline.microbatches=4", "train.micro_batch=null"],
              "pp 2 × FSDP 2 × tp 2 on 8 ranks", nproc=8),
    ]


@dataclass
class Entry:
    layout: str
    fits: bool
    peak_mem_bytes: int | None
    final_loss: float | None
    why: str
    mem: list[dict[str, int]] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "fits": self.fits, "peak_mem_bytes": self.peak_mem_bytes,
                "final_loss": self.final_loss, "mem": self.mem, "error": self.error, "why": self.why}


def _run_trial(trial: Trial, root: Path, nproc: int, budget: str, console: Console) -> Entry:
    base = DEMO_MODEL + DEMO_TRAIN + trial.overrides
    nproc = trial.nproc or nproc
    console.print(f"[bold]{trial.name}[/bold]: {trial.why} — training under a {budget} per-rank budget")
    outcome = launch(load_config(None, base + [f"train.memory_budget={budget}"]), root / trial.name, nproc)
    if outcome.ok:
        res = outcome.result
        return Entry(trial.name, True, res["peak_mem_bytes"], res["final_loss"], trial.why, res["mem"])
    console.print(f"  [red]does not fit[/red]: {outcome.message}")
    console.print(f"  measuring what it needs: {PROBE_STEPS} steps without the budget")
    probe: Outcome = launch(load_config(None, base + [f"train.steps={PROBE_STEPS}"]),
                            root / f"{trial.name}-unbounded", nproc)
    peak = probe.result["peak_mem_bytes"] if probe.ok else None
    return Entry(trial.name, False, peak, None, trial.why, probe.result["mem"] if probe.ok else [], outcome.message)


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
    entries = [_run_trial(t, run_dir, nproc, budget, console) for t in demo_trials(nproc)]
    console.print(_table(entries, budget))
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
