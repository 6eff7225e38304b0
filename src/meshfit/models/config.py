"""Model hyper-parameters, validation and analytic size/compute formulas.

Everything here is pure arithmetic on a :class:`ModelConfig`, so planners can
reason about models far too large to build (even on the meta device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

FAMILIES = ("llama", "gpt")
# RoPE frequency scalings the Llama block models (Hugging Face's rope_type names): "linear" divides every
# position by rope_factor; "llama3" divides the low frequencies by it and blends the middle band (Llama 3.1).
ROPE_SCALINGS = ("none", "linear", "llama3")
# Attention kernels: "flash" runs torch's fused scaled_dot_product_attention (it keeps a log-sum-exp per
# head and query), "eager" materialises the scores (softmax output, dropout mask and output are kept).
ATTENTIONS = ("flash", "eager")
# Router score functions of a Mixture-of-Experts block: softmax over the experts (Mixtral, Qwen3-MoE, OLMoE)
# or a sigmoid per expert (DeepSeek-V3).
MOE_SCORES = ("softmax", "sigmoid")
# Where q/k norms normalise (qk_norm): over each head's head_dim channels (Qwen3) or over the whole query and
# key projections (OLMoE: q_width and n_kv_heads * head_dim weights).
QK_NORM_SCOPES = ("head", "projection")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer.

    ``family`` selects the architecture: ``"llama"`` (RMSNorm, RoPE, SwiGLU,
    grouped-query attention, no biases unless ``qkv_bias``) or ``"gpt"`` (GPT-2/3: LayerNorm and
    linear biases, learned positions, GeLU MLP, multi-head attention).
    ``ffn_hidden`` is the SwiGLU hidden size for llama and the MLP width
    (usually ``4 * dim``) for gpt. ``dropout`` only applies to gpt.

    Llama-family variants (each a Hugging Face family's block): ``head_dim`` set where heads are not
    ``dim / n_heads`` wide (Qwen3, Mistral-Nemo); ``qkv_bias``: biases on the query, key and value
    projections (Qwen2/2.5); ``qk_norm``: an RMSNorm of ``head_dim`` weights on every query and key head
    before RoPE (Qwen3); ``rope_scaling`` with its parameters (Llama 3.1/3.2's "llama3", "linear");
    ``sliding_window``: the attention window the original model was trained with (Mistral): meshfit
    attends to the whole sequence, so sequences longer than it are refused (layout/model_fit.py).
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
    head_dim: int | None = None  # None: dim // n_heads (see head_size)
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: str = "none"  # one of ROPE_SCALINGS
    rope_factor: float | None = None  # linear, llama3: how much longer the context became
    rope_low_freq_factor: float | None = None  # llama3: wavelengths above original / low are scaled fully
    rope_high_freq_factor: float | None = None  # llama3: wavelengths below original / high are kept
    rope_original_max_seq_len: int | None = None  # llama3: the context length before scaling
    sliding_window: int | None = None
    qk_norm_scope: str = "head"  # one of QK_NORM_SCOPES
    # Mixture of Experts (models/moe.py), Llama family: every block after the first moe_dense_layers replaces
    # its SwiGLU MLP by moe_experts routed SwiGLU experts of width moe_ffn_hidden (None: ffn_hidden), each
    # token sent to moe_top_k of them, plus moe_shared_experts experts every token passes through. None:
    # a dense model, and every other moe_* field keeps its default.
    moe_experts: int | None = None
    moe_top_k: int = 2
    moe_ffn_hidden: int | None = None
    moe_shared_experts: int = 0
    moe_dense_layers: int = 0
    moe_score: str = "softmax"  # one of MOE_SCORES
    moe_norm_topk: bool = True  # the top-k gate values renormalised to sum to 1
    moe_route_scale: float = 1.0  # gate values multiplied by this
    # Training settings of the routing (RUN_FIELDS in config/model_source.py): an expert takes at most
    # ceil(factor * tokens * top_k / experts) tokens of a micro-batch, the rest dropped (None: dropless);
    # the Switch/GShard load-balancing loss's coefficient; the rate of DeepSeek-V3's aux-loss-free expert
    # bias (0: no bias), updated once per optimizer step from the token counts of every data-parallel rank.
    moe_capacity_factor: float | None = None
    moe_aux_loss_coeff: float = 0.0
    moe_bias_update_rate: float = 0.0

    @property
    def moe(self) -> bool:
        """Whether the model has Mixture-of-Experts blocks."""
        return self.moe_experts is not None

    @property
    def moe_hidden(self) -> int:
        """Width of one routed (and one shared) expert's SwiGLU."""
        return self.moe_ffn_hidden if self.moe_ffn_hidden is not None else self.ffn_hidden

    @property
    def moe_layers(self) -> int:
        """How many blocks are Mixture-of-Experts blocks (the last n_layers - moe_dense_layers)."""
        return max(0, self.n_layers - self.moe_dense_layers) if self.moe else 0

    def is_moe_layer(self, index: int) -> bool:
        return self.moe and index >= self.moe_dense_layers

    @property
    def head_size(self) -> int:
        """Width of one attention head: head_dim, or dim // n_heads when it is not set."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def q_width(self) -> int:
        """Width of the query projection's output (and of the attention's output projection input)."""
        return self.n_heads * self.head_size

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
            _check_positive(name, getattr(self, name))
        for name in ("head_dim", "sliding_window", "rope_original_max_seq_len"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name), "a positive integer or null")
        for name in ("tie_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be true or false")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}; "
                f"valid n_heads: {_fmt(_divisors(self.dim))} (or set model.head_dim)"
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
        validate_moe(self)

    def _validate_llama(self) -> None:
        if self.head_size % 2:
            # RoPE rotates pairs of channels.
            if self.head_dim is not None:
                raise ValueError(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs of channels)")
            even = [h for h in _divisors(self.dim) if (self.dim // h) % 2 == 0]
            raise ValueError(
                f"model.n_heads={self.n_heads} gives odd head_dim={self.head_size} (model.dim={self.dim}); "
                f"RoPE needs an even head_dim; valid n_heads: {_fmt(even)}"
            )
        if self.dropout != 0.0:
            raise ValueError(f"model.dropout={self.dropout} must be 0.0 for family 'llama' (it has no dropout)")
        if self.rope_theta <= 0:
            raise ValueError(f"model.rope_theta={self.rope_theta} must be > 0")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"model.qk_norm_scope={self.qk_norm_scope!r}; valid: {', '.join(QK_NORM_SCOPES)}")
        if self.qk_norm_scope != "head" and not self.qk_norm:
            raise ValueError(f"model.qk_norm_scope={self.qk_norm_scope!r} applies with model.qk_norm=true only")
        self._validate_rope_scaling()

    def _validate_rope_scaling(self) -> None:
        kind = self.rope_scaling
        if kind not in ROPE_SCALINGS:
            raise ValueError(f"model.rope_scaling={kind!r}; valid: {', '.join(ROPE_SCALINGS)}")
        needed = _ROPE_NEEDS[kind]
        for name in _ROPE_NEEDS["llama3"]:
            value = getattr(self, name)
            if name in needed and value is None:
                raise ValueError(f"model.rope_scaling={kind!r} needs model.{name}")
            if name not in needed and value is not None:
                users = [k for k, names in _ROPE_NEEDS.items() if name in names]
                raise ValueError(f"model.{name}={value} applies to model.rope_scaling {' or '.join(users)}, "
                                 f"not {kind!r}; set it to null")
        if kind != "none" and not self.rope_factor > 0:
            raise ValueError(f"model.rope_factor={self.rope_factor} must be > 0")
        if kind == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(f"model.rope_low_freq_factor={self.rope_low_freq_factor} and model.rope_high_freq_factor="
                             f"{self.rope_high_freq_factor} must satisfy 0 < low < high")

    def _validate_gpt(self) -> None:
        if self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"model.n_kv_heads={self.n_kv_heads} must equal model.n_heads={self.n_heads} "
                f"for family 'gpt' (multi-head attention); valid n_kv_heads: {self.n_heads}"
            )
        # The Llama block's variants; GPT's block already has a bias on every projection.
        for name, plain in (("head_dim", None), ("qkv_bias", False), ("qk_norm", False), ("rope_scaling", "none"),
                            ("qk_norm_scope", "head"),
                            ("sliding_window", None), *((n, None) for n in _ROPE_NEEDS["llama3"])):
            if getattr(self, name) != plain:
                raise ValueError(f"model.{name}={getattr(self, name)!r} applies to family 'llama' only; for "
                                 f"family 'gpt' leave it {'null' if plain is None else str(plain).lower()}")


# The parameters each RoPE scaling reads (Hugging Face's _compute_linear_scaling_rope_parameters and
# _compute_llama3_parameters); every other one stays null.
ROPE_PARAMETERS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len")
_ROPE_NEEDS = {"none": (), "linear": ("rope_factor",), "llama3": ROPE_PARAMETERS}


# Each Mixture-of-Experts field with the value it keeps on a dense model.
MOE_DEFAULTS = {"moe_experts": None, "moe_top_k": 2, "moe_ffn_hidden": None, "moe_shared_experts": 0,
                "moe_dense_layers": 0, "moe_score": "softmax", "moe_norm_topk": True, "moe_route_scale": 1.0,
                "moe_capacity_factor": None, "moe_aux_loss_coeff": 0.0, "moe_bias_update_rate": 0.0}


def validate_moe(cfg: ModelConfig) -> None:
    """The Mixture-of-Experts fields: ValueError naming the first unusable one."""
    if not cfg.moe:
        for name, plain in MOE_DEFAULTS.items():
            if getattr(cfg, name) != plain:
                why = ("family 'gpt' has no Mixture-of-Experts block" if cfg.family == "gpt"
                       else "it applies to Mixture-of-Experts models (set model.moe_experts)")
                raise ValueError(f"model.{name}={getattr(cfg, name)!r}: {why}; leave it "
                                 f"{'null' if plain is None else str(plain).lower()}")
        return
    if cfg.family != "llama":
        raise ValueError(f"model.moe_experts={cfg.moe_experts!r}: family {cfg.family!r} has no Mixture-of-Experts "
                         "block (it is a variant of family 'llama'); leave it null")
    for name in ("moe_experts", "moe_top_k"):
        _check_positive(name, getattr(cfg, name))
    if cfg.moe_ffn_hidden is not None:
        _check_positive("moe_ffn_hidden", cfg.moe_ffn_hidden, "a positive integer or null (null: ffn_hidden)")
    for name in ("moe_shared_experts", "moe_dense_layers"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"model.{name}={value!r} must be a non-negative integer")
    if cfg.moe_top_k > cfg.moe_experts:
        raise ValueError(f"model.moe_top_k={cfg.moe_top_k} exceeds model.moe_experts={cfg.moe_experts}: each token "
                         f"goes to top_k different experts; valid moe_top_k: 1 to {cfg.moe_experts}")
    if cfg.moe_dense_layers >= cfg.n_layers:
        raise ValueError(f"model.moe_dense_layers={cfg.moe_dense_layers} leaves no Mixture-of-Experts block among "
                         f"model.n_layers={cfg.n_layers}; valid: 0 to {cfg.n_layers - 1}")
    if cfg.moe_score not in MOE_SCORES:
        raise ValueError(f"model.moe_score={cfg.moe_score!r}; valid: {', '.join(MOE_SCORES)}")
    if not isinstance(cfg.moe_norm_topk, bool):
        raise ValueError(f"model.moe_norm_topk={cfg.moe_norm_topk!r} must be true or false")
    if not cfg.moe_route_scale > 0:
        raise ValueError(f"model.moe_route_scale={cfg.moe_route_scale} must be > 0")
    if cfg.moe_capacity_factor is not None and not cfg.moe_capacity_factor > 0:
        raise ValueError(f"model.moe_capacity_factor={cfg.moe_capacity_factor} must be > 0 (or null: no token is "
                         "dropped)")
    for name in ("moe_aux_loss_coeff", "moe_bias_update_rate"):
        if not getattr(cfg, name) >= 0:
            raise ValueError(f"model.{name}={getattr(cfg, name)} must be ≥ 0 (0: off)")


def _check_positive(name: str, value: object, what: str = "a positive integer") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"model.{name}={value!r} must be {what}")


def _llama_attention_params(cfg: ModelConfig) -> int:
    """Attention and the block's two norms of one Llama block (everything but its MLP)."""
    d, q, kv = cfg.dim, cfg.q_width, cfg.n_kv_heads * cfg.head_size
    attn = d * q * 2 + d * kv * 2  # wq, wo + wk, wv
    biases = q + 2 * kv if cfg.qkv_bias else 0  # wq, wk, wv
    qk = (q + kv if cfg.qk_norm_scope == "projection" else 2 * cfg.head_size) if cfg.qk_norm else 0
    return attn + biases + 2 * d + qk  # RMSNorm weights (+ q_norm, k_norm)


