"""`meshfit verify` at scale: dry runs of Llama-3 8B at 64 ranks and 70B at 256 ranks in one CPU process.

    python benchmarks/planner/verify_scale.py           # the scale cases (8B / 64 ranks, 70B / 256 ranks)
    python benchmarks/planner/verify_scale.py --all     # plus DDP, ZeRO-1/2, TP+SP+loss parallel and 1F1B layouts

Each case runs in a fresh process, so its peak RSS is its own. Prints the wall time, the process's peak RSS
and the measured rank's peak memory by component (GiB). The aim: each case in < 2 minutes and < 2 GB RSS on
a 2-core machine. The time grows with layers × micro-batches per step (each is a real forward and backward
over fake tensors), not with the model's bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

from meshfit.dryrun.verify import COMPONENTS, verify_layout
from meshfit.layout.layout import Layout, Workload

MIXED = {"precision": "mixed"}
SCALE = [
    ("8B zero3 dp=64, s=2048", "llama3-8b", Layout(dp_shard=64, zero_stage=3), Workload(2048, 64, **MIXED)),
    ("8B zero3 dp=64, s=8192", "llama3-8b", Layout(dp_shard=64, zero_stage=3), Workload(8192, 64, **MIXED)),
    ("70B zero3 dp=256, s=2048", "llama3-70b", Layout(dp_shard=256, zero_stage=3), Workload(2048, 256, **MIXED)),
    ("70B zero3 dp=32 × tp=8+sp+lp, s=8192", "llama3-70b",
     Layout(dp_shard=32, tp=8, zero_stage=3, sp=True, loss_parallel=True), Workload(8192, 64, **MIXED)),
]
OTHERS = [
    ("gpt3-125m ddp dp=8", "gpt3-125m", Layout(dp_replicate=8), Workload(2048, 64, **MIXED)),
    ("8B zero1 dp=64", "llama3-8b", Layout(dp_shard=64, zero_stage=1), Workload(2048, 64, **MIXED)),
    ("8B zero2 dp=64", "llama3-8b", Layout(dp_shard=64, zero_stage=2), Workload(2048, 64, **MIXED)),
    ("8B zero3 dp=8 × tp=8+sp+lp, s=8192", "llama3-8b",
     Layout(dp_shard=8, tp=8, zero_stage=3, sp=True, loss_parallel=True), Workload(8192, 16, **MIXED)),
    ("8B pp=4 1f1b × zero3 dp=16, mb=1", "llama3-8b", Layout(pp=4, dp_shard=16, zero_stage=3, micro_batch=1),
     Workload(4096, 128, **MIXED)),
]


def _case(model: str, layout: Layout, workload: Workload, out: mp.Queue) -> None:
    result = verify_layout(model, layout, workload)
    out.put(result.to_dict())


def run(name: str, model: str, layout: Layout, workload: Workload) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = time.perf_counter()
    proc = ctx.Process(target=_case, args=(model, layout, workload, out))
    proc.start()
    result = out.get()
    proc.join()
    total = time.perf_counter() - start
    m = result["measured"]
    parts = " ".join(f"{k} {m[k] / 2**30:6.2f}" for k in COMPONENTS)
    stages = f" stages {result['stage_ids']}" if result["stage_ids"] else ""
    print(f"{name:40s} wall {result['wall_s']:5.1f}s (process {total:5.1f}s) rss "
          f"{result['max_rss_bytes'] / 2**20:5.0f} MiB | rank {result['rank']}{stages} | GiB: {parts}", flush=True)


def main() -> None:
    cases = SCALE + (OTHERS if "--all" in sys.argv[1:] else [])
    for case in cases:
        run(*case)


if __name__ == "__main__":
    main()
