"""`meshfit demo`: the seed scenario on local CPU ranks.

A model whose weights + gradients + optimizer states + activations do not fit one rank's memory budget.
Every layout trains the same model on the same data under the same per-rank budget. A layout that goes over
is stopped by the budget at the operator that would not have fit; it is then run once more for a few steps
without the budget, so the table shows how much it really needs. Results go to DIR/summary.json and a
chart of the per-rank breakdown to DIR/memory.png. Each layout runs in DIR/<layout> (DIR/<layout>-unbounded
for the run without the budget); a rerun into the same DIR with --overwrite replaces those folders. DIR
is never a training run's folder, and the demo runs on 2 or 4 ranks (check_demo_args). A second scene
(long_sequences.py) runs the same model on long sequences, where activations rather than weights exceed a rank;
a third (experts.py) a Mixture-of-Experts version of it, whose gathered experts exceed a rank under ZeRO-3.

The console output fits 100 columns. Python warnings of the demo's own process (torch's among them) go to
DIR/warnings.log; the ranks keep theirs in their run folders (DIR/<layout>/warnings.log), and the
launcher's own lines go to DIR/<layout>/launch.log. The end of the output says where warnings were kept.
"""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

from rich.console import Console

from meshfit.config import Config, ConfigError
from meshfit.demo.categories import category_note
from meshfit.demo.chart import memory_chart
from meshfit.demo.experts import expert_trials, run_experts_scene
from meshfit.demo.long_sequences import long_trials, run_long_scene
from meshfit.demo.tables import accuracy_table, floor_text, make_console, measured_table, parity_text, plan_table
from meshfit.demo.trial import (
    DEMO_BUDGET,
    DEMO_GLOBAL_BATCH,
    DEMO_NPROC,
    DEMO_STEPS,
    PROBE_STEPS,
    DemoStopped,
    Trial,
    demo_config,
    run_trial,
)
from meshfit.layout.layout import Layout
from meshfit.train.preflight import check_location, held, run_contents
from meshfit.util.kept_warnings import KeptWarnings, warning_logs
from meshfit.util.units import fmt_bytes, parse_bytes


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
    trials = [*demo_trials(nproc), *long_trials(nproc), *expert_trials(nproc)]
    earlier = [p.name for p in (run_dir / "summary.json", run_dir / "long_sequences.json", run_dir / "experts.json",
                                *(run_dir / t.name for t in trials)) if p.exists()]
    if earlier and not overwrite:
        raise ConfigError(f"--run-dir {run_dir} holds an earlier demo's output ({', '.join(earlier)}): replace it "
                          "with --overwrite, or choose another --run-dir")


def run_demo(run_dir: Path, nproc: int = 2, budget: str = DEMO_BUDGET, overwrite: bool = False) -> int:
    """Run every demo layout; print the table and write summary.json. Returns the exit code (bad arguments
    raise ConfigError first: see check_demo_args)."""
    run_dir = Path(run_dir)
    with held(run_dir):  # one process at a time in the demo's folder
        check_demo_args(run_dir, nproc, overwrite)
        return _run_held(run_dir, nproc, budget)


def _run_held(run_dir: Path, nproc: int, budget: str) -> int:
    console = make_console()
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
    console.print(plan_table(trials, limit))
    entries = [run_trial(t, run_dir, budget, console) for t in trials]
    console.print(measured_table(entries, fmt_bytes(limit)))
    if note := category_note(trials, entries):
        console.print(note)
    console.print(accuracy_table(entries))
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
    run_long_scene(run_dir, nproc, console)
    run_experts_scene(run_dir, nproc, console)
    logs = warning_logs(run_dir)
    if logs:
        where = ", ".join(str(p.relative_to(run_dir)) for p, _ in logs)
        console.print(f"Warnings kept off the console: {sum(n for _, n in logs)} lines in {run_dir}: {where}")
    console.print(f"Done in {time.monotonic() - start:.0f} s. summaries: {run_dir / 'summary.json'}, "
                  f"{run_dir / 'long_sequences.json'}, {run_dir / 'experts.json'}; charts: {run_dir / 'memory.png'}, "
                  f"{run_dir / 'long_memory.png'}, {run_dir / 'experts_memory.png'}")
    return 0
