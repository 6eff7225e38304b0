"""Block-causal attention over packed documents: a query sees the earlier keys of its own document only.

A model given per-token document ids (``documents``, ``[b, s]`` integers, equal within a document) builds
its mask once per forward and hands it to every block:

* an additive mask ``[b, 1, s, s]`` in the activations' dtype (0: attend, -inf: not), which torch's
  ``scaled_dot_product_attention`` and the eager kernel take on every device: ``b·s²`` values, kept for
  backward and shared by every block of the model. (A boolean mask would be a byte per pair, but SDPA
  turns a boolean mask into a new additive one in every call, which each block would then keep.)
* on CUDA with the fused ("flash") kernel, a FlexAttention ``BlockMask`` made by torch's
  ``create_block_mask`` from the same rule: it stores which 128×128 tiles are full, partial or empty
  (a few bytes per tile), and the compiled FlexAttention kernel skips the empty ones. FlexAttention has
  no dropout, so a model that applies attention dropout keeps the boolean mask.

Context parallelism builds its own mask (local queries × the whole sequence's keys), see
parallel/context_parallel.py.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from meshfit.models.mask_kernel import FLEX, mask_kernel

try:  # torch ≥ 2.5
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # pragma: no cover - older torch: the boolean mask everywhere
    BlockMask = None
    create_block_mask = _flex_attention = None

Mask = Any  # an additive [b, 1, queries, keys] torch.Tensor, or a FlexAttention BlockMask


def same_document(q_docs: torch.Tensor, k_docs: torch.Tensor) -> torch.Tensor:
    """``[b, 1, queries, keys]``: True where the query's and the key's document ids agree."""
    return (q_docs[:, :, None] == k_docs[:, None, :]).unsqueeze(1)


def block_causal(documents: torch.Tensor) -> torch.Tensor:
    """The boolean block-causal mask of ``[b, s]`` document ids: query i sees key j ≤ i of its document."""
    s = documents.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=documents.device).tril()
    return same_document(documents, documents) & causal


def uses_flex(device: torch.device, kernel: str, dropout: float) -> bool:
    """Whether a document mask runs through FlexAttention: CUDA, the fused kernel, no attention dropout."""
    return (mask_kernel(cuda=device.type == "cuda", attention=kernel, dropout=dropout) == FLEX
            and create_block_mask is not None)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere, in `dtype` (what SDPA adds to the scores)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def document_mask(documents: torch.Tensor, *, flex: bool, dtype: torch.dtype = torch.float32) -> Mask:
    """The mask every block of one forward shares (see the module's docstring); `dtype`: the activations'."""
    if not flex:
        return additive(block_causal(documents), dtype)
    b, s = documents.shape

    def mask_mod(batch, head, q_idx, kv_idx):
        return (documents[batch, q_idx] == documents[batch, kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(mask_mod, b, None, s, s, device=documents.device)


def forward_mask(documents: torch.Tensor | None, builder: Any, kernel: str, dropout: float,
                 dtype: torch.dtype) -> Mask | None:
    """What a model's forward hands its blocks: None without documents; `builder`'s mask when a layout set
    one (context parallelism); else `document_mask`. `dropout`: the attention dropout in effect; `dtype`:
    the activations'."""
    if documents is None:
        return None
    if builder is not None:
        return builder(documents, dtype)
    return document_mask(documents, flex=uses_flex(documents.device, kernel, dropout), dtype=dtype)


@functools.cache
def _compiled_flex():
    # FlexAttention's fused kernel exists only compiled; eager calls run a slow reference.
    return torch.compile(_flex_attention, dynamic=False)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """FlexAttention of ``[b, heads, s, head_dim]`` under a block mask (grouped key/value heads allowed)."""
    run = _flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    return run(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
