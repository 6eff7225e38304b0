"""`meshfit demo`: the seed scenario, a model over a per-rank memory budget on local CPU ranks."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from meshfit.commands.flags import OVERSUBSCRIBE_HELP, default_run_dir, positive_int
from meshfit.train.capacity import check_local_ranks

NAME = "demo"


def add_parser(sub: Any, epilog: str) -> argparse.ArgumentParser:
    demo = sub.add_parser("demo", help="the seed scenario: a model over a per-rank memory budget")
    demo.add_argument("--run-dir", type=Path, metavar="DIR", help="output folder (default runs/demo-<time>)")
    demo.add_argument("--nproc", type=positive_int, default=2, metavar="N", help="local CPU ranks: 2 (default) or 4")
    demo.add_argument("--overwrite", action="store_true", help="replace an earlier demo's output in --run-dir")
    demo.add_argument("--oversubscribe", action="store_true", help=OVERSUBSCRIBE_HELP)
    return demo


def run(args: argparse.Namespace) -> int:
    from meshfit.demo.run import check_demo_args, demo_trials, run_demo

    run_dir = args.run_dir or default_run_dir("demo")
    check_demo_args(run_dir, args.nproc, args.overwrite)  # which rank counts mean something comes first
    most = max(trial.nproc for trial in demo_trials(args.nproc))
    check_local_ranks(most, args.oversubscribe, f"--nproc {args.nproc}" if most == args.nproc else
                      f"the demo's layouts run up to {most} ranks")
    return run_demo(run_dir, nproc=args.nproc, overwrite=args.overwrite)
