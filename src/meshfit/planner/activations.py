"""What meshfit's transformer blocks keep for backward, per rank, in bytes: the planner's activation model.

The coefficients below count the tensors autograd saves in one block of meshfit's own models (as torch's
memory tracker sees them, one storage counted once), in three numeric modes:

* ``fp32``: everything in fp32.
* ``bf16``: compute in bf16 — FSDP2's MixedPrecisionPolicy (the mixed-precision path of ZeRO-1/2/3) and
  pure bf16 training both run the blocks on bf16 weights and activations.
* ``autocast``: mixed precision of DDP and of one rank (torch.autocast over fp32 weights): the residual stream and
  norm statistics stay fp32, matmul inputs are cast to bf16, and autocast's bf16 copies of every weight are
  kept by the graph until backward (they count as activations).

Llama block (RMSNorm, RoPE, SwiGLU, SDPA), per token, with h = dim and f = ffn_hidden:
  fp32:  RMSNorm input, normalised input and output for both norms (6 h-wide tensors), q, k, v and the
         attention output (4, k and v after repeating grouped heads), 4 f-wide SwiGLU tensors → 40h + 16f.
  bf16:  the same in 2 bytes, plus the fp32 upcast each RMSNorm keeps → 28h + 8f.
  autocast: 34h + 8f, plus 2 bytes per weight.
GPT block (LayerNorm, GeLU MLP, SDPA): fp32 32h + 8f; bf16 16h + 4f; autocast 24h + 4f + 2 bytes per weight.
Small per-token terms: the attention log-sum-exp (4 bytes per head) and the norms' statistics.
``tests/test_planner_estimate.py`` checks these against torch's memory tracker on real blocks.

Tensor parallelism (Megatron) divides q, k, v, the attention output and the MLP tensors by t; sequence
parallelism also divides the norm inputs and statistics, but the all-gathered inputs of the column-parallel
projections (one per norm) stay full-size, as torch's DTensor keeps them for the weight gradients.
Eager attention (scores materialised, Korthikanti et al. 2022) adds the softmax output, and with dropout its
mask and output: ``a·s²·b·(p + 1 + p)`` per layer.
"""

from __future__ import annotations

from meshfit.models.config import ModelConfig

MODES = ("fp32", "bf16", "autocast")
# family -> mode -> (bytes per token per unit of dim, per unit of ffn_hidden, per block weight)
_COEF = {
    "llama": {"fp32": (40, 16, 0), "bf16": (28, 8, 0), "autocast": (34, 8, 2)},
    "gpt": {"fp32": (32, 8, 0), "bf16": (16, 4, 0), "autocast": (24, 4, 2)},
}
_NORMS = {"llama": 2, "gpt": 2}  # norms per block
_STATS = {"llama": 4, "gpt": 8}  # bytes of statistics per token per norm (rstd; mean + rstd)


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
                           sp: bool = False, attention: str = "flash", dropout: float = 0.0) -> float:
    """Bytes one rank keeps for the backward of one block and one micro-batch of ``batch`` sequences."""
    dim_coef, ffn_coef, weight_bytes = _COEF[model.family][mode]
    p = value_bytes(mode)
    tokens = seq * batch
    # q, k, v and the attention output: 4 dim-wide tensors of the compute dtype, split by heads.
    heads_part = 4 * p
    replicated = dim_coef - heads_part
    gathered = 2 * p if sp else 0  # the full-size inputs of the column-parallel projections under SP
    per_token = (replicated - gathered) / (tp if sp else 1) + gathered + heads_part / tp
    total = tokens * model.dim * per_token
    total += tokens * model.ffn_hidden * ffn_coef / tp
    stats = _NORMS[model.family] * _STATS[model.family]
    total += tokens * (stats / (tp if sp else 1) + 4 * model.n_heads / tp)
    total += weight_bytes * block_weight_params(model) / tp
    if attention == "eager" or (dropout > 0 and model.family == "gpt"):
        # scores kept: softmax output, and with dropout its mask (1 byte) and output
        per_score = p + ((1 + p) if dropout > 0 else 0)
        total += model.n_heads / tp * seq * seq * batch * per_score
    if dropout > 0 and model.family == "gpt":
        total += 2 * tokens * model.dim / (tp if sp else 1)  # residual dropout masks, one byte each
    return total


def checkpointed_block_bytes(model: ModelConfig, *, mode: str, seq: int, batch: int, tp: int = 1,
                             sp: bool = False) -> float:
    """A checkpointed block keeps only its input: the residual stream (fp32 under autocast)."""
    residual = 4 if mode in ("fp32", "autocast") else 2
    return seq * batch * model.dim * residual / (tp if sp else 1)
