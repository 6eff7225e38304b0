"""When a step's memory is measured, and what a step's record says about it.

The per-operator trackers (memory/tracker.py) see every tensor by category, at the price of a Python call on
every operator; the allocator attribution (memory/allocator.py) reads the CUDA allocator's counters at phase
boundaries instead, at no per-operator cost. ``train.memory_tracking`` chooses:

* ``auto`` (default): on CUDA ranks, the allocator attribution on every step (``"measured": "allocator"``).
  On CPU ranks as ``ops``.
* ``ops``: the per-operator tracker on the first ``train.memory_tracked_steps`` steps of each launch
  (optimizer states appear in step 1, DDP re-orders its buckets in step 2, step 3 is steady), and every
  step when a CPU budget must be enforced (on CPU the tracker is the budget). Later steps carry the last
  measured breakdown over, marked ``"measured": "carried"``, and cost nothing per operator.
* ``full``: the per-operator tracker on every step. ``off``: no step (refused with a CPU budget); each
  record's peak is then the rank's counter below (``"measured": "counter"``), with no breakdown.

After each step the per-operator tracker runs in ``auto``/``ops`` (not when it runs every step, under a CPU
budget or ``full``), the C heap's free pages go back to the OS (``host_heap.return_free_heap``).

Growth after tracking stops is still caught: every carried step reads each rank's own counter — the CUDA
allocator's peak since the last reading, or on CPU the process's peak resident memory — and when any rank's
counter exceeds what the tracked steps reached by more than ``GROWTH`` (and ``GROWTH_MIN_BYTES``), the next
step is tracked again (its record says ``"retracked": true``) and its breakdown replaces the carried one.
Every step's counter is read when the step's vote is cast (train/vote.py: the one small collective of a
step, before the optimizer steps), and carried steps take every rank's counter from it. So a step's CUDA
counter covers the previous step's optimizer step and its own forward and backward (on CPU the process's
peak so far covers everything before), and growth in an optimizer step is seen one step later.
"""

from __future__ import annotations

import resource
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.memory.allocator import AllocatorTracker, CudaAllocator
from meshfit.memory.host_heap import return_free_heap
from meshfit.memory.tracker import make_tracker

GROWTH = 0.05
GROWTH_MIN_BYTES = 32 * 2**20


def _counter(device: torch.device) -> int:
    """The CUDA allocator's peak since the previous reading, or the process's peak resident bytes (CPU)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _counter_key(device: torch.device) -> str:
    return "device_peak" if device.type == "cuda" else "rss_peak"


def uses_allocator(mode: str, device: torch.device) -> bool:
    """Whether a rank measures every step from the allocator's counters instead of per operator."""
    return mode == "auto" and device.type == "cuda"


def rank_tracker(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, rank: int, mode: str,
                 budget: int | None, offload: bool = False, pipeline: bool = False) -> Any:
    """The measurement `train.memory_tracking` (`mode`) asks for on this rank."""
    if uses_allocator(mode, device):
        return AllocatorTracker(model, optimizer, device, CudaAllocator(device), rank, budget)
    return make_tracker(model, optimizer, device, rank, budget, offload, pipeline=pipeline)


class MemoryMeter:
    """Decides per step whether the tracker runs, and builds every rank's memory record."""

    def __init__(self, tracker: Any, device: torch.device, mode: str, tracked_steps: int,
                 budget: int | None) -> None:
        self.tracker = tracker
        self.device = device
        if uses_allocator(mode, device):
            mode = "allocator"
        elif mode == "auto":
            mode = "ops"
        self.mode = "full" if (budget is not None and device.type == "cpu" and mode == "ops") else mode
        self.tracked_steps = tracked_steps
        self.steps = 0  # steps measured by this process
        self._retrack = False
        self._carried: list[dict[str, Any]] | None = None
        self._baseline = 0  # the highest counter of any tracked step, per this rank
        self._reading: int | None = None  # this step's counter (reading())

    def tracking(self) -> bool:
        """Whether the coming step runs under the tracker."""
        if self.mode in ("full", "allocator"):
            return True
        if self.mode == "off":
            return False
        return self.steps < self.tracked_steps or self._retrack or self._carried is None

    def reading(self) -> tuple[int, bool]:
        """This rank's counter, read as the step's vote is cast, and whether it grew past what the tracked
        steps reached (which only a carried step acts on). The allocator attribution owns the device's
        peak counter (it resets it at each phase): its reading is the step's peak so far."""
        if self.mode == "allocator":
            self._reading = self.tracker.step_peak()
            return self._reading, False
        counter = self._reading = _counter(self.device)
        grew = (self._carried is not None and counter > self._baseline * (1 + GROWTH)
                and counter - self._baseline > GROWTH_MIN_BYTES)
        return counter, grew

    def records(self, world_size: int, extra: dict[str, Any],
                counters: list[tuple[int, bool]] | None) -> tuple[list[dict[str, Any]], bool]:
        """Every rank's memory record of the step just run, and whether it was re-tracked. Tracked steps
        gather the breakdowns (a collective); the others take every rank's `reading()` from the vote."""
        tracked, retracked = self.tracking(), self._retrack
        self.steps += 1
        self._retrack = False
        if not tracked:
            assert counters is not None and len(counters) == world_size
            return self._carry(counters), False
        counter = self._reading
        assert counter is not None, "reading() comes first, as the step's vote is cast"
        if self.mode == "ops":
            return_free_heap()
        mem = self.tracker.peak()
        mem["rest"] = self.tracker.current()  # what stays resident between steps
        allocator = self.mode == "allocator"
        mem.update(extra, measured="allocator" if allocator else "tracker")
        # The allocator's peak over the whole step (the reading came before its optimizer step).
        mem[_counter_key(self.device)] = mem["peak"] if allocator else counter
        per_rank: list[dict[str, Any]] = [{} for _ in range(world_size)]
        dist.all_gather_object(per_rank, mem)
        self._carried = per_rank
        self._baseline = max(self._baseline, counter)
        return per_rank, retracked

    def compiled(self) -> None:
        """The step just recorded compiled (train.compile): the counter's growth in it is the compiler's own
        memory, and a re-tracked step would run the blocks eagerly, so the counter becomes the baseline
        instead of the next step being tracked again."""
        self._retrack = False
        self._baseline = max(self._baseline, self._reading or 0)

    def _carry(self, counters: list[tuple[int, bool]]) -> list[dict[str, Any]]:
        self._retrack = any(grew for _, grew in counters)
        key = _counter_key(self.device)
        if self._carried is None:  # `off`: no breakdown was ever measured; the counter is the peak
            return [{"peak": value, "measured": "counter", key: value} for value, _ in counters]
        return [dict(mem, measured="carried", **{key: value}) for mem, (value, _) in zip(self._carried, counters,
                                                                                       strict=True)]
