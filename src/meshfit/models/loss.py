"""The language-model loss on (possibly vocabulary-padded, possibly vocabulary-sharded) logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, scale: float | None = None
            ) -> torch.Tensor:
    """Cross-entropy in fp32, over the targets that are not ignored (-100, cross-entropy's ignore_index):
    their mean, or with `scale` their sum times `scale` (a trainer averaging over the tokens of a whole
    step passes 1 / that count, times what its gradient reduction divides by). Logits of padded
    vocabulary rows (index ≥ vocab_size) are set to -inf first, so they take no probability mass and get
    no gradient."""
    logits = logits.float()
    if logits.shape[-1] != vocab_size:
        logits = _mask_padding(logits, vocab_size)
    if scale is None:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") * scale


def _mask_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if not isinstance(logits, DTensor):
        return logits.masked_fill(_padded(0, logits.shape[-1], vocab_size, logits.device), float("-inf"))
    # Vocabulary-sharded logits (loss parallelism): each rank masks the columns of its own shard.
    local, start = logits.to_local(), 0
    for mesh_dim, placement in enumerate(logits.placements):
        if isinstance(placement, Shard) and placement.dim % logits.ndim == logits.ndim - 1:
            size = -(-logits.shape[-1] // logits.device_mesh.size(mesh_dim))  # torch.chunk's split
            start += logits.device_mesh.get_local_rank(mesh_dim) * size
    masked = local.masked_fill(_padded(start, local.shape[-1], vocab_size, local.device), float("-inf"))
    return DTensor.from_local(masked, logits.device_mesh, logits.placements, shape=logits.shape,
                              stride=logits.stride())


def _padded(start: int, n: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + n, device=device) >= vocab_size
