"""Bytes per parameter of each ZeRO stage: the ZeRO paper's accounting vs meshfit's planner, dry run and runs.

Run: python benchmarks/planner/zero_bytes.py [--skip-real]

Part 1 (planner only): Llama-3 8B at N = 8, 64, 1024 and a GPT with 36 layers, hidden 4096 and vocabulary
51,200 at N = 64, mixed-precision AdamW, two micro-batches per rank (so that stages 1 and 2 differ). For each
stage: the paper's model states (Rajbhandari et al. 2020, Table 1), meshfit's weights + gradients + optimizer
states at the planned peak, the part of it that is gathered compute-dtype weights beyond the paper's 16-bit
copy and the unreduced gradients of the units in flight (the working set), the model states without that
working set against the paper, and what stays between steps; all in bytes per parameter.

Part 2 (N = 2 and 4 on this machine): the `small` preset in mixed precision, seq 32, two micro-batches of
one sequence per rank. For each stage the most-loaded rank's peak as planned, dry-run (`meshfit verify`) and
measured in a real gloo run (steps 2-3), the CPU plan (backend gloo: its reduce-scatters receive chunks,
which NCCL and the dry run's fake process group do not) against the real run, and its model states (weights + gradients + optimizer states at the
peak) in bytes per parameter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from plan_accuracy import verify_in_subprocess

from meshfit.layout.layout import Layout, Workload
from meshfit.models.config import num_params
from meshfit.models.presets import get_preset
from meshfit.planner.memory.estimate import estimate_memory

GPT_36 = dataclasses.replace(get_preset("gpt3-6.7b"), n_layers=36, dim=4096, n_heads=32, vocab_size=51200)
CASES = [("llama3-8b", get_preset("llama3-8b"), n) for n in (8, 64, 1024)] + [("gpt 36×4096", GPT_36, 64)]


def paper(stage: int, n: int) -> float:
    return {0: 16.0, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]


# Gradients each stage holds by design under mixed precision with accumulation: DDP-style replicas their
# fp32 sums, stage 1 full bf16 sums, stage 2 bf16 shards (the stash), stage 3 fp32 shards.
HELD_GRADS = {0: lambda psi, n: 4 * psi, 1: lambda psi, n: 2 * psi, 2: lambda psi, n: 2 * psi / n,
              3: lambda psi, n: 4 * psi / n}


def layout(stage: int, n: int) -> Layout:
    return Layout(dp_replicate=n) if stage == 0 else Layout(dp_shard=n, zero_stage=stage)


def planner_table() -> None:
    print("model states, bytes/param (mixed-precision AdamW, 2 micro-batches per rank)")
    print(f"{'model':12s} {'N':>5s} {'stage':>5s} {'paper':>7s} {'plan':>7s} {'ratio':>6s} {'gathered':>9s} "
          f"{'unreduced':>9s} {'held':>6s} {'ratio':>6s} {'at rest':>8s}  peak phase")
    for name, model, n in CASES:
        psi = num_params(model)
        work = Workload(seq_len=2048, global_batch=2 * n, precision="mixed")
        for stage in range(4):
            est = estimate_memory(model, layout(stage, n), work)
            states = est.params + est.grads + est.optim
            # Gathered compute-dtype copies beyond the 16-bit weights the paper counts at stages 0-2.
            gathered = max(0.0, est.params - est.rest[0] - (2 * psi if stage in (1, 2) else 0))
            # Gradients beyond those the stage holds by design: units' unreduced gradients in flight.
            unreduced = max(0.0, est.grads - HELD_GRADS[stage](psi, n))
            held = (states - gathered - unreduced) / psi
            print(f"{name:12s} {n:5d} {stage:5d} {paper(stage, n):7.3f} {states / psi:7.3f} "
                  f"{states / psi / paper(stage, n):6.3f} {gathered / psi:9.3f} {unreduced / psi:9.3f} "
                  f"{held:6.3f} {held / paper(stage, n):6.3f} {est.at_rest_dict()['total'] / psi:8.3f}  "
                  f"{est.phase}", flush=True)


SMALL = get_preset("small")


def real_breakdown(lay: Layout, work: Workload) -> dict:
    """The most-loaded rank's breakdown at its peak over steps 2-3 of a real run on local gloo ranks."""
    from meshfit.config import load_config
    from meshfit.planner.planfile import plan_sections
    from meshfit.train.launch import launch

    run_dir = Path(tempfile.mkdtemp(prefix="meshfit-zero-bytes-"))
    sections = plan_sections(SMALL, work, lay)
    sections["train"].update(steps=3, device="cpu")
    outcome = launch(load_config(None, sections=sections), run_dir, lay.world_size)
    if not outcome.ok:
        raise RuntimeError(outcome.message)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return max((m for r in records if r["step"] >= 2 for m in r["mem"]), key=lambda m: m["peak"])


def measured_table(skip_real: bool) -> None:
    psi = num_params(SMALL)
    print(f"\nsmall preset ({psi / 1e6:.2f} M params), mixed precision, seq 32, 2 micro-batches per rank")
    print(f"{'N':>2s} {'stage':>5s} {'plan MiB':>9s} {'verify':>8s} {'real':>8s} {'plan/ver':>8s} {'plan/real':>9s} "
          f"{'states B/param: plan':>21s} {'verify':>7s} {'real':>7s} {'paper':>7s}   {'gloo plan':>8s} "
          f"{'gloo/real':>9s}")
    for n in (2, 4):
        work = Workload(seq_len=32, global_batch=2 * n, precision="mixed")
        for stage in range(4):
            lay = layout(stage, n)
            est = estimate_memory(SMALL, lay, work)
            gloo = estimate_memory(SMALL, lay, work, backend="gloo")  # what a CPU plan (--gpu cpu) predicts
            fake = verify_in_subprocess("small", lay, work)["measured"]
            plan_states = (est.params + est.grads + est.optim) / psi
            fake_states = (fake["params"] + fake["grads"] + fake["optim"]) / psi
            row = (f"{n:2d} {stage:5d} {est.total / 2**20:9.2f} {fake['total'] / 2**20:8.2f}")
            if skip_real:
                print(f"{row} {'-':>8s} {est.total / fake['total']:8.3f} {'-':>9s} {plan_states:21.3f} "
                      f"{fake_states:7.3f} {'-':>7s} {paper(stage, n):7.3f}", flush=True)
                continue
            real = real_breakdown(lay, work)
            real_states = (real["params"] + real["grads"] + real["optim"]) / psi
            print(f"{row} {real['peak'] / 2**20:8.2f} {est.total / fake['total']:8.3f} "
                  f"{est.total / real['peak']:9.3f} {plan_states:21.3f} {fake_states:7.3f} {real_states:7.3f} "
                  f"{paper(stage, n):7.3f}   {gloo.total / 2**20:8.2f} {gloo.total / real['peak']:9.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-real", action="store_true", help="no real CPU runs")
    args = parser.parse_args()
    planner_table()
    measured_table(args.skip_real)


if __name__ == "__main__":
    main()
