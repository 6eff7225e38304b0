"""Model hyper-parameters, validation and analytic size/compute formulas.

Everything here is pure arithmetic on a :class:`ModelConfig`, so planners can
reason about models far too large to build (even on the meta device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

FAMILIES = ("llama", "gpt")
# Attention kernels: "flash" runs torch's fused scaled_dot_product_attention (it keeps a log-sum-exp per
# head and query), "eager" materialises the scores (softmax output, dropout mask and output are kept).
ATTENTIONS = ("flash", "eager")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer.

    ``family`` selects the architecture: ``"llama"`` (RMSNorm, RoPE, SwiGLU,
    grouped-query attention, no biases) or ``"gpt"`` (GPT-2/3: LayerNorm and
    linear biases, learned positions, GeLU MLP, multi-head attention).
    ``ffn_hidden`` is the SwiGLU hidden size for llama and the MLP width
    (usually ``4 * dim``) for gpt. ``dropout`` only applies to gpt.
    """

    family: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden: int
    max_seq_len: int
    tie_embeddings: bool
    dropout: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # The embedding and head tables hold the vocabulary rounded up to a multiple of this (tensor
    # parallelism splits them by rows); the padded rows are zero and their logits never count.
    pad_vocab_to: int = 1
    # Attention kernel (models/layers.py): "flash" (torch's fused SDPA) or "eager" (scores materialised).
    attention: str = "flash"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and head tables: vocab_size rounded up to a multiple of pad_vocab_to."""
        return -(-self.vocab_size // self.pad_vocab_to) * self.pad_vocab_to

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field if the config is unusable."""
        if self.family not in FAMILIES:
            raise ValueError(
                f"model.family={self.family!r} is not supported; valid family: {', '.join(FAMILIES)}"
            )
        # Sizes first: the divisibility checks below would divide by zero otherwise.
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "max_seq_len",
                     "pad_vocab_to"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.{name}={value!r} must be a positive integer")
        if self.dim % self.n_heads:
            raise ValueError(
                f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}; "
                f"valid n_heads: {_fmt(_divisors(self.dim))}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={self.n_kv_heads}; "
                f"valid n_kv_heads: {_fmt(_divisors(self.n_heads))}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.norm_eps <= 0:
            raise ValueError(f"model.norm_eps={self.norm_eps} must be > 0")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"model.attention={self.attention!r}; valid: {', '.join(ATTENTIONS)}")
        if self.family == "llama":
            self._validate_llama()
        else:
            self._validate_gpt()

    def _validate_llama(self) -> None:
        if self.head_dim % 2:
            # RoPE rotates pairs of channels.
            even = [h for h in _divisors(self.dim) if (self.dim // h) % 2 == 0]
            raise ValueError(
                f"model.n_heads={self.n_heads} gives odd head_dim={self.head_dim} (model.dim={self.dim}); "
                f"RoPE needs an even head_dim; valid n_heads: {_fmt(even)}"
            )
        if self.dropout != 0.0:
            raise ValueError(f"model.dropout={self.dropout} must be 0.0 for family 'llama' (it has no dropout)")
        if self.rope_theta <= 0:
            raise ValueError(f"model.rope_theta={self.rope_theta} must be > 0")

    def _validate_gpt(self) -> None:
        if self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"model.n_kv_heads={self.n_kv_heads} must equal model.n_heads={self.n_heads} "
                f"for family 'gpt' (multi-head attention); valid n_kv_heads: {self.n_heads}"
            )


def _llama_layer_params(cfg: ModelConfig) -> int:
    d, hd = cfg.dim, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2  # wq, wo + wk, wv
    mlp = 3 * d * cfg.ffn_hidden  # w1, w2, w3
    norms = 2 * d  # RMSNorm weights
    return attn + mlp + norms


def _gpt_layer_params(cfg: ModelConfig) -> int:
    d, f = cfg.dim, cfg.ffn_hidden
    attn = 4 * (d * d + d)  # wq, wk, wv, wo with biases
    mlp = (d * f + f) + (f * d + d)  # w1, w2 with biases
    norms = 2 * 2 * d  # two LayerNorms, weight + bias
    return attn + mlp + norms


def _embedding_params(cfg: ModelConfig) -> tuple[int, int]:
    """(token embedding table, learned positional table) sizes."""
    pos = cfg.max_seq_len * cfg.dim if cfg.family == "gpt" else 0
    return cfg.padded_vocab * cfg.dim, pos


def num_params(cfg: ModelConfig) -> int:
    """Exact parameter count of the built model; a tied embedding/output weight counts once."""
    tok, pos = _embedding_params(cfg)
    if cfg.family == "llama":
        body = cfg.n_layers * _llama_layer_params(cfg) + cfg.dim  # final RMSNorm
    else:
        body = cfg.n_layers * _gpt_layer_params(cfg) + 2 * cfg.dim  # final LayerNorm
    head = 0 if cfg.tie_embeddings else cfg.padded_vocab * cfg.dim
    return tok + pos + body + head


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, Kaplan/PaLM style.

    ``6 * N + 12 * n_layers * dim * seq_len`` where ``N`` is every parameter
    except the input token-embedding and positional tables (lookups, not
    matmuls), but including the output head even when it shares its weight
    with the input embedding (it is still a ``dim x vocab`` matmul). The
    second term is the attention score (QK^T) and weighted-sum (AV) matmuls:
    2 matmuls * 2 FLOPs/MAC * 3 (fwd + 2x bwd) = 12 per layer, dim and key
    position, counted over the full ``seq_len`` (causal masking is ignored,
    as in the PaLM MFU definition). Norm and bias parameters are counted in
    ``N``; they are negligible.
    """
    tok, pos = _embedding_params(cfg)
    n = num_params(cfg) - pos
    if not cfg.tie_embeddings:
        n -= tok  # the separate output head stays counted
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.dim * seq_len


def pad_vocab_for_tp(cfg: ModelConfig, tp: int) -> ModelConfig:
    """``cfg`` with its vocabulary padded to a multiple of ``tp`` when ``tp`` does not divide it already."""
    if cfg.padded_vocab % tp == 0:
        return cfg
    return replace(cfg, pad_vocab_to=math.lcm(cfg.pad_vocab_to, tp))
