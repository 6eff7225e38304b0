"""Per-rank tensor-memory measurement by category, and the per-rank memory budget.

Measurement uses torch's own trackers (TorchDispatchModes that follow every tensor storage and tag it as
parameter, gradient, optimizer state, activation, ...): MemTracker for plain and DDP models, FSDPMemTracker
for FSDP2 models (it also tells sharded from gathered parameters and gradients). The budget is enforced on
top: after every operator the live tracked bytes on the compute device are compared with the budget, so a
run that needs more than a small device would have stops at the operator that would not have fit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _UpdateType
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

from meshfit.util.units import fmt_bytes

# How torch's reference types (MemTracker's and FSDPMemTracker's names) fold into meshfit's categories.
_CATEGORIES = {
    "params": ("Parameter", "Sharded Param", "Unsharded Param", "All Gather"),
    "grads": ("Gradient", "Sharded Grad", "Unsharded Grad", "Reduce Scatter"),
    "optim": ("Optstate", "OptState"),
    "activations": ("Activation", "Temp", "Inputs"),
    "other": ("Buffer", "Other"),
}
# With offload these live in host memory. On a CUDA rank they are off the device, so out of its tally. On
# a CPU rank the host is the rank's own memory: they stay in the tally, the categories and the budget
# (offload saves nothing there), and `offloaded` says how much of the tally they are. A dry run on CPU
# that stands in for a GPU rank (`meshfit verify`) leaves them out, as the GPU would.
_HOST_RESIDENT = ("Sharded Param", "Sharded Grad", "OptState")


def _tally(snap: dict[Any, int], apart: tuple[str, ...] = ()) -> int:
    return int(snap.get(_TOTAL_KEY, 0)) - sum(int(snap.get(k, 0)) for k in apart)


def fold_snapshot(snap: dict[Any, int] | None, host: tuple[str, ...] = (), apart: bool = False) -> dict[str, int]:
    """One device's tracker snapshot as meshfit's breakdown (bytes); `peak` is the device tally. `host`:
    the types offload keeps in host memory, reported as `offloaded`; `apart`: the host is not this
    device's memory (a dry run standing in for a GPU), so they are left out of the categories and tally."""
    snap = snap or {}
    gone = host if apart else ()
    out = {name: sum(int(snap.get(t, 0)) for t in types if t not in gone) for name, types in _CATEGORIES.items()}
    out["activations_other"] = out["activations"] + out["other"]
    out["peak"] = _tally(snap, gone)
    if host:
        out["offloaded"] = sum(int(snap.get(k, 0)) for k in host)
    return out


def over_budget_text(needed: int, budget: int) -> str:
    """How far over the budget, in a unit that shows it: sizes rounded to 0.1 MiB can look equal when
    the overshoot is a few bytes."""
    return f"{fmt_bytes(needed - budget)} over"


def format_breakdown(b: dict[str, int]) -> str:
    return ", ".join(f"{k} {fmt_bytes(b[k])}" for k in ("params", "grads", "optim", "activations", "other"))


def _offloaded_note(breakdown: dict[str, int]) -> str:
    if not breakdown.get("offloaded"):
        return ""
    return (f"; {fmt_bytes(breakdown['offloaded'])} of them offloaded (on CPU ranks host memory is the "
            "rank's own, so parallel.offload saves none of the budget)")


class MemoryBudgetExceeded(RuntimeError):
    """A rank needed more tracked tensor memory than `train.memory_budget` allows."""

    def __init__(self, rank: int, phase: str, needed: int, budget: int, breakdown: dict[str, int]):
        self.rank, self.phase, self.needed, self.budget, self.breakdown = rank, phase, needed, budget, breakdown
        super().__init__(
            f"memory budget exceeded on rank {rank} during {phase}: needed {fmt_bytes(needed)} ({needed} bytes) "
            f"but the budget is {fmt_bytes(budget)} ({budget} bytes), {over_budget_text(needed, budget)}; "
            f"live tensors: {format_breakdown(breakdown)}{_offloaded_note(breakdown)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "phase": self.phase, "needed": self.needed, "budget": self.budget,
                "breakdown": self.breakdown, "message": str(self)}


