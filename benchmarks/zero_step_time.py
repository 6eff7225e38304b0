"""Step time of ZeRO-1/2/3 relative to DDP at equal work on 2 ranks (figures, not a test).

    python benchmarks/zero_step_time.py [--steps 6] [--preset small] [--micro-batch 4]

All layouts train the same model on the same global batch in this one invocation; the ratios compare runs
measured minutes apart on the same machine. Memory tracking stays on for all of them (equal overhead).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from meshfit.config import load_config
from meshfit.train.launch import launch
from meshfit.units import fmt_bytes

LAYOUTS = {
    "ddp": ["parallel.dp_replicate=2"],
    "zero1": ["parallel.dp_shard=2", "parallel.zero_stage=1"],
    "zero2": ["parallel.dp_shard=2", "parallel.zero_stage=2"],
    "zero3": ["parallel.dp_shard=2", "parallel.zero_stage=3"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    base = [f"model.preset={args.preset}", f"train.steps={args.steps}", "train.global_batch=8",
            f"train.micro_batch={args.micro_batch}", "train.seq_len=128", "train.log_every=1000"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in LAYOUTS.items():
            outcome = launch(load_config(None, base + overrides), Path(tmp) / name, 2)
            if not outcome.ok:
                raise SystemExit(f"{name} failed: {outcome.message}")
            results[name] = outcome.result
    ddp = results["ddp"]["mean_step_time_s"]
    print(f"model {args.preset}, 2 ranks, global batch 8 × 128 tokens, micro-batch {args.micro_batch}, "
          f"mean of steps 2..{args.steps}")
    for name, res in results.items():
        t = res["mean_step_time_s"]
        print(f"  {name:6s} {t * 1000:8.1f} ms/step   {t / ddp:5.2f}× DDP   peak {fmt_bytes(res['peak_mem_bytes'])}")


if __name__ == "__main__":
    main()
