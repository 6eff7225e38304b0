"""A step's memory by category from the allocator's own counters, with no per-operator hook.

The per-operator trackers (tracker.py) call Python on every operator, which on a GPU costs a multiple of a
step of microsecond kernels. This measurement reads the allocator at the phase boundaries the trainer
already marks (`phase` = "forward", "backward", "optimizer step", ...): each phase's peak, then a fresh
peak window. The breakdown is the phase with the highest peak:

* params, grads, optim: the tensors the rank is known to hold, on its compute device, storages counted once
  (by data pointer): the model's registered parameters (a DTensor's local shard), their gradients (and
  gradients claimed with `claim_gradients`, ZeRO-2's stash) and the optimizer's states. They are read at
  the phase's start, except in the optimizer step, read after `optimizer.step()` (states made by the first
  step are there; the gradients are not yet freed);
* other: the model's buffers, and what the allocator held when the step began that is none of the above
  (state that outlives steps);
* activations: the rest of the phase's peak. Without per-operator hooks nothing else can be told apart: it
  also holds FSDP's gathered parameters and unreduced gradients, gradients made during the phase (a
  backward's peak is usually at its start, before most of them exist), and any temporary buffer.

`peak` is the allocator's peak. The counters come through `Allocator` (allocated, peak, reset_peak), so the
attribution runs on CPU in tests with a stand-in that counts live tensor bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshfit.memory.tracker import MemoryBudgetExceeded

_KNOWN = ("params", "grads", "optim", "other")


class Allocator(Protocol):
    """A device allocator's counters, in bytes."""

    def allocated(self) -> int: ...

    def peak(self) -> int: ...  # the most allocated since the last reset_peak()

    def reset_peak(self) -> None: ...


class CudaAllocator:
    """The CUDA caching allocator's counters of one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def _local(t: torch.Tensor) -> torch.Tensor:
    # DTensor.to_local() goes through an autograd Function (~10 µs); this runs for every tensor at every
    # phase boundary, so read the local shard directly.
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass
class _Window:
    """One phase's peak window: its label, the known tensors' bytes and, once closed, its peak."""

    label: str
    known: dict[str, int]
    peak: int = 0


@dataclass
class _Step:
    """What one step's windows found."""

    base_other: int = 0  # allocated at the step's start beyond the known tensors
    best: _Window | None = None
    maxima: dict[str, int] = field(default_factory=dict)


