"""Held-out check of the step-time model: layouts and shapes the fit set (step_time_accuracy.py) does not use.

    python benchmarks/planner/step_time_holdout.py [--steps 8] [--rounds 3] [--quick] [--only a,b]

Each round calibrates fresh (`meshfit calibrate`'s measurement on 2 CPU ranks with the `small` model at
--calib-seq, as `meshfit calibrate --nproc 2 --model small --seq-len 128` does), then predicts and trains each
layout below (every other round in reverse order) and compares the prediction with the median steady step
(step_time_accuracy.measured). The layouts vary what the calibration did not see: micro-batches of 1 to 8,
sequences of 64 to 512 tokens, tensor parallelism with every combination of sequence and loss parallelism,
offloading, pipeline schedules, ZeRO stages, recompute policies, context parallelism and compiled blocks. Prints every layout's prediction,
measurement and error per round, then the medians over the rounds and Spearman's rank correlation.
Figures, not a test; about 5 minutes per round on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from step_time_accuracy import checked_args, measured, score

from meshfit.calibrate.measure import calibrate
from meshfit.hardware.catalog import Cluster, cpu_device
from meshfit.layout.layout import Layout, Workload
from meshfit.models.presets import get_preset
from meshfit.planner.timing.estimate import step_time

MODEL = get_preset("small")


def _w(seq: int, batch: int, compiled: bool = False) -> Workload:
    return Workload(seq_len=seq, global_batch=batch, precision="fp32", compiled=compiled)


# (workload, layout): none of these is in step_time_accuracy.py (seq 256, global batch 16, no recompute but
# one, no cp, eager).
LAYOUTS: dict[str, tuple[Workload, Layout]] = {
    "ddp mb1 s64": (_w(64, 8), Layout(dp_replicate=2, micro_batch=1)),
    "ddp mb4 s512": (_w(512, 8), Layout(dp_replicate=2, micro_batch=4)),
    "zero2 mb2 s256 gb8": (_w(256, 8), Layout(dp_shard=2, zero_stage=2, micro_batch=2)),
    "zero3 op mb4 s128": (_w(128, 16), Layout(dp_shard=2, zero_stage=3, micro_batch=4,
                                              activation_checkpointing="op")),
    "zero1 sel mb8 s128": (_w(128, 16), Layout(dp_shard=2, zero_stage=1, micro_batch=8,
                                               activation_checkpointing="selective")),
    "zero3 attn mb2 s256": (_w(256, 8), Layout(dp_shard=2, zero_stage=3, micro_batch=2,
                                               activation_checkpointing="attention")),
    "tp2 mb1 s256": (_w(256, 4), Layout(tp=2, micro_batch=1)),
    "tp2 sp mb8 s128": (_w(128, 16), Layout(tp=2, sp=True, loss_parallel=True, micro_batch=8)),
    "tp2 sp full mb4 s128": (_w(128, 8), Layout(tp=2, sp=True, loss_parallel=True, micro_batch=4,
                                                activation_checkpointing="full")),
    # Every combination of the layout's boolean switches under TP (sp, loss_parallel), and offload.
    "tp2 sp no-lp mb8 s128": (_w(128, 16), Layout(tp=2, sp=True, loss_parallel=False, micro_batch=8)),
    "tp2 lp no-sp mb4 s256": (_w(256, 8), Layout(tp=2, sp=False, loss_parallel=True, micro_batch=4)),
    "zero3 offload mb4 s128": (_w(128, 16), Layout(dp_shard=2, zero_stage=3, offload=True, micro_batch=4)),
    "pp2 1f1b mb1 s128": (_w(128, 8), Layout(pp=2, schedule="1f1b", micro_batch=1)),
    "pp2 gpipe mb4 s512": (_w(512, 8), Layout(pp=2, schedule="gpipe", micro_batch=4)),
    "pp2 zbv mb2 s256": (_w(256, 8), Layout(pp=2, schedule="zbv", virtual_stages=2, micro_batch=2)),
    "cp2 mb2 s512": (_w(512, 4), Layout(cp=2, micro_batch=2)),
    "ddp compiled mb4 s128": (_w(128, 16, compiled=True), Layout(dp_replicate=2, micro_batch=4)),
}


def _round(names: list[str], steps: int, quick: bool, seq: int, reverse: bool, root: Path
           ) -> dict[str, tuple[float, float]]:
    """A fresh calibration, then every layout predicted and trained: {name: (predicted s, measured s)}."""
    root.mkdir(parents=True)
    profile = calibrate(2, quick=quick, model=MODEL, seq=seq)
    op_us = f"{profile.op_s.fp32 * 1e6:.1f} µs per operator" if profile.op_s is not None else "no operator cost"
    print(f"calibrated 2 ranks in {profile.seconds:.0f} s: model {profile.model_flops.fp32 / 1e9:.1f} GFLOP/s, "
          f"{op_us}", flush=True)
    cluster = Cluster(cpu_device(2**40, profile), nodes=1, gpus_per_node=2)
    out = {}
    for name in reversed(names) if reverse else names:
        work, layout = LAYOUTS[name]
        predicted = step_time(MODEL, layout, work, cluster).total_s
        real = measured(layout, steps, root, MODEL, work)
        out[name] = (predicted, real)
        print(f"{name:24s} predicted {predicted * 1e3:7.0f} ms  measured {real * 1e3:7.0f} ms  error "
              f"{predicted / real - 1:+5.0%}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calib-seq", type=int, default=128, help="sequence length of the calibration")
    args = checked_args(parser)
    names = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            rounds.append(_round(names, args.steps, args.quick, args.calib_seq, r % 2 == 1, Path(tmp) / str(r)))
            within, rho = score([rounds[-1][n][0] for n in names], [rounds[-1][n][1] for n in names])
            print(f"round {r + 1}: within 25%: {within} of {len(names)}; Spearman {rho:.2f}", flush=True)
    pred = [statistics.median_low(result[n][0] for result in rounds) for n in names]
    real = [statistics.median_low(result[n][1] for result in rounds) for n in names]
    print(f"\nsmall preset, fp32, 2 CPU ranks, calibrated at seq {args.calib_seq}; medians over {args.rounds} round(s)")
    print(f"{'layout':24s} {'pred ms':>8s} {'meas ms':>8s} {'error':>6s}")
    for name, p, m in zip(names, pred, real, strict=True):
        print(f"{name:24s} {p * 1e3:8.0f} {m * 1e3:8.0f} {p / m - 1:+6.0%}")
    within, rho = score(pred, real)
    print(f"within 25%: {within} of {len(names)}; Spearman rank correlation {rho:.2f}")


if __name__ == "__main__":
    main()
