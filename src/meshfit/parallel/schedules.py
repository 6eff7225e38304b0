"""The pipeline schedules meshfit runs: one table for training, planning and validation (no torch import)."""

from __future__ import annotations

# meshfit name -> (torch schedule class name, stages per rank: None = any ≥ 2, V-shaped stage placement)
SCHEDULES: dict[str, tuple[str, int | None, bool]] = {
    "gpipe": ("GPipe", 1, False),
    "1f1b": ("1F1B", 1, False),
    "interleaved-1f1b": ("Interleaved1F1B", None, False),
    "interleaved-zb": ("InterleavedZeroBubble", None, False),
    "zbv": ("ZBVZeroBubble", 2, True),
    "dualpipev": ("DualPipeV", 2, True),
}
SCHEDULE_NAMES = tuple(SCHEDULES)


def fixed_virtual_stages(schedule: str) -> int | None:
    """Stages per rank the schedule runs, or None when it runs any number ≥ 2 (interleaved schedules)."""
    return SCHEDULES[schedule][1]


def default_virtual_stages(schedule: str) -> int:
    fixed = fixed_virtual_stages(schedule)
    return fixed if fixed is not None else 2


def v_shaped(schedule: str) -> bool:
    """Stage r and 2p−1−r on rank r (the V schedules); otherwise round-robin."""
    return SCHEDULES[schedule][2]
