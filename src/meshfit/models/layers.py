"""Building blocks shared by both model families, written for what they keep for backward.

* ``AttentionCore``: causal attention of ``[b, heads, s, head_dim]`` queries, keys and values (with fewer
  queries than keys, the queries are the last positions of the keys', as under context parallelism). "flash"
  runs torch's fused ``scaled_dot_product_attention`` (it keeps its output and a log-sum-exp per head and
  query; grouped key/value heads are not repeated); "eager" materialises the scores as Megatron-LM's
  unfused path does (Korthikanti et al. 2022: softmax output, dropout mask and dropout output, 5·a·s²·b
  bytes per layer in 16 bits). A module of its own, so that recompute policies can wrap the core alone.
  With ``mask`` (document masking, models/masks.py) the attention is block-causal: an additive mask
  ``[b, 1, queries, keys]`` goes to SDPA or is added to the eager scores, a FlexAttention block mask to
  FlexAttention.
* ``Dropout``: torch's ``native_dropout``, which keeps a one-byte mask on every device (on CPU,
  ``F.dropout`` keeps a mask in the input's dtype).
* ``RMSNorm``: torch's RMSNorm, recomputed in backward from its input. Its eager form keeps an fp32 copy
  of the input and of the normalised output (12 bytes per 16-bit value); fused kernels keep the input
  alone, and so does this.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from meshfit.models.masks import Mask, flex_attention


@functools.lru_cache(maxsize=64)
def _bias(queries: int, keys: int) -> CausalBias:
    # The bias holds no data, only its sizes. Made outside any dispatch mode (a memory tracker, a dry run's
    # fake tensors), which would otherwise hand back a plain tensor where the subclass is being created.
    with _disable_current_modes():
        return causal_lower_right(queries, keys)


def _lower_right(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """The causal mask whose diagonal ends at the last key. torch.compile cannot build torch's bias
    subclass inside a graph: compiled blocks take the mask as booleans (queries × keys bytes)."""
    if torch.compiler.is_compiling():
        return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
    return _bias(queries, keys)


class AttentionCore(nn.Module):
    def __init__(self, dropout: float, kernel: str) -> None:
        super().__init__()
        self.dropout = dropout
        self.kernel = kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | None = None) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        seqlen, keys = q.shape[2], k.shape[2]
        if mask is not None and not isinstance(mask, torch.Tensor):
            return flex_attention(q, k, v, mask)
        if self.kernel == "flash":
            # Fewer queries than keys: the mask's diagonal ends at the last key (torch's lower-right causal
            # bias, which the fused kernels run without materializing the mask).
            causal = mask is None
            if causal and keys != seqlen:
                mask, causal = _lower_right(seqlen, keys, q.device), False
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                                  enable_gqa=k.shape[1] != q.shape[1])
        # Grouped key/value heads without repeating them: the queries of one group are stacked along the
        # sequence, so both matmuls read (and keep) K and V at their own width.
        b, heads, _, head_dim = q.shape
        groups = k.shape[1]
        q = q.reshape(b, groups, heads // groups * seqlen, head_dim)
        scores = (q @ k.transpose(-2, -1)) * head_dim ** -0.5
        if mask is None:
            future = torch.ones(seqlen, keys, dtype=torch.bool, device=q.device).triu(1 + keys - seqlen)
            scores = scores.masked_fill(future.repeat(heads // groups, 1), float("-inf"))
        else:  # [b, 1, s, keys], added to each of a group's heads (stacked along the queries) by broadcast
            scores = (scores.view(b, groups, heads // groups, seqlen, keys) + mask.unsqueeze(2)).flatten(2, 3)
        probs = scores.softmax(dim=-1)
        if p > 0:
            probs = torch.native_dropout(probs, p, True)[0]
        return (probs @ v).view(b, heads, seqlen, head_dim)


class Dropout(nn.Dropout):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return torch.native_dropout(x, self.p, True)[0]


class RMSNorm(nn.RMSNorm):
    # False inside a block that is recomputed as a whole or op by op (parallel/activation_checkpoint.py): the
    # block's own recompute already keeps none of the norm's intermediates, and a checkpoint of its own
    # would run the norm a third time and add Python hooks to every call.
    recompute_alone = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not self.recompute_alone:
            return super().forward(x)
        return checkpoint(super().forward, x, use_reentrant=False)
