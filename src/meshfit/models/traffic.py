"""Memory traffic of the element-wise kernels in one training step of meshfit's models, per token.

Matmuls and the attention kernel are compute-bound and counted in FLOPs (``flops_per_token``); everything
else a block runs (norms, rotary embeddings, activation functions, residual adds, dropout, dtype casts, the
loss's softmax) is memory-bound: its time is the bytes it reads and writes over the memory bandwidth. This
module counts those bytes for the code in ``llama.py``, ``gpt.py``, ``layers.py`` and ``models/loss.py``, one
kernel per torch operator as eager mode runs them, except norms, counted as the single fused kernel torch
runs on GPUs (read the input, write the output; backward reads input and output gradient, writes the input
gradient). Per operator, with ``c`` bytes per compute value:

* norm: forward 2c, backward 3c; meshfit's RMSNorm re-runs its forward in backward (another 2c);
* residual add: 3c forward, 3c backward (the two gradients meeting at the branch point are summed);
* dropout (p > 0): read, write and a one-byte mask, 2c + 1 each way;
* SwiGLU: silu 2c and the product 3c forward, 3c + 2·3c backward; GPT's GELU 2c forward, 3c backward;
* RoPE, per query/key value: the fp32 copy, two products with the tables, the half negation, the concat,
  the sum and the cast back (48 + 2c bytes; 40 when c = 4, where the casts are no-ops), as much backward;
* gradients of a tensor several layers read are summed: the attention input's (q, k and v projections:
  two sums) and, for SwiGLU, the FFN input's (one), 3c each, over the whole dim-wide tensor (sequence
  parallelism gathers it first);
* bias gradients (GPT, Llama-family q/k/v biases): one read of every biased output's gradient;
* per-head q/k norms (Qwen3): a norm over every query and key value;
* embeddings: each lookup reads and writes a row (2c) and its gradient is read again (2c); GPT adds the
  positions (3c) and drops out (2c + 1 each way);
* the loss over the vocabulary, fp32: the cast (c + 4 when c < 4), log-softmax 8, its backward 12, the
  scattered gradient 4, the cast back (4 + c when c < 4), and with a padded vocabulary the padding's
  masking, 8 each way.

Not counted (each under 1% of a block's traffic at transformer sizes): per-token reductions (a norm's
statistics) and gradient accumulation into parameters (per parameter, not per token). Tensor parallelism
splits the heads and the FFN hidden width (``split``); sequence parallelism also the dim-wide tensors of
the blocks and the final norm (``wide``, ``final_norm``), not the embeddings, which run on the whole
sequence before it is scattered; loss parallelism splits the vocabulary (``vocab``).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshfit.models.config import ModelConfig


@dataclass(frozen=True)
class Traffic:
    """Element-wise bytes per token read and written in one training step (forward + backward)."""

    split_fwd: float  # one block's forward, over head- and FFN-wide tensors (divided by tp)
    split_bwd: float  # ... its backward
    wide_fwd: float  # one block's forward, over dim-wide tensors (divided by tp only with SP)
    wide_bwd: float  # ... its backward
    gathered_bwd: float  # one block's backward, dim-wide tensors every tensor-parallel rank holds in full
    embed: float  # the embeddings, forward + backward (the first pipeline stage)
    final_norm: float  # the final norm, forward + backward (the last stage; divided by tp with SP)
    vocab: float  # the loss over the vocabulary, forward + backward (divided by tp with loss parallelism)

    @property
    def block(self) -> float:
        """One block's forward + backward, unsplit."""
        return self.split_fwd + self.split_bwd + self.wide_fwd + self.wide_bwd + self.gathered_bwd


def elementwise_traffic(cfg: ModelConfig, c: int) -> Traffic:
    """Bytes per token of ``cfg``'s element-wise kernels with ``c``-byte compute values (4 fp32, 2 bf16)."""
    h, f = cfg.dim, cfg.ffn_hidden
    q, kv = cfg.q_width, cfg.n_kv_heads * cfg.head_size
    cast = c + 4 if c < 4 else 0  # an fp32 copy of a compute value (a no-op in fp32)
    if cfg.family == "llama":
        rope = (40 + 2 * cast) * (q + kv)
        norm_fwd, norm_bwd = 2 * c, 3 * c + 2 * c  # checkpointed: the forward runs again in backward
        split_fwd = rope + 5 * c * f
        split_bwd = rope + 9 * c * f
        if cfg.qk_norm:  # the per-head norms of every query and key value
            split_fwd += norm_fwd * (q + kv)
            split_bwd += norm_bwd * (q + kv)
        if cfg.qkv_bias:
            split_bwd += c * (q + 2 * kv)  # + gradients of the q/k/v projections' biases
        wide_fwd = 2 * (norm_fwd + 3 * c) * h
        wide_bwd = 2 * (norm_bwd + 3 * c) * h
        embed, final_norm = (2 * c + 2 * c) * h, (norm_fwd + norm_bwd) * h
        gathered_bwd = (2 + 1) * 3 * c * h
    else:
        drop = 2 * c + 1 if cfg.dropout > 0 else 0
        split_fwd = 2 * c * f
        split_bwd = 3 * c * f + c * (q + 2 * kv + f)  # + gradients of the split layers' biases
        wide_fwd = 2 * (2 * c + 3 * c + drop) * h
        wide_bwd = 2 * (3 * c + 3 * c + drop + c) * h  # + gradients of the output projections' biases
        # Token and position lookups, their sum and its dropout, the lookups' gradients.
        embed, final_norm = (2 * c + 2 * c + 3 * c + drop + drop + 2 * c + 2 * c) * h, (2 * c + 3 * c) * h
        gathered_bwd = 2 * 3 * c * h
    masking = 16 if cfg.padded_vocab != cfg.vocab_size else 0
    vocab = (cast + 8 + 12 + 4 + cast + masking) * cfg.padded_vocab
    return Traffic(split_fwd, split_bwd, wide_fwd, wide_bwd, gathered_bwd, embed, final_norm, vocab)
