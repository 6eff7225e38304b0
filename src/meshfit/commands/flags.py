"""Flag types and help shared by the commands: argparse refuses a bad value naming the flag (exit 2),
before anything is computed."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshfit.train.capacity import RANK_MIN_BYTES, RANKS_PER_CORE
from meshfit.util.units import parse_bytes


def _number(kind: type, what: str, ok: Callable[[float], bool]) -> Callable[[str], Any]:
    """An argparse type: `kind(text)` that passes `ok`, else an error saying `expected {what}`."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value
    return parse


positive_int = _number(int, "a positive integer", lambda v: v >= 1)
positive_float = _number(float, "a positive number", lambda v: 0 < v < math.inf)
probability = _number(float, "a probability in [0, 1)", lambda v: 0 <= v < 1)
at_least_one = _number(float, "a number ≥ 1", lambda v: 1 <= v < math.inf)


def memory_size(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 64GiB, got {text!r}")
    return value


OVERSUBSCRIBE_HELP = (f"start more local ranks than this machine holds ({RANKS_PER_CORE} per core, at least "
                      f"{RANK_MIN_BYTES // 2**20} MiB of available memory each; refused without it)")


def default_run_dir(kind: str) -> Path:
    """runs/<kind>-<time>: where a command writes when no --run-dir is given."""
    return Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
