"""Why a demo layout's measured breakdown can differ per category from the plan's while the peaks agree.

The plan files bytes by what they hold (a gradient bucket is gradients, FSDP's gathered copy of a weight is
parameters); torch's tracker, which the measured breakdown comes from, files a tensor by what made it, and an
operator's output is an activation unless the tracker knows better. Where that moves a layout's bytes between
columns, the demo says which bytes and why, from the layout and the planner's peak phase.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshfit.demo.trial import Entry, Trial

# The plan's categories and the measured ones they match (the tracker files buffers under `other`).
_SAME_CATEGORY = (("params", "params"), ("grads", "grads"), ("optim", "optim"), ("activations", "activations"),
                  ("buffers", "other"))


def filed_apart(entry: Entry) -> bool:
    """Whether the two breakdowns disagree per category by more than their totals do (plus 5% of the
    peak): the same bytes, filed under other names."""
    worst = max(entry.mem, key=lambda m: m["peak"]) if entry.mem else None
    if not worst or not entry.predicted or not entry.peak_mem_bytes:
        return False
    apart = sum(abs(entry.predicted[p] - worst.get(m, 0)) for p, m in _SAME_CATEGORY)
    return apart > 2 * abs(entry.predicted["total"] - entry.peak_mem_bytes) + 0.05 * entry.peak_mem_bytes


def _why_filed_apart(trial: Trial, entry: Entry) -> str:
    layout = trial.layout
    if entry.predicted_phase == "bucket rebuild":
        # DDP re-orders its buckets in step 2's forward; the new ones are made by operators there.
        return "the tracker counts DDP's gradient buckets, rebuilt in step 2's forward, as activations (the " \
               "plan: grads)"
    if layout.pp > 1 and layout.zero_stage >= 1 and layout.dp_shard > 1:
        # The pipeline tracker has no FSDP hooks (memory/tracker.py, PipelineMemTracker).
        return "inside pipeline stages the tracker counts FSDP's gathered weights and unsharded gradients " \
               "mostly as activations (the plan: params, grads)"
    measured = max(entry.mem, key=lambda m: m["peak"]).get("phase", "?")
    return f"the peak came in another phase than planned (planned: {entry.predicted_phase}; measured: {measured})"


def category_note(trials: list[Trial], entries: list[Entry]) -> str | None:
    """Why a layout's measured categories differ from the plan's while its peak agrees, when one does."""
    reasons = [f"{e.layout}: {_why_filed_apart(t, e)}" for t, e in zip(trials, entries, strict=True)
               if filed_apart(e)]
    if not reasons:
        return None
    return f"Why some rows' categories differ from the plan's while their peaks agree: {'; '.join(reasons)}."
