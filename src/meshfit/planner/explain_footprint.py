"""`--explain`'s footprint lines: what the recommended layout's own working memory depends on.

Three settings change a rank's peak without changing the layout's degrees: ZeRO-3's unit size
(`parallel.max_unit_params`: how much is gathered at once), the reduction dtype of the gradients
(`parallel.reduce_dtype`) and, in a pipeline, the step's micro-batch count (which the rank's peak does not
follow: the schedule keeps a fixed number in flight). Each line says what the setting is worth here and
whether it decides the fit.
"""

from __future__ import annotations

import dataclasses

from meshfit.planner.memory.estimate import MemoryEstimate, estimate_memory
from meshfit.planner.search import Candidate, Plan, backend
from meshfit.util.units import fmt_bytes

_WHOLE_BLOCKS = 10**15  # max_unit_params that never splits a block


def footprint_lines(plan: Plan, usable: float) -> list[str]:
    """The lines for the recommended layout (or, when nothing fits, the closest one); empty when none of
    the three settings applies to it."""
    chosen: Candidate | None = plan.best or (plan.candidates[0] if plan.candidates else None)
    if chosen is None:
        return []
    lay, mem = chosen.layout, chosen.memory

    def with_(**changes) -> MemoryEstimate:
        return estimate_memory(plan.model, dataclasses.replace(lay, **changes), plan.workload,
                               backend(plan.cluster))

    lines = []
    if lay.zero_stage == 3 and lay.shard > 1:
        whole = with_(max_unit_params=_WHOLE_BLOCKS)
        if whole.total > mem.total:
            decides = " and would not fit: the unit size decides the fit" if whole.total > usable >= mem.total else ""
            lines.append(f"- ZeRO-3 gathers units of at most {lay.max_unit_params:,} parameters "
                         f"(parallel.max_unit_params), not whole blocks: {fmt_bytes(mem.total)} per rank; one unit "
                         f"per block would need {fmt_bytes(whole.total)}{decides}.")
    if plan.workload.precision == "mixed" and lay.zero_stage >= 2 and lay.reduce_dtype == "fp32":
        low = with_(reduce_dtype="compute")
        if low.total < mem.total:
            decides = " — that decides the fit" if mem.total > usable >= low.total else ""
            lines.append(f"- gradients reduced in bf16 (parallel.reduce_dtype=compute, DeepSpeed's default) instead "
                         f"of fp32: {fmt_bytes(mem.total)} → {fmt_bytes(low.total)} per rank{decides}; the sum is "
                         "rounded to bf16.")
    if lay.pp > 1:
        more = dataclasses.replace(plan.workload, global_batch=4 * plan.workload.global_batch)
        four = estimate_memory(plan.model, lay, more, backend(plan.cluster))
        lines.append(f"- the pipeline's micro-batch count barely moves this peak: schedule {lay.schedule} keeps a "
                     f"fixed number of micro-batches in flight per rank (4× the global batch: {fmt_bytes(four.total)} "
                     f"per rank, against {fmt_bytes(mem.total)}); more micro-batches shrink the bubble, not memory.")
    return ["", f"What else decides the footprint of {lay.describe()}:", *lines] if lines else []
