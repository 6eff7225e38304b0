"""Step time of each recompute policy next to no recompute, steps interleaved in one process (one rank).

    python benchmarks/training/recompute_cost.py [--preset tiny] [--seq-len 64] [--batch 2] [--rounds 15]

Each round runs one step of every variant in turn, so all see the same machine within a second; the
printed ratio is the median over rounds of (variant's step / no recompute's step in the same round).
Small shapes (tiny, seq 64) make per-operator overheads weigh as they do next to a GPU's microsecond
kernels; larger ones (small, seq 512) show the recompute's arithmetic. The `+norm ckpt` variants put
back the RMSNorm's own checkpoint inside blocks that are recomputed anyway (before this was turned off:
each norm then ran three times and added checkpoint hooks to every call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from meshfit.config import load_config  # noqa: E402
from meshfit.models.layers import RMSNorm  # noqa: E402
from meshfit.train.dist import init_distributed  # noqa: E402
from meshfit.train.run import build_run  # noqa: E402
from meshfit.train.trainer import measured_step

POLICIES = ("none", "op", "attention", "full")


def _run(env, preset: str, seq: int, batch: int, policy: str, norm_checkpoint: bool):
    overrides = [f"model.preset={preset}", f"train.seq_len={seq}", f"train.global_batch={batch}",
                 f"train.micro_batch={batch}", "train.memory_tracking=off"]
    if policy != "none":
        overrides.append(f"parallel.activation_checkpointing={policy}")
    run = build_run(load_config(None, overrides), env, None)
    if norm_checkpoint:
        for module in run.model.modules():
            if isinstance(module, RMSNorm):
                module.recompute_alone = True
    return run


def _step(run) -> float:
    inputs, targets = run.batches.next_batch()
    start = time.perf_counter()
    measured_step(run, inputs, targets)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    env = init_distributed("cpu")
    variants = {policy: (policy, False) for policy in POLICIES}
    variants.update({"op +norm ckpt": ("op", True), "full +norm ckpt": ("full", True)})
    runs = {name: _run(env, args.preset, args.seq_len, args.batch, *spec) for name, spec in variants.items()}
    for _ in range(2):  # warm-up: optimizer states, allocator
        for run in runs.values():
            _step(run)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].append(_step(run))
    print(f"{args.preset}, seq {args.seq_len}, batch {args.batch}, one rank, {os.environ['OMP_NUM_THREADS']} "
          f"thread(s), {args.rounds} rounds")
    print(f"{'policy':16s} {'median step':>12s} {'vs none':>8s}")
    for name in runs:
        ratio = statistics.median(a / b for a, b in zip(times[name], times["none"], strict=True))
        print(f"{name:16s} {statistics.median(times[name]) * 1e3:9.1f} ms {ratio:8.3f}")


if __name__ == "__main__":
    main()