class _RankTracking:
    """Budget, phase label and per-step peaks on top of a torch tracker, for one compute device.

    `phase` is set by the trainer ("forward", "backward", "optimizer step") so an overflow names where it
    happened. Enter the tracker once per optimizer step: entering starts a new peak window.
    """

    per_operator = True  # a TorchDispatchMode: torch.compile does not run under it

    def _setup(self, device: torch.device, rank: int, budget: int | None, offload: bool) -> None:
        self.device = torch.device(device)
        self.rank = rank
        self.budget = budget
        self.phase = "setup"
        # The types `offloaded` reports: on a CPU rank offload keeps them in the rank's own memory.
        self.host = _HOST_RESIDENT if (offload and self.device.type == "cpu") else ()
        self.host_apart = False  # stand_in_for_gpu()
        self._category_max: dict[Any, int] = {}

    def _device_snap(self, snaps: dict[torch.device, dict[Any, int]]) -> dict[Any, int]:
        for dev, snap in snaps.items():
            if dev.type == self.device.type and (dev.index or 0) == (self.device.index or 0):
                return snap
        return {}

    def stand_in_for_gpu(self) -> None:
        """Count as a GPU rank would (a dry run on CPU): offloaded bytes off the tally, the categories and
        the budget."""
        self.host_apart = True

    @property
    def _apart(self) -> tuple[str, ...]:
        return self.host if self.host_apart else ()

    def current(self) -> dict[str, int]:
        return fold_snapshot(self._device_snap(self._curr_mem_snap), self.host, self.host_apart)

    def peak(self) -> dict[str, Any]:
        """The breakdown at the step's peak, plus `max`: each category's (and torch type's) own maximum."""
        out: dict[str, Any] = fold_snapshot(self._device_snap(self._peak_mem_snap), self.host, self.host_apart)
        out["phase"] = getattr(self, "_peak_phase", "setup")  # the trainer's phase label at the peak
        maxima = fold_snapshot(self._category_max)
        out["max"] = {k: v for k, v in maxima.items() if k not in ("activations_other", "peak", "offloaded")}
        out["max_by_type"] = {str(k.value if hasattr(k, "value") else k): v for k, v in self._category_max.items()
                              if k != _TOTAL_KEY}
        return out

    _in_window = False  # between __enter__ and __exit__: tensors made now are followed

    def __enter__(self) -> Any:
        live = dict(self._device_snap(self._curr_mem_snap))
        self._category_max = dict(live)
        super().__enter__()
        self._in_window = True
        self._peak_mem = {self.device: _tally(live, self._apart)}
        self._peak_mem_snap = {self.device: live}
        self._peak_phase = "setup"
        return self

    def __exit__(self, *args: Any) -> None:
        self._in_window = False
        super().__exit__(*args)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # Called after every operator. torch's version also refreshes per-module peaks (a loop over all
        # modules with deep copies); meshfit reports per-rank figures only, so keep this path short.
        snap = self._device_snap(self._curr_mem_snap)
        if not snap:
            return
        live = _tally(snap, self._apart)
        if live > self._peak_mem.get(self.device, -1):
            self._peak_mem[self.device] = live
            self._peak_mem_snap = {self.device: dict(snap)}
            self._peak_phase = self.phase
        for key, value in snap.items():
            if value > self._category_max.get(key, 0):
                self._category_max[key] = value
        if self.budget is not None and live > self.budget:
            raise MemoryBudgetExceeded(self.rank, self.phase, live, self.budget, self.current())

    def settle(self) -> None:
        """Re-file what outlives the step as a buffer (`other`), at the end of an optimizer step.

        Anything still alive then and tagged activation/temp is persistent state created lazily during
        the step, such as DDP's communication buckets; counting it as activations would mislead.
        """
        for winfo, _ in list(self._WINFO.values()):
            if winfo.reftype in (self._ref_class.ACT, self._ref_class.TEMP):
                old = winfo.reftype
                winfo.reftype = self._ref_class.BUFFER
                self._update_snap(_UpdateType.REF, winfo, old_reftype=old)

    def claim_gradients(self, tensors: list[torch.Tensor]) -> None:
        """File these parameters' gradients (or these gradient tensors) as gradients.

        DDP's gradients are views into its communication buckets (allocated with the model, before any
        step); without this the tracker would report the buckets, which are the gradients, as buffers.
        ZeRO-2's bf16 gradient stash (parallel/data_parallel.py) is made by plain operators, which the
        tracker would file as temporaries. Outside the tracker's window this does nothing.
        """
        if not self._in_window:
            return
        kind = getattr(self._ref_class, "SHARDED_GRAD", None) or self._ref_class.GRAD
        for t in tensors:
            grad = t.grad if isinstance(t, nn.Parameter) else t
            if grad is not None:
                self._update_and_maybe_create_winfos(grad, kind)

    def over_budget_error(self) -> MemoryBudgetExceeded:
        """The budget error for a device out-of-memory (CUDA enforces the budget itself)."""
        live = self.current()
        return MemoryBudgetExceeded(self.rank, self.phase, live["peak"], self.budget or 0, live)


