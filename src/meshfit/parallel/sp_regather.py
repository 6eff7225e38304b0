"""Sequence parallelism without keeping the gathered inputs: all-gather them again in backward.

Under sequence parallelism the inputs of the attention and MLP blocks are all-gathered along the sequence
(Shard(1) → Replicate) for the column-parallel projections, whose weight gradients need them. Autograd
would keep the gathered, full-size tensor until backward (2·s·b·h bytes per projection input in 16 bits,
t times the sequence shard). Like Megatron-LM (Korthikanti et al. 2022, §4.2.2), meshfit keeps only the
shard and gathers it again when backward first needs it, using torch's saved-tensor hooks: the projections
of one block share one re-gathered copy, freed once the last of them has used it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.multiprocessing.reductions import StorageWeakRef


class _Regathered:
    """One gathered input: its shard, how many saved references still wait for it, the re-gathered copy."""

    def __init__(self, shard: DTensor) -> None:
        self.shard = shard.detach()
        self.pending = 0
        self.full: DTensor | None = None

    def take(self, shape: torch.Size) -> DTensor:
        if self.full is None:
            with torch.no_grad():
                self.full = self.shard.redistribute(self.shard.device_mesh, [Replicate()])
        full = self.full
        self.pending -= 1
        if self.pending == 0:
            self.full = None  # the last projection has its copy: free ours
        return full.view(shape)


class _Region:
    """Hooks of one module (attention or MLP) whose input prepare-hook gathers the sequence, and of the
    projections inside it that read the gathered input (their forwards alone run under the pack hook)."""

    def __init__(self) -> None:
        self.shard: DTensor | None = None
        self.gathered: torch.Tensor | None = None
        self.entry: _Regathered | None = None
        self.hooks: Any = None

    def before_gather(self, module: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        self.shard = x if isinstance(x, DTensor) and not x.placements[0].is_replicate() else None

    def after_gather(self, module: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        if self.shard is not None and isinstance(x, DTensor):
            self.gathered = x._local_tensor
            self.entry = _Regathered(self.shard)

    def after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.shard = self.entry = self.gathered = None

    def enter_projection(self, module: nn.Module, args: tuple) -> None:
        if self.entry is not None:
            self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self.hooks.__enter__()

    def exit_projection(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
            self.hooks = None

    def _pack(self, t: torch.Tensor) -> Any:
        if self.entry is not None and isinstance(t, DTensor) and _whole_view(t._local_tensor, self.gathered):
            self.entry.pending += 1
            return (self.entry, t.shape)
        return t


def _whole_view(t: torch.Tensor, gathered: torch.Tensor | None) -> bool:
    """Whether ``t`` is a reshaped view of all of ``gathered`` (the matmul's flattened input).

    Views made under DTensor's dispatch sit below autograd, which alone records ``_base``: compare the
    storage itself."""
    return (gathered is not None and t.numel() == gathered.numel() and t.storage_offset() == 0
            and t.is_contiguous() and gathered.is_contiguous()
            and StorageWeakRef(t.untyped_storage()) == StorageWeakRef(gathered.untyped_storage()))


def _unpack(saved: Any) -> torch.Tensor:
    if isinstance(saved, tuple):
        entry, shape = saved
        return entry.take(shape)
    return saved


def regather_in_backward(module: nn.Module, projections: list[nn.Module]) -> None:
    """Keep only the sequence shard of ``module``'s gathered input for the backward of ``projections``
    (the column-parallel layers that read it). Call after the tensor-parallel plan has registered the
    input-preparing hook."""
    region = _Region()
    module.register_forward_pre_hook(region.before_gather, prepend=True)
    module.register_forward_pre_hook(region.after_gather)
    module.register_forward_hook(region.after_forward, always_call=True)
    for projection in projections:
        projection.register_forward_pre_hook(region.enter_projection)
        projection.register_forward_hook(region.exit_projection, always_call=True)
