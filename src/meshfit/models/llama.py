"""Llama-style decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.

Forward code infers head counts from tensor shapes, never from the config,
so the same module runs unchanged after tensor parallelism shards the
projections (each rank then holds fewer heads). Top-level pieces may be set
to ``None`` and layers deleted from ``layers`` to form a pipeline stage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshfit.models.config import ModelConfig
from meshfit.models.layers import AttentionCore, RMSNorm
from meshfit.models.masks import Mask, forward_mask
from meshfit.models.moe import MoE, SwiGLU
from meshfit.models.rope import inverse_frequencies
from meshfit.models.tying import TiedHead


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE cos/sin tables of shape ``[max_seq_len, head_dim]``, at the frequencies of the
    config's RoPE scaling (models/rope.py).

    The tables are non-persistent buffers: they are not checkpointed and are
    recomputed by :meth:`init_buffers` after ``to_empty`` materializes a
    meta-device model. Row i holds position i, unless ``position_rows`` (the
    global positions of the tokens this rank holds, set by context
    parallelism) says otherwise for the first rows.
    """

    position_rows: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_seq_len = cfg.max_seq_len
        self.register_buffer("cos", torch.empty(cfg.max_seq_len, cfg.head_size), persistent=False)
        self.register_buffer("sin", torch.empty(cfg.max_seq_len, cfg.head_size), persistent=False)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        device = self.cos.device
        inv_freq = inverse_frequencies(self.cfg, device)
        positions = torch.arange(self.max_seq_len, dtype=torch.float32, device=device)
        if self.position_rows is not None:
            positions[:len(self.position_rows)] = self.position_rows.to(device, torch.float32)
        angles = torch.outer(positions, inv_freq)
        # Same angle for channel i and i + head_dim/2 ("rotate half" layout).
        angles = torch.cat((angles, angles), dim=-1)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[b, s, head_dim]`` of each token's own position (``[b, s]``, e.g. restarting at
        every document), computed as the tables' rows are, so position p rotates alike either way."""
        inv_freq = inverse_frequencies(self.cfg, positions.device)
        angles = positions.to(torch.float32)[..., None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[b, s, heads, head_dim]`` by the first ``s`` positions (tables
    ``[max_seq_len, head_dim]``), or by each token's own (``[b, s, head_dim]``, from `RotaryEmbedding.at`)."""
    seqlen = x.shape[1]
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [b, s, 1, head_dim]
    elif seqlen > cos.shape[0]:
        raise ValueError(f"sequence length {seqlen} exceeds model.max_seq_len={cos.shape[0]}")
    else:
        cos = cos[:seqlen].unsqueeze(1)  # [s, 1, head_dim], broadcast over heads
        sin = sin[:seqlen].unsqueeze(1)
    # fp32 rotation: bf16 angles lose precision at large positions.
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention; with ``qkv_bias`` biases on the q/k/v projections (Qwen2), with ``qk_norm``
    an RMSNorm over each query and key head before RoPE (Qwen3), its ``head_dim`` weights shared by
    every head (tensor parallelism keeps them whole on every rank)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_size
        q, kv = cfg.q_width, cfg.n_kv_heads * cfg.head_size
        self.wq = nn.Linear(cfg.dim, q, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, kv, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, kv, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q, cfg.dim, bias=False)
        # q/k norms over each head (Qwen3) or over the whole projections (OLMoE; before the heads are split).
        self.norm_heads = cfg.qk_norm_scope == "head"
        q_norm, k_norm = (cfg.head_size, cfg.head_size) if self.norm_heads else (q, kv)
        self.q_norm = RMSNorm(q_norm, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_norm, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.core = AttentionCore(0.0, cfg.attention)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask | None = None
                ) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.q_norm is not None and not self.norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        bs, seqlen = q.shape[:2]
        # -1: local head counts, which tensor parallelism divides by its degree.
        q = q.view(bs, seqlen, -1, self.head_dim)
        k = k.view(bs, seqlen, -1, self.head_dim)
        v = v.view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, head_dim]
        out = self.core(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


FeedForward = SwiGLU  # the dense block's MLP: ``w2(silu(w1 x) * w3 x)``


class LlamaBlock(nn.Module):
    """Attention and an MLP, each behind an RMSNorm on the residual stream. Block `index` of a
    Mixture-of-Experts model (config.is_moe_layer) has the MoE MLP (models/moe.py) in place of the SwiGLU."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.is_moe_layer(index) else FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask | None = None
                ) -> torch.Tensor:
        # The mask goes by keyword: layouts' input hooks (sequence parallelism) handle the positional inputs.
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(TiedHead):
    """Decoder-only Llama transformer mapping tokens ``[b, s]`` to logits ``[b, s, vocab]``.

    Pipeline stages: with ``tok_embeddings`` set to ``None`` the input is
    hidden states ``[b, s, dim]``; with ``norm``/``output`` set to ``None``
    hidden states are returned.

    Packed documents: ``documents`` (``[b, s]`` document ids) makes attention block-causal
    (models/masks.py) and ``positions`` (``[b, s]``) gives each token its RoPE position, both per token
    of the input as given (a layout that splits the sequence splits them alike). ``mask_builder``: set by
    a layout that builds the mask itself (context parallelism).
    """

    mask_builder: Callable[[torch.Tensor, torch.dtype], Mask] | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.padded_vocab, cfg.dim)
        self.rope = RotaryEmbedding(cfg)
        self.layers = nn.ModuleDict({str(i): LlamaBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.padded_vocab, bias=False)
        self.tie_weights()

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = (self.rope.cos, self.rope.sin) if positions is None else self.rope.at(positions)
        mask = forward_mask(documents, self.mask_builder, self.cfg.attention, 0.0, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