def moe_mlp_params(cfg: ModelConfig, active: bool = False) -> int:
    """One Mixture-of-Experts MLP: its router, routed experts (only top_k of them when `active`: those one
    token passes through) and shared experts."""
    d, f = cfg.dim, cfg.moe_hidden
    routed = cfg.moe_top_k if active else cfg.moe_experts
    return d * cfg.moe_experts + 3 * d * f * (routed + cfg.moe_shared_experts)


def _llama_body_params(cfg: ModelConfig, active: bool = False) -> int:
    """Every Llama block's parameters (dense and Mixture-of-Experts blocks)."""
    moe = cfg.moe_layers
    dense = cfg.n_layers - moe
    mlp = dense * 3 * cfg.dim * cfg.ffn_hidden + (moe * moe_mlp_params(cfg, active) if moe else 0)
    return cfg.n_layers * _llama_attention_params(cfg) + mlp


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


def num_params(cfg: ModelConfig, active: bool = False) -> int:
    """Exact parameter count of the built model; a tied embedding/output weight counts once. `active`: with
    only the top_k routed experts of each Mixture-of-Experts block (the parameters one token uses)."""
    tok, pos = _embedding_params(cfg)
    if cfg.family == "llama":
        body = _llama_body_params(cfg, active) + cfg.dim  # final RMSNorm
    else:
        body = cfg.n_layers * _gpt_layer_params(cfg) + 2 * cfg.dim  # final LayerNorm
    head = 0 if cfg.tie_embeddings else cfg.padded_vocab * cfg.dim
    return tok + pos + body + head