class AllocatorTracker:
    """Per-phase allocator peaks attributed to known tensors; the interface the trainer uses of a tracker.

    Enter once per optimizer step (a step's window); `phase` changes inside it close one phase window and
    open the next.
    """

    per_operator = False  # torch.compile runs under it (no TorchDispatchMode)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 allocator: Allocator, rank: int = 0, budget: int | None = None) -> None:
        self.model, self.optimizer, self.device = model, optimizer, torch.device(device)
        self.allocator, self.rank, self.budget = allocator, rank, budget
        self._phase = "setup"
        self._window: _Window | None = None  # set while inside a step
        self._step = _Step()
        self._claimed: list[weakref.ref] = []
        self._hook: Any = None
        self._where = -1 if self.device.type == "cpu" else (self.device.index or 0)  # as Tensor.get_device()
        self._fixed: tuple[dict[str, int], set[int]] | None = None
        self._params: list[nn.Parameter] = []

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, label: str) -> None:
        if self._window is not None and label != self._window.label:
            self._close()
            self._window = _Window(label, self._known(refresh=False))
        self._phase = label

    def __enter__(self) -> AllocatorTracker:
        self._claimed = []
        self._phase = "setup"
        self.allocator.reset_peak()
        known = self._known()
        self._step = _Step(base_other=max(0, self.allocator.allocated() - sum(known.values())))
        self._window = _Window("setup", known)
        self._hook = self.optimizer.register_step_post_hook(self._after_optimizer_step)
        return self

    def __exit__(self, *args: Any) -> None:
        if self._window is not None:
            self._close()
        self._window = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _after_optimizer_step(self, *args: Any) -> None:
        if self._window is not None:
            self._window.known = self._known()

    def _close(self) -> None:
        window, step = self._window, self._step
        assert window is not None
        window.peak = self.allocator.peak()
        self.allocator.reset_peak()
        parts = self._breakdown(window)
        for name in (*_KNOWN, "activations"):
            step.maxima[name] = max(step.maxima.get(name, 0), parts[name])
        if step.best is None or window.peak > step.best.peak:
            step.best = window

    def _breakdown(self, window: _Window) -> dict[str, int]:
        parts = dict(window.known)
        parts["other"] += self._step.base_other
        parts["activations"] = max(0, window.peak - sum(parts.values()))
        return parts

    def step_peak(self) -> int:
        """The allocator's peak since the step began (read without resetting)."""
        closed = self._step.best.peak if self._step.best is not None else 0
        return max(closed, self.allocator.peak() if self._window is not None else 0)

    def peak(self) -> dict[str, Any]:
        """The breakdown of the step's highest phase peak, plus `max`: each category's own maximum over
        the step's phases."""
        best = self._step.best or _Window(self._phase, self._known(), self.allocator.peak())
        out: dict[str, Any] = self._breakdown(best)
        out["activations_other"] = out["activations"] + out["other"]
        out["peak"] = best.peak
        out["phase"] = best.label
        out["max"] = dict(self._step.maxima)
        return out

    def current(self) -> dict[str, int]:
        """What is allocated now: the known tensors, and the rest as `other` (what outlives a step is
        state, not activations, as the per-operator tracker files it)."""
        parts = self._known()
        live = self.allocator.allocated()
        parts["other"] += max(0, live - sum(parts.values()))
        parts["activations"] = 0
        parts["activations_other"] = parts["other"]
        parts["peak"] = live
        return parts

    def _known(self, refresh: bool = True) -> dict[str, int]:
        """The known tensors' bytes by category. Parameters, optimizer states and buffers change only
        between steps and in the optimizer step: at the other boundaries (refresh=False) only the
        gradients are read again, so that a boundary costs a pass over the gradients alone."""
        if refresh or self._fixed is None:
            seen: set[int] = set()
            model, optimizer = self.model, self.optimizer
            states = (t for state in optimizer.state.values() for t in state.values()
                      if isinstance(t, torch.Tensor))
            self._params = list(model.parameters())
            fixed = {"params": self._bytes(self._params, seen), "optim": self._bytes(states, seen),
                     "other": self._bytes(model.buffers(), seen)}
            self._fixed = (fixed, seen)
        fixed, seen = self._fixed
        claimed = [t for t in (ref() for ref in self._claimed) if t is not None]
        grads = self._bytes([p.grad for p in self._params] + claimed, set(seen))
        return {"params": fixed["params"], "grads": grads, "optim": fixed["optim"], "other": fixed["other"]}

    def _bytes(self, tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
        """Bytes of the storages of `tensors` on this rank's device not counted yet (`seen`)."""
        total, where = 0, self._where
        for t in tensors:
            if t is None:
                continue
            t = _local(t)
            if t.get_device() != where:  # offloaded to the host: not this device's memory
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
        return total

    def claim_gradients(self, tensors: list[torch.Tensor]) -> None:
        """Count these tensors (or these parameters' gradients) as gradients for the rest of the step."""
        if self._window is None:
            return
        for t in tensors:
            grad = t.grad if isinstance(t, nn.Parameter) else t
            if grad is not None:
                self._claimed.append(weakref.ref(grad))  # not kept alive by being counted

    def reset_mod_stats(self) -> None:
        """Nothing per module is kept (the per-operator trackers' interface)."""

    def settle(self) -> None:
        """Nothing to re-file: `current()` counts what outlives a step as `other`."""

    def over_budget_error(self) -> MemoryBudgetExceeded:
        """The budget error for a device out-of-memory (the allocator enforces the budget)."""
        live = self.current()
        return MemoryBudgetExceeded(self.rank, self._phase, live["peak"], self.budget or 0, live)
