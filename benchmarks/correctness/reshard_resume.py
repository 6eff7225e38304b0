"""Resume one run under four layouts in turn and compare every loss with one process trained without a break.

    python benchmarks/correctness/reshard_resume.py [--steps-per-leg 3] [--out runs/reshard-resume]

Legs: dp_shard=4 (ZeRO-3) → dp_shard=2 (ZeRO-1) × tp=2 → dp_replicate=2 (DDP) × tp=2 → pp=2 → one process;
each resumes from the checkpoint the previous leg saved. Prints one row per step: layout, resumed loss, reference loss and |Δ|.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from rich.console import Console
from rich.table import Table

from meshfit.config import load_config
from meshfit.train.launch import launch

BASE = ["model.preset=tiny", "train.global_batch=8", "train.seq_len=64", "train.lr=3e-3", "train.warmup_steps=2",
        "train.seed=7"]
LEGS = [(["parallel.dp_shard=4"], 4), (["parallel.dp_shard=2", "parallel.zero_stage=1", "parallel.tp=2"], 4),
        (["parallel.dp_replicate=2", "parallel.tp=2"], 4), (["parallel.pp=2"], 2), ([], None)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps-per-leg", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/reshard-resume"))
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    base = [*BASE, f"train.steps={args.steps_per_leg * len(LEGS)}"]
    reference = launch(load_config(None, base), args.out / "reference")
    if not reference.ok:
        raise SystemExit(reference.message)
    table = Table(title="resume under another layout after every leg (fp32, gloo)")
    for col in ("step", "layout", "resumed loss", "one-process loss", "|Δ|"):
        table.add_column(col, justify="right")
    worst = 0.0
    for i, (overrides, nproc) in enumerate(LEGS):
        extra = [f"train.stop_after={args.steps_per_leg * (i + 1)}", *(["checkpoint.resume=true"] if i else [])]
        outcome = launch(load_config(None, [*base, *overrides, *extra]), args.out / "run", nproc)
        if not outcome.ok:
            raise SystemExit(outcome.message)
        for offset, loss in enumerate(outcome.result["losses"]):
            step = outcome.result["start_step"] + offset + 1
            ref = reference.result["losses"][step - 1]
            worst = max(worst, abs(loss - ref))
            table.add_row(str(step), outcome.result["layout"], f"{loss:.7f}", f"{ref:.7f}", f"{abs(loss - ref):.1e}")
    Console().print(table)
    print(f"max |Δloss| = {worst:.2e}")


if __name__ == "__main__":
    main()
