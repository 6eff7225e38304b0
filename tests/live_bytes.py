"""A CPU stand-in for a device allocator's counters, for tests of memory/allocator.py.

CPU tensors have no allocator statistics. `LiveBytes` follows every storage an operator makes while it is
entered (a TorchDispatchMode) and the storages it is told about (`follow`), until each is freed, and keeps
the allocated bytes and their peak since the last reset as the CUDA allocator does. FSDP2 frees and
re-allocates its gathered parameters by resizing their storages (`UntypedStorage.resize_`, which no operator
dispatches): while entered, resizes are followed too. It is slow (a Python call per operator, as the
per-operator tracker is) and meant for tests only.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}  # id of a followed storage -> its bytes
        self._allocated = 0
        self._peak = 0

    def follow(self, tensors: Any) -> None:
        """Count these tensors' storages (made before the mode was entered) until they are freed."""
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._live or storage.nbytes() == 0:
            return
        self._live[key] = storage.nbytes()
        self._allocated += storage.nbytes()
        self._peak = max(self._peak, self._allocated)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self._allocated -= self._live.pop(key)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key not in self._live:
            self._add(storage)
            return
        self._allocated += storage.nbytes() - self._live[key]
        self._live[key] = storage.nbytes()
        self._peak = max(self._peak, self._allocated)

    def __enter__(self) -> LiveBytes:
        resize = self._resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            self._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*args)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage())
        return out

    # The Allocator interface (memory/allocator.py).
    def allocated(self) -> int:
        return self._allocated

    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._allocated
