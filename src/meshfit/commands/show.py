"""`meshfit show RUN_DIR...`: a summary table and plots (loss, tokens/s, per-rank memory) of runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

NAME = "show"


def add_parser(sub: Any, epilog: str) -> argparse.ArgumentParser:
    show = sub.add_parser("show", help="summary table and plots (loss, tokens/s, per-rank memory) of runs")
    show.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories of meshfit train")
    show.add_argument("--out", type=Path, metavar="DIR", help="folder for the PNG plots (default: the run "
                      "directory for one run, else show-<time>); existing plots are kept, never overwritten")
    return show


def run(args: argparse.Namespace) -> int:
    from meshfit.runs.show import ShowError, show

    try:
        show(args.runs, args.out)
    except ShowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
