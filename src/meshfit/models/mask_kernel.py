"""Which kernel runs a document mask (data.document_mask) and what its mask holds: one rule for the model,
the planner and the dry run (no torch import, so the planner can read it).

The model (models/masks.py) runs FlexAttention with a block mask on CUDA with the fused kernel and no
attention dropout, and otherwise SDPA (or the eager kernel) with an additive mask in the activations'
dtype; context parallelism builds an additive mask of its own (parallel/context_parallel.py).
"""

from __future__ import annotations

import math

FLEX_BLOCK = 128  # FlexAttention's default tile: its block mask holds one entry per 128 × 128 tile
FLEX, DENSE = "flex", "dense"


def mask_kernel(*, cuda: bool, attention: str, dropout: float, cp: int = 1) -> str:
    """FLEX or DENSE (see the module's docstring)."""
    return FLEX if cuda and attention == "flash" and dropout == 0 and cp == 1 else DENSE


def mask_bytes(kernel: str, *, seq: int, batch: int, cp: int = 1, value_bytes: int = 4) -> float:
    """Bytes of one micro-batch's mask (``batch`` sequences of ``seq`` tokens) on one rank, built once per
    forward of a model (or pipeline stage) and kept for backward: one activation value (`value_bytes`)
    per (local query, key) pair; FlexAttention's block mask: four int32 tables of a tile per (query tile,
    key tile) pair (the key tiles of each query tile, full and partial, and their transposes for
    backward)."""
    if kernel == FLEX:
        tiles = math.ceil(seq / FLEX_BLOCK)
        return 4 * 4 * batch * tiles * tiles
    return batch * (seq / cp) * seq * value_bytes


def describe(kernel: str) -> str:
    """One line for `meshfit plan --explain`."""
    if kernel == FLEX:
        return ("FlexAttention with a block mask made by create_block_mask (CUDA, fused kernel, no attention "
                "dropout): a few bytes per 128×128 tile, tiles outside every document skipped")
    return ("scaled_dot_product_attention with an additive block-causal mask (b·s²/cp activation values per "
            "micro-batch); on CUDA the flash kernel takes no mask, so SDPA runs its memory-efficient kernel")
