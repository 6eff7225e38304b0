"""Where one steady training step spends its time, per layout: torch.profiler on rank 0 of 2 CPU ranks.

    python benchmarks/training/profile_step.py [--only ddp,zero1] [--rows 12]

Each layout trains meshfit's `small` preset (global batch 16 × 128 tokens, micro-batches of 4) through the
trainer's own `train_step` with default settings; steps 1-4 warm up (the memory tracker runs in the first
three), step 5 is profiled. Prints the step's wall time and the operators with the most self CPU time, so
that what is neither compute nor communication the layout needs stands out.
"""

from __future__ import annotations

import argparse
import time

from meshfit.config import load_config
from meshfit.util.ranks import run_ranks

LAYOUTS = {
    "ddp": ["parallel.dp_replicate=2", "train.micro_batch=4"],
    "zero1": ["parallel.dp_shard=2", "parallel.zero_stage=1", "train.micro_batch=4"],
    "zero2": ["parallel.dp_shard=2", "parallel.zero_stage=2", "train.micro_batch=4"],
    "zero3": ["parallel.dp_shard=2", "parallel.zero_stage=3", "train.micro_batch=4"],
    "pp2 1f1b": ["parallel.pp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=4"],
}
BASE = ["model.preset=small", "train.steps=5", "train.global_batch=16", "train.seq_len=128", "train.device=cpu"]


def profile_job(overrides: list[str], rows: int) -> tuple[float, str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from meshfit.memory.host_heap import keep_freed_blocks
    from meshfit.train.dist import init_distributed
    from meshfit.train.run import build_run
    from meshfit.train.trainer import train_step

    keep_freed_blocks()  # as `meshfit train` sets on CPU ranks (run_worker)
    cfg = load_config(None, BASE + overrides)
    run = build_run(cfg, init_distributed("cpu"), None)
    for _ in range(4):
        train_step(run)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(run)
    wall = time.perf_counter() - start
    torch.distributed.barrier()
    return wall, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated layout names")
    parser.add_argument("--rows", type=int, default=12)
    args = parser.parse_args()
    for name, overrides in LAYOUTS.items():
        if args.only and name not in args.only.split(","):
            continue
        wall, table = run_ranks(profile_job, 2, overrides, args.rows, timeout_s=600)[0]
        print(f"=== {name}: steady step {wall * 1000:.0f} ms (under the profiler) ===\n{table}", flush=True)


if __name__ == "__main__":
    main()
