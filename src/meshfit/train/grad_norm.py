"""The global gradient norm (plain, sharded and tensor-parallel gradients alike) and clipping to it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

# Sums of squares are taken over slices of this many values, each in fp64: torch's fp32 norm on CPU
# drifts by ~1e-3 relative over tens of millions of values (a 50k × 768 embedding), and two layouts that
# split a tensor differently would then report different norms.
_SLICE = 1 << 20


def _square_sum(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":  # accelerators reduce in a tree: fp32 stays accurate
        return torch.linalg.vector_norm(flat).double().square()
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for part in flat.split(_SLICE):
        # The norm kernel accumulates in fp64 as it reads (2.5× faster than squaring an fp64 copy).
        total += torch.linalg.vector_norm(part, dtype=torch.float64).square()
    return total


def _dtensor_square_sum(grads: list[DTensor]) -> torch.Tensor:
    """Σ g² over the full (logical) tensors of DTensor gradients that share one mesh and placement."""
    mesh, placements = grads[0].device_mesh, grads[0].placements
    if any(isinstance(p, Partial) for p in placements):
        # Unreduced partial sums must be added up before they are squared.
        whole = [Replicate() if isinstance(p, Partial) else p for p in placements]
        grads = [g.redistribute(mesh, whole) for g in grads]
        placements = grads[0].placements
    total = sum((_square_sum(g.to_local()) for g in grads), torch.zeros((), dtype=torch.float64,
                                                                        device=grads[0].to_local().device))
    for mesh_dim, placement in enumerate(placements):
        # Each rank of a sharded mesh dimension holds another part (FSDP × TP's strided shards included).
        if not isinstance(placement, Replicate):
            dist.all_reduce(total, group=mesh.get_group(mesh_dim))
    return total


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_group: Any = None) -> torch.Tensor:
    """Global L2 norm of all gradients (sharded ones included), clipped to max_norm when max_norm > 0.

    Gradients may be plain tensors and DTensors on different meshes (e.g. tensor-parallel weights next to
    replicated norms): each group's sum of squares is reduced over the ranks that shard it. With pipeline
    parallelism each rank holds other layers: the squares are summed across the pipeline too.
    """
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    device = next((g.device for gs in groups.values() for g in gs), torch.device("cpu"))
    square = torch.zeros((), dtype=torch.float64, device=device)
    for key, grads in groups.items():
        square += _dtensor_square_sum(grads) if key is not None else sum(map(_square_sum, grads))
    if pp_group is not None:
        dist.all_reduce(square, group=pp_group)
    total = square.sqrt().float()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups.values():
            # Scale the local shards in place: one coefficient for every gradient, sharded or not.
            torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)
    return total
