"""Which step records stand for the run's steady state (step-time and tokens/s figures)."""

from __future__ import annotations

from typing import Any


def steady_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of steps that ran as the run's later steps do.

    Left out: the first step (allocator, first gathers, lazy optimizer states warm up), steps that compiled
    (``compile_s``: torch.compile builds its graphs inside them) and, in compiled runs, the memory-tracked
    steps that ran their blocks eagerly (``"blocks": "eager"``). When nothing is left, every step but the
    first (or the only one) stands in.
    """
    later = records[1:] if len(records) > 1 else records
    steady = [r for r in later if not r.get("compile_s") and r.get("blocks") != "eager"]
    return steady or later