class RankMemoryTracker(_RankTracking, MemTracker):
    """Tracker for plain and DDP models (stages 0 and 1)."""

    def __init__(self, device: torch.device, rank: int, budget: int | None = None, offload: bool = False):
        MemTracker.__init__(self)
        self._setup(device, rank, budget, offload)


class PipelineMemTracker(RankMemoryTracker):
    """Tracker for pipeline stages: no module hooks (torch's ModTracker cannot follow the schedules'
    partial backward passes, which run through autograd.grad). Parameters, gradients (through hooks on
    the parameters) and optimizer states are told apart; every other tensor counts as an activation.
    """

    def __init__(self, model: nn.Module, device: torch.device, rank: int, budget: int | None = None,
                 offload: bool = False):
        super().__init__(device, rank, budget, offload)
        self._root = model

    def __enter__(self) -> PipelineMemTracker:
        live = dict(self._device_snap(self._curr_mem_snap))
        self._category_max = dict(live)
        # As MemTracker does: ops under the mode active now are tracked (a dry run's FakeTensorMode).
        self._fake_mode_on_entry = active_fake_mode()
        self._register_global_optimizer_hook()
        self._track_module_params_and_buffers(self._root, install_grad_hooks=True)
        self._track_resize()
        self._peak_mem = {self.device: _tally(live, self._apart)}
        self._peak_mem_snap = {self.device: live}
        self._peak_phase = "setup"
        TorchDispatchMode.__enter__(self)
        self._in_window = True
        return self

    def __exit__(self, *args: Any) -> None:
        self._in_window = False
        self._deregister_param_and_optimizer_hooks()
        self._restore_resize()
        TorchDispatchMode.__exit__(self, *args)


class RankFSDPMemTracker(_RankTracking, FSDPMemTracker):
    """Tracker for FSDP2 models (stages 2 and 3): tells sharded from gathered parameters and gradients."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, rank: int,
                 budget: int | None = None, offload: bool = False):
        FSDPMemTracker.__init__(self, model, optimizer)
        self._setup(device, rank, budget, offload)


def make_tracker(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, rank: int,
                 budget: int | None, offload: bool = False, pipeline: bool = False) -> _RankTracking:
    """The right tracker for `model`, already following its parameters and optimizer states."""
    if pipeline:
        tracker = PipelineMemTracker(model, device, rank, budget, offload)
    elif isinstance(model, FSDPModule):
        return RankFSDPMemTracker(model, optimizer, device, rank, budget, offload)
    else:
        tracker = RankMemoryTracker(device, rank, budget, offload)
    tracker.track_external(model, optimizer)
    return tracker


def limit_cuda_memory(device: torch.device, budget: int | None) -> None:
    """On CUDA the device's own allocator enforces the budget, as a fraction of the device's memory."""
    if budget is None or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
