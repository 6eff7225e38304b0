"""The global gradient norm (plain, sharded and tensor-parallel gradients alike) and clipping to it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

# Sums of squares: fp32 norms of rows of _CHUNK values (one kernel per tensor), squared and summed in fp64.
# One fp32 norm over tens of millions of values drifts by ~1e-3 relative on CPU (a 50k × 768 embedding), so
# two layouts that split a tensor differently would report different norms; per row the fp32 error stays
# ~1e-7 and the fp64 sum adds none: 4e-8 relative on the `small` preset's 3.2M gradients and on 38M values,
# in a third of the time of fp64 norms (0.9 vs 2.6 ms for `small`, 6 vs 24 ms for 38M values, one thread).
# Accelerators reduce in a tree: whole tensors.
_CHUNK = 1 << 14


def _square_sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ t² over local tensors, as an fp64 scalar."""
    parts = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        whole = flat.numel() // _CHUNK * _CHUNK if device.type == "cpu" else 0
        if whole:  # 16-bit gradients accumulate in fp32 too
            parts.append(torch.linalg.vector_norm(flat[:whole].view(-1, _CHUNK), dim=1, dtype=torch.float32))
        if whole < flat.numel():
            parts.append(torch.linalg.vector_norm(flat[whole:], dtype=torch.float32).reshape(1))
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.cat(parts).double().square().sum()


@dataclass
class GradSquares:
    """This rank's gradients grouped by layout, with each group's sum of squares over what this rank holds.

    Computed once per step, before anything is reduced across ranks: the step guard reads whether they are
    finite (so a NaN is reported on the rank where it began), and `weighted()` is this rank's part of the
    global norm, summed over every rank by the step's vote (train/vote.py).
    """

    groups: dict[Any, list[torch.Tensor]]  # None: plain tensors; else (mesh, placements) of DTensors
    local: list[tuple[torch.Tensor, int]]  # (Σ g² held here, how many ranks hold these same values)
    device: torch.device

    def finite(self) -> bool:
        return bool(torch.isfinite(torch.stack([square for square, _ in self.local])).all()) if self.local else True

    def weighted(self) -> torch.Tensor:
        """Σ over groups of Σ g² / holders: summed over all ranks, every gradient value counts once."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for square, holders in self.local:
            total += square / holders  # fp64: a replica's share is exact for power-of-two degrees
        return total


def grad_squares(params: list[torch.Tensor], stage_ranks: int = 1) -> GradSquares:
    """Group the gradients of `params` and take each group's local sum of squares.

    `stage_ranks`: the ranks that hold this rank's layers (world size / pipeline degree); every one holds
    all of them, sharded or replicated. A plain gradient is held whole by all of them; a DTensor's by
    those that differ from this rank only along the mesh dimensions it is replicated on.
    """
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    device = next((g.device for gs in groups.values() for g in gs), torch.device("cpu"))
    local = [_local_square(grads, key, device, stage_ranks) for key, grads in groups.items()]
    return GradSquares(groups=groups, local=local, device=device)


def _local_square(grads: list[torch.Tensor], key: Any, device: torch.device,
                  stage_ranks: int) -> tuple[torch.Tensor, int]:
    if key is None:
        return _square_sum(grads, device), stage_ranks
    mesh, placements = key
    if any(isinstance(p, Partial) for p in placements):
        # Unreduced partial sums must be added up before they are squared (a collective: a NaN in one rank's
        # partial shows on every rank of that mesh dimension).
        whole = [Replicate() if isinstance(p, Partial) else p for p in placements]
        grads = [g.redistribute(mesh, whole) for g in grads]
        placements = grads[0].placements
    # Each rank of a sharded mesh dimension holds another part (FSDP × TP's strided shards included).
    parts = math.prod(mesh.size(dim) for dim, placement in enumerate(placements)
                      if not isinstance(placement, Replicate))
    assert stage_ranks % parts == 0, (stage_ranks, placements)  # every rank of the stage holds a part
    return _square_sum([g.to_local() for g in grads], device), stage_ranks // parts


def clip_grad_norm(squares: GradSquares, max_norm: float, total_square: torch.Tensor,
                   read: bool = False) -> torch.Tensor:
    """Global L2 norm of all gradients (sharded ones included) from `total_square`, the sum over every rank
    of `squares.weighted()`; clips the gradients to max_norm when max_norm > 0.

    Gradients may be plain tensors and DTensors on different meshes (e.g. tensor-parallel weights next to
    replicated norms); with pipeline parallelism each rank holds other layers: the vote sums them all.
    `read`: the caller reads the vote back anyway (training, not dry runs), so the coefficient may be read
    too, and a norm below max_norm skips the pass over every gradient that would multiply it by 1.
    """
    total = total_square.sqrt().float()
    if max_norm > 0:
        coef: torch.Tensor | float = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if read:
            coef = float(coef)  # the same fp32 value, usable on any device
            if coef == 1.0:
                return total
        else:
            coef = coef.to(squares.device)  # offloaded gradients live on the host
        for grads in squares.groups.values():
            # Scale the local shards in place: one coefficient for every gradient, sharded or not.
            torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)
    return total
