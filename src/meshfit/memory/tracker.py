"""Per-rank tensor-memory measurement by category, and the per-rank memory budget.

Measurement uses torch's own MemTracker (a TorchDispatchMode that follows every tensor storage and tags it
as parameter, gradient, optimizer state, activation, ...). The budget is enforced on top of it: after every
operator the live tracked bytes on the compute device are compared with the budget, so a run that needs more
than a small device would have stops at the operator that would not have fit, on CPU as on GPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._tools.mem_tracker import (
    _TOTAL_KEY,
    MemTracker,
    _MemRefType,
    _UpdateType,
)

from meshfit.units import fmt_bytes

# How torch's reference types fold into the categories meshfit reports.
_CATEGORIES = {
    "params": (_MemRefType.PARAM,),
    "grads": (_MemRefType.GRAD,),
    "optim": (_MemRefType.OPT,),
    "activations": (_MemRefType.ACT, _MemRefType.TEMP),
    "other": (_MemRefType.BUFFER, _MemRefType.OTH),
}
BREAKDOWN_KEYS = ("params", "grads", "optim", "activations", "other", "activations_other", "peak")


def fold_snapshot(snap: dict[Any, int] | None) -> dict[str, int]:
    """One device's MemTracker snapshot as meshfit's breakdown (bytes)."""
    snap = snap or {}
    out = {name: sum(int(snap.get(t, 0)) for t in types) for name, types in _CATEGORIES.items()}
    out["activations_other"] = out["activations"] + out["other"]
    out["peak"] = int(snap.get(_TOTAL_KEY, 0))
    return out


def format_breakdown(b: dict[str, int]) -> str:
    return ", ".join(f"{k} {fmt_bytes(b[k])}" for k in ("params", "grads", "optim", "activations", "other"))


class MemoryBudgetExceeded(RuntimeError):
    """A rank needed more tracked tensor memory than `train.memory_budget` allows."""

    def __init__(self, rank: int, phase: str, needed: int, budget: int, breakdown: dict[str, int]):
        self.rank, self.phase, self.needed, self.budget, self.breakdown = rank, phase, needed, budget, breakdown
        super().__init__(
            f"memory budget exceeded on rank {rank} during {phase}: needed {fmt_bytes(needed)} ({needed} bytes) "
            f"but the budget is {fmt_bytes(budget)} ({budget} bytes); live tensors: {format_breakdown(breakdown)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "phase": self.phase, "needed": self.needed, "budget": self.budget,
                "breakdown": self.breakdown, "message": str(self)}


class RankMemoryTracker(MemTracker):
    """MemTracker restricted to one compute device, with an optional budget and a phase label.

    `phase` is set by the trainer ("forward", "backward", "optimizer step") so an overflow names where it
    happened. Enter the tracker once per optimizer step: entering resets the peak to the current live bytes.
    """

    def __init__(self, device: torch.device, rank: int, budget: int | None = None):
        super().__init__()
        self.device = torch.device(device)
        self.rank = rank
        self.budget = budget
        self.phase = "setup"
        self._category_max: dict[Any, int] = {}

    def _device_snap(self, snaps: dict[torch.device, dict[Any, int]]) -> dict[Any, int]:
        for dev, snap in snaps.items():
            if dev.type == self.device.type and (dev.index or 0) == (self.device.index or 0):
                return snap
        return {}

    def current(self) -> dict[str, int]:
        return fold_snapshot(self._device_snap(self._curr_mem_snap))

    def peak(self) -> dict[str, int]:
        """The breakdown at the moment of the peak, plus `max`: each category's own maximum."""
        out = fold_snapshot(self._device_snap(self._peak_mem_snap))
        out["max"] = {k: v for k, v in fold_snapshot(self._category_max).items() if k != "activations_other"}
        return out

    def __enter__(self) -> RankMemoryTracker:
        # Peaks are per optimizer step: entering starts a new window from the live bytes.
        self._category_max = dict(self._device_snap(self._curr_mem_snap))
        super().__enter__()
        self._peak_mem = {self.device: int(self._category_max.get(_TOTAL_KEY, 0))}
        self._peak_mem_snap = {self.device: dict(self._category_max)}
        return self

    def _update_peak_stats(self, peak_state: Any) -> None:
        # Called after every operator. torch's version also refreshes per-module peaks (a loop over all
        # modules with deep copies); meshfit reports per-rank figures only, so keep this path short.
        snap = self._device_snap(self._curr_mem_snap)
        if not snap:
            return
        live = int(snap.get(_TOTAL_KEY, 0))
        if live > self._peak_mem.get(self.device, -1):
            self._peak_mem[self.device] = live
            self._peak_mem_snap = {self.device: dict(snap)}
        for key, value in snap.items():
            if value > self._category_max.get(key, 0):
                self._category_max[key] = value
        if self.budget is not None and live > self.budget:
            raise MemoryBudgetExceeded(self.rank, self.phase, live, self.budget, self.current())

    def settle(self) -> None:
        """Re-file what outlives the step as `other` (end of an optimizer step, activations freed).

        Anything still alive then and tagged activation/temp is persistent state created lazily during
        the step, such as DDP's communication buckets; counting it as activations would mislead.
        """
        for winfo, _ in list(self._WINFO.values()):
            if winfo.reftype in (_MemRefType.ACT, _MemRefType.TEMP):
                old = winfo.reftype
                winfo.reftype = _MemRefType.OTH
                self._update_snap(_UpdateType.REF, winfo, old_reftype=old)

    def over_budget_error(self) -> MemoryBudgetExceeded:
        """The budget error for a device out-of-memory (CUDA enforces the budget itself)."""
        live = self.current()
        return MemoryBudgetExceeded(self.rank, self.phase, live["peak"], self.budget or 0, live)


def limit_cuda_memory(device: torch.device, budget: int | None) -> None:
    """On CUDA the device's own allocator enforces the budget, as a fraction of the device's memory."""
    if budget is None or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
