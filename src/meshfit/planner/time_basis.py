"""How sure a planned step time is: what its rates rest on, the error measured for that basis, and which
layouts lie within that error of each other (their order then says nothing).

The error figures are the largest errors measured for each basis (README, "Step time"):

* calibrated on the model (`meshfit calibrate --model`): benchmarks/step_time_holdout.py, 14 layouts and
  shapes the calibration did not see, on 2 CPU ranks of an otherwise quiet host (medians of 3 rounds;
  while other work shared the cores the largest error was 51%);
* datasheet peaks: benchmarks/published_throughput.py against two published runs (large models and
  batches, where the per-operator cost is negligible; eager steps with few tokens run slower than planned,
  as the datasheet model charges nothing per operator);
* kernel rates only (`meshfit calibrate` without --model): no measured error; the generic element-wise
  traffic and the missing per-operator cost make it no better than the datasheet's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshfit.planner.hardware import GPU

MODEL_CALIBRATED_ERROR = 0.16
DATASHEET_ERROR = 0.25


@dataclass(frozen=True)
class TimeBasis:
    """What a device's step times rest on (``label``), the error measured for it, and what is missing."""

    label: str
    error: float  # relative: a time t may be anywhere in t·(1 ± error)
    lacks: tuple[str, ...]


def time_basis(gpu: GPU) -> TimeBasis:
    """The basis of the step times planned on ``gpu``."""
    prof = gpu.profile
    if prof is None:
        return TimeBasis("datasheet peaks × generic efficiencies", DATASHEET_ERROR,
                         ("a measured rate", "the cost per dispatched operator (small eager steps run slower)"))
    lacks = tuple(prof.lacks())
    if prof.model_flops is not None:
        return TimeBasis("calibrated on the model's own code", MODEL_CALIBRATED_ERROR, lacks)
    return TimeBasis("calibrated kernel rates with generic element-wise traffic", DATASHEET_ERROR, lacks)


def close_runs(times: list[float], error: float) -> list[tuple[int, int]]:
    """(first, last) index ranges of consecutive ``times`` (as listed) within ``error`` of each other: the
    longest of a run is at most (1 + error) × its shortest. Runs of one are left out."""
    ratio = 1.0 + error
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(times) + 1):
        if i == len(times) or not _close(times[start:i] + [times[i]], ratio):
            if i - start > 1:
                runs.append((start, i - 1))
            start = i
    return runs


def _close(times: list[float], ratio: float) -> bool:
    return max(times) <= min(times) * ratio
