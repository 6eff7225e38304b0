"""A CUDA device on the CPU-only torch build, for tests of where tensors live.

Under `FakeTensorMode`, factories with `device="cuda"` make fake CUDA tensors on this build, and an
operator that mixes them with host tensors raises the error a GPU raises ("Expected all tensors to be on
the same device, but found at least two devices, cuda:0 and cpu!"). What the build lacks is everything
around the tensors: the device count and index, streams and events (FSDP2 asks for them when it is
built on a CUDA mesh) and CUDA's device guard, which a few Python bindings take before they dispatch
(`Tensor.copy_`, `Tensor.to`, indexing by an integer or a slice). `fake_cuda()` stands in for those, and
nothing else: operators still run through fake tensors, so a host/device mix still fails as on a GPU.

Limits: fake CUDA tensors hold no data (initialise nothing randomly on them, read nothing back), pinned
memory is not available (`is_available()` stays False, so offload does not pin), and operators whose C++
kernels take the device guard themselves (an embedding lookup) abort the process: these tests stop short
of running FSDP2's CUDA forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch


class _Stream:
    """A CUDA stream that orders nothing: fake tensors have no work to order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return _Event()

    def synchronize(self) -> None:
        pass


class _Event(_Stream):
    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """One fake CUDA device, index 0, for code run under a FakeTensorMode."""
    stream = _Stream()
    real_copy = torch.Tensor.copy_

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        # The binding takes CUDA's device guard first; the operator itself runs on fake tensors.
        if "cuda" in (self.device.type, src.device.type):
            return torch.ops.aten.copy_.default(self, src, non_blocking)
        return real_copy(self, src, non_blocking)

    real_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        device, dtype = kwargs.get("device"), kwargs.get("dtype")
        for arg in args:  # to(device), to(dtype), to(device, dtype)
            if isinstance(arg, torch.dtype):
                dtype = arg
            elif isinstance(arg, (str, torch.device)):
                device = torch.device(arg)
        if "cuda" in (self.device.type, getattr(device, "type", None)):
            return torch.ops.aten._to_copy.default(self, dtype=dtype or self.dtype, device=device or self.device)
        return real_to(self, *args, **kwargs)

    real_getitem = torch.Tensor.__getitem__

    def getitem(self: torch.Tensor, index: Any) -> torch.Tensor:
        if self.device.type == "cuda" and isinstance(index, int):
            return torch.ops.aten.select.int(self, 0, index)
        if self.device.type == "cuda" and isinstance(index, slice):
            return torch.ops.aten.slice.Tensor(self, 0, index.start, index.stop, index.step or 1)
        return real_getitem(self, index)

    cuda = {"current_device": lambda: 0, "device_count": lambda: 1, "set_device": lambda device: None,
            "Stream": _Stream, "Event": _Event, "current_stream": lambda device=None: stream,
            "default_stream": lambda device=None: stream, "stream": lambda s: contextlib.nullcontext(),
            "synchronize": lambda device=None: None}
    with contextlib.ExitStack() as stack:
        for name, value in cuda.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value))
        stack.enter_context(mock.patch.object(torch.Tensor, "copy_", copy_))
        stack.enter_context(mock.patch.object(torch.Tensor, "to", to))
        stack.enter_context(mock.patch.object(torch.Tensor, "__getitem__", getitem))
        yield


def devices(tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Name -> device type, of DTensors' local shards too."""
    from torch.distributed.tensor import DTensor

    return {name: (t.to_local() if isinstance(t, DTensor) else t).device.type for name, t in tensors}
