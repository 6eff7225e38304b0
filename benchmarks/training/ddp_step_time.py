"""Step time of one process vs 2-rank DDP at the same global batch (figures, not a test).

    python benchmarks/training/ddp_step_time.py [--steps 8] [--preset small]

Both runs train the same model on the same data in this one invocation, so the ratio is comparable even on
a noisy machine. On CPU each DDP rank gets half the cores, so the ideal ratio is about 1.0 (the same
total work on the same cores), plus the gradient all-reduce.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from meshfit.config import load_config
from meshfit.train.launch import launch


def mean_step_time(overrides: list[str], nproc: int, run_dir: Path) -> float:
    outcome = launch(load_config(None, overrides), run_dir, nproc)
    if not outcome.ok:
        raise SystemExit(f"run failed: {outcome.message}")
    return outcome.result["mean_step_time_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    base = [f"model.preset={args.preset}", f"train.steps={args.steps}", "train.global_batch=8",
            "train.seq_len=128", "train.log_every=1000"]
    with tempfile.TemporaryDirectory() as tmp:
        single = mean_step_time(base, 1, Path(tmp) / "single")
        ddp = mean_step_time(base + ["parallel.dp_replicate=2"], 2, Path(tmp) / "ddp")
    print(f"model {args.preset}, global batch 8 × 128 tokens, mean of steps 2..{args.steps}")
    print(f"  1 process      : {single * 1000:8.1f} ms/step")
    print(f"  DDP, 2 ranks   : {ddp * 1000:8.1f} ms/step")
    print(f"  ratio DDP/single: {ddp / single:.2f}")


if __name__ == "__main__":
    main()