def num_active_params(cfg: ModelConfig) -> int:
    """Parameters one token passes through: a Mixture-of-Experts block counts its top_k routed experts (and
    its router and shared experts); a dense model's are all of them."""
    return num_params(cfg, active=True)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, Kaplan/PaLM style, on the active parameters.

    ``6 * N + 12 * n_layers * q_width * seq_len`` where ``N`` is every parameter
    except the input token-embedding and positional tables (lookups, not
    matmuls), but including the output head even when it shares its weight
    with the input embedding (it is still a ``dim x vocab`` matmul). The
    second term is the attention score (QK^T) and weighted-sum (AV) matmuls:
    2 matmuls * 2 FLOPs/MAC * 3 (fwd + 2x bwd) = 12 per layer, query channel
    (n_heads * head_size, which is dim unless head_dim is set) and key position, counted over the full ``seq_len`` (causal masking is ignored,
    as in the PaLM MFU definition). Norm and bias parameters are counted in
    ``N``; they are negligible.
    """
    tok, pos = _embedding_params(cfg)
    n = num_active_params(cfg) - pos  # a Mixture-of-Experts block computes with top_k of its experts
    if not cfg.tie_embeddings:
        n -= tok  # the separate output head stays counted
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.q_width * seq_len


def pad_vocab_for_tp(cfg: ModelConfig, tp: int) -> ModelConfig:
    """``cfg`` with its vocabulary padded to a multiple of ``tp`` when ``tp`` does not divide it already."""
    if cfg.padded_vocab % tp == 0:
        return cfg
    return replace(cfg, pad_vocab_to=math.lcm(cfg.pad_vocab_to, tp))
