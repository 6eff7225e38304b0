"""What meshfit's transformer blocks keep for backward, per rank, in bytes: the planner's activation model.

Two numeric modes: ``fp32``, and ``bf16``: mixed precision, where every layout computes on FSDP2's 16-bit
weight copies (parallel/kinds.py), so every activation is 16-bit; pure bf16 is the same.

meshfit's blocks keep what Korthikanti et al. 2022 count (planner/memory.py's per-tensor terms, which also
count the Llama block by their rule), because they are written to (models/layers.py): RMSNorm keeps its
16-bit input alone, dropout a one-byte mask, grouped key/value heads are not repeated for the fused
kernel, and under sequence parallelism the gathered projection inputs are gathered again in backward
(parallel/sp_regather.py). On top of that count: LayerNorm's mean and reciprocal deviation per token.
``benchmarks/block_activations.py`` measures these against torch's memory tracker on real blocks.

Recompute policies (parallel/recompute.py): ``attention`` drops the attention core's terms; ``op`` keeps the
block input and the outputs of every matmul, attention kernel and reduction (tensor parallelism's
row-parallel matmuls produce full-size partial sums, kept next to their reduced output); a block
checkpointed whole keeps its input.
"""

from __future__ import annotations

from meshfit.models.config import ModelConfig
from meshfit.planner.memory import activation_bytes_per_layer

MODES = ("fp32", "bf16")


def value_bytes(mode: str) -> int:
    """Bytes of one activation value in the compute dtype."""
    return 4 if mode == "fp32" else 2


def block_weight_params(model: ModelConfig) -> int:
    """Matmul weights of one block (what tensor parallelism splits)."""
    d, hd = model.dim, model.head_dim
    if model.family == "llama":
        return d * hd * (2 * model.n_heads + 2 * model.n_kv_heads) + 3 * d * model.ffn_hidden
    return 4 * d * d + 2 * d * model.ffn_hidden


def block_activation_bytes(model: ModelConfig, *, mode: str, seq: int, batch: int, tp: int = 1,
                           sp: bool = False, attention: str = "flash", dropout: float = 0.0,
                           policy: str = "none") -> float:
    """Bytes one rank keeps for the backward of one block and one micro-batch of ``batch`` sequences,
    under recompute ``policy`` "none", "op" or "attention" (a block checkpointed whole: see
    :func:`checkpointed_block_bytes`)."""
    p = value_bytes(mode)
    tokens = seq * batch
    seq_split = tp if sp else 1
    if policy == "op":
        return tokens * _op_kept_per_token(model, p, seq, tp, sp, attention)
    gpt = model.family == "gpt"
    total = activation_bytes_per_layer(
        s=seq, b=batch, h=model.dim, a=model.n_heads, t=tp, sp=sp, bytes_per_value=p,
        recompute="selective" if policy == "attention" else "none", dropout=gpt and dropout > 0,
        attention=attention, family=model.family, ffn=model.ffn_hidden / model.dim,
        kv=model.n_kv_heads / model.n_heads)
    if gpt:
        total += tokens * 2 * 2 * p / seq_split  # two LayerNorms' mean and reciprocal deviation
    return total


def _op_kept_per_token(model: ModelConfig, p: int, seq: int, tp: int, sp: bool, attention: str) -> float:
    h, heads = model.dim, model.n_heads
    kv = model.n_kv_heads * model.head_dim
    kept = p * h / (tp if sp else 1)  # the block input
    kept += p * (h + 2 * kv) / tp  # q, k, v projections
    if attention == "eager":
        kept += p * heads * seq / tp + p * h / tp  # QKᵀ scores and the probabilities × V output
    else:
        kept += p * h / tp + 4 * heads / tp  # the fused kernel's output and log-sum-exp
    up = 2 if model.family == "llama" else 1  # SwiGLU's gate and up projections
    kept += p * up * model.ffn_hidden / tp
    # Output projection and MLP down projection: their matmul outputs (full-size partial sums under
    # TP), and under TP the reduced outputs as well (sequence-split under SP).
    reduced = 0 if tp == 1 else p * h / (tp if sp else 1)
    return kept + 2 * (p * h + reduced)


def checkpointed_block_bytes(model: ModelConfig, *, mode: str, seq: int, batch: int, tp: int = 1,
                             sp: bool = False) -> float:
    """A block checkpointed whole keeps only its input: the residual stream (sequence-split under SP)."""
    return seq * batch * model.dim * value_bytes(mode) / (tp if sp else 1)
