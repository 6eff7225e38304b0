"""How sure a planned step time is: what its rates rest on, the error measured for that basis, and which
layouts lie within that error of each other (their order then says nothing).

The error figures are the largest errors measured for each basis (README, "Step time"):

* calibrated on the model (`meshfit calibrate --model`): benchmarks/planner/step_time_holdout.py, 14 layouts and
  shapes the calibration did not see, on 2 CPU ranks (medians of 3 rounds): the largest error was 19%, but
  for cp 2, which read −28% in rounds that other work slowed and −17%, −21% and +3% alone on a quiet host
  (one round beyond 19%; the median within). While other work shared the cores the largest error of an
  earlier release was 51%;
* datasheet peaks with published per-kernel rates: benchmarks/planner/published_large_runs.py and
  published_throughput.py against published throughput of large runs (large models and batches, where the
  per-operator cost is negligible; eager steps with few tokens run slower than planned, as the datasheet
  model charges nothing per operator): Megatron-LM's 1.7B-530B GPTs on 32-2520 A100s −13% to 0%, the
  FSDP runs of llm-foundry (MPT-70B) and torchtitan (Llama 2/3 70B) on 32-64 A100s +19% to +27% (the plan
  faster). Beyond it: torchtitan's Llama-3 8B on H100s capped at 500 W (+41%; the published rates are the
  700 W part's) and DeepSpeed's pipeline engine and ZeRO-3 of 2021-22, which measure those implementations
  (MT-NLG +26% to +31%, ZeRO-3 175B +55% to +319%);
* kernel rates only (`meshfit calibrate` without --model): no measured error; the generic element-wise
  traffic and the missing per-operator cost make it no better than the datasheet's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshfit.hardware.kernels import kernel_rates
from meshfit.util.units import fmt_bytes

if TYPE_CHECKING:
    from meshfit.hardware.catalog import GPU

MODEL_CALIBRATED_ERROR = 0.19
DATASHEET_ERROR = 0.3


@dataclass(frozen=True)
class TimeBasis:
    """What a device's step times rest on (``label``), the error measured for it, and what is missing."""

    label: str
    error: float  # relative: a time t may be anywhere in t·(1 ± error)
    lacks: tuple[str, ...]
    rests_on: tuple[str, ...] = ()  # measured parts worth naming (collectives' sizes, compiled launches)


def time_basis(gpu: GPU, compiled: bool = False) -> TimeBasis:
    """The basis of the step times planned on ``gpu`` (``compiled``: for compiled blocks)."""
    prof = gpu.profile
    if prof is None:
        return TimeBasis("datasheet peaks × published per-kernel rates (matmuls by shape, attention kernel)",
                         DATASHEET_ERROR, ("a measured rate", "the cost per dispatched operator (small eager steps "
                                           "run slower)", *kernel_rates(gpu.name).assumed))
    lacks, rests_on = list(prof.lacks()), []
    sizes = sorted({b for ops in (prof.collective_times or {}).values() for t in ops.values() for b in t})
    if sizes:
        rests_on.append(f"collectives timed at the calibrated model's message sizes ({fmt_bytes(sizes[0])}–"
                        f"{fmt_bytes(sizes[-1])}, interpolated; the bandwidth/latency line beyond them)")
    if compiled and prof.op_s is not None:  # launches only cost time at a measured cost per operator
        ratios = prof.launches_per_heavy()
        if ratios:
            ratio = ratios.get("none", min(ratios.values()))
            rests_on.append(f"compiled blocks' kernel launches as counted ({ratio:.2f} per matmul/attention operator)")
        else:
            lacks.append("a counted launch count of compiled blocks (2 per matmul/attention operator assumed; "
                         "calibrate with --model)")
    label, error = (("calibrated on the model's own code", MODEL_CALIBRATED_ERROR) if prof.model_flops is not None
                    else ("calibrated kernel rates with generic element-wise traffic", DATASHEET_ERROR))
    return TimeBasis(label, error, tuple(lacks), tuple(rests_on))


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
