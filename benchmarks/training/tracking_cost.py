"""What measuring a step's memory costs: tracked vs untracked step time, steps interleaved in one process.

    python benchmarks/training/tracking_cost.py [--pairs 12] [--only small,tiny]

One CPU process, one thread, a world of one (gloo): meshfit's `small` preset at seq 256 and `tiny` at seq 64,
global batch 2, through the trainer's own `measured_step`. Each pair runs one step per way, the ways in
turns, so drift (heap growth, thermal) falls on all of them alike; the first pairs warm up and are left
out. The ways:

* `ops`: under the per-operator tracker (memory/tracker.py), as CPU ranks and `train.memory_tracking=ops`
  or `full` measure;
* `allocator`: the phase-boundary attribution that CUDA ranks use by default (memory/allocator.py), here
  reading a counter that returns 0: what it costs beyond the CUDA allocator's own counters (which are
  C++ reads: a CUDA device is needed to time them, none is used here).

Prints each way's median step time and its ratio to the untracked median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from meshfit.config import load_config
from meshfit.memory.allocator import AllocatorTracker
from meshfit.memory.meter import MemoryMeter
from meshfit.train.dist import RankEnv
from meshfit.train.run import build_run
from meshfit.train.trainer import measured_step

CASES = {"small": ("small", 256), "tiny": ("tiny", 64)}
WARMUP = 3


class _ZeroAllocator:
    """A counter that costs nothing: isolates the attribution's own Python work."""

    def allocated(self) -> int:
        return 0

    def peak(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass


def _step(run, meter: MemoryMeter, tracker) -> float:
    run.meter, run.tracker = meter, tracker
    inputs, targets = run.batches.next_batch()
    start = time.perf_counter()
    measured_step(run, inputs, targets)
    return time.perf_counter() - start


def measure(preset: str, seq_len: int, pairs: int) -> dict[str, float]:
    cfg = load_config(None, [f"model.preset={preset}", f"train.seq_len={seq_len}", "train.global_batch=2",
                             "train.device=cpu", "train.steps=1000"])
    cpu = torch.device("cpu")
    run = build_run(cfg, RankEnv(rank=0, world_size=1, local_rank=0, device=cpu), None)
    ops_tracker = run.tracker
    light = AllocatorTracker(run.model, run.optimizer, cpu, _ZeroAllocator())
    ways = {"untracked": (MemoryMeter(ops_tracker, cpu, "off", 1, None), ops_tracker),
            "ops": (MemoryMeter(ops_tracker, cpu, "full", 1, None), ops_tracker),
            "allocator": (MemoryMeter(light, cpu, "full", 1, None), light)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(WARMUP + pairs):
        for name, (meter, tracker) in ways.items():
            seconds = _step(run, meter, tracker)
            if i >= WARMUP:
                times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--only", default="", help="comma-separated case names: " + ", ".join(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for name, (preset, seq_len) in CASES.items():
            if args.only and name not in args.only.split(","):
                continue
            med = measure(preset, seq_len, args.pairs)
            base = med["untracked"]
            print(f"{name} (seq {seq_len}, batch 2, {args.pairs} steps per way): untracked {base * 1000:.1f} ms; "
                  + "; ".join(f"{way} {med[way] * 1000:.1f} ms = {med[way] / base:.2f}x"
                              for way in ("ops", "allocator")), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
