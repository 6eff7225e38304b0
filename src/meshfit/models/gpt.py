"""GPT-2/3-style decoder: learned positions, LayerNorm, GeLU MLP, multi-head attention.

Module names mirror :mod:`meshfit.models.llama` (separate ``wq``/``wk``/``wv``/
``wo``, ``feed_forward.w1``/``w2``) so the same tensor-parallel plans apply.
Forward code infers head counts from tensor shapes, and top-level pieces may
be ``None`` for pipeline stages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshfit.models.config import ModelConfig
from meshfit.models.layers import AttentionCore, Dropout
from meshfit.models.masks import Mask, forward_mask
from meshfit.models.tying import TiedHead


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_size
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)
        self.core = AttentionCore(cfg.dropout, cfg.attention)

    def forward(self, x: torch.Tensor, mask: Mask | None = None) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        bs, seqlen = q.shape[:2]
        # -1: local head count, which tensor parallelism divides by its degree.
        q, k, v = (t.view(bs, seqlen, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = self.core(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)  # up
        self.act = nn.GELU(approximate="tanh")  # GPT-2's GeLU
        self.w2 = nn.Linear(hidden, dim)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))


class GPTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)
        self.resid_drop = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: Mask | None = None) -> torch.Tensor:
        # The mask goes by keyword: layouts' input hooks (sequence parallelism) handle the positional inputs.
        h = x + self.resid_drop(self.attention(self.attention_norm(x), mask=mask))
        return h + self.resid_drop(self.feed_forward(self.ffn_norm(h)))


class GPT(TiedHead):
    """Decoder-only GPT transformer mapping tokens ``[b, s]`` to logits ``[b, s, vocab]``.

    Pipeline stages: with ``tok_embeddings`` set to ``None`` the input is
    hidden states ``[b, s, dim]`` (positions and embedding dropout were
    applied by the first stage); with ``norm``/``output`` set to ``None``
    hidden states are returned. ``position_rows``: the global positions of the
    tokens this rank holds (set by context parallelism); None: 0, 1, 2, ...

    Packed documents: ``documents`` (``[b, s]`` document ids) makes attention block-causal
    (models/masks.py) and ``positions`` (``[b, s]``) picks each token's learned position, both per token
    of the input as given. ``mask_builder``: set by a layout that builds the mask itself (context
    parallelism).
    """

    position_rows: torch.Tensor | None = None
    mask_builder: Callable[[torch.Tensor, torch.dtype], Mask] | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.padded_vocab, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.drop = Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): GPTBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.padded_vocab, bias=False)
        self.tie_weights()

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            seqlen = tokens.shape[1]
            max_len = self.pos_embeddings.num_embeddings
            if seqlen > max_len:
                raise ValueError(f"sequence length {seqlen} exceeds model.max_seq_len={max_len}")
            rows = self.position_rows
            if positions is None:
                positions = (torch.arange(seqlen, device=tokens.device) if rows is None
                             else rows[:seqlen].to(tokens.device))
            h = h + self.pos_embeddings(positions)
        return self.drop(h)

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self._embed(tokens, positions) if self.tok_embeddings is not None else tokens
        dropout = self.cfg.dropout if self.training else 0.0
        mask = forward_mask(documents, self.mask_builder, self.cfg.attention, dropout, h.dtype)
        for layer in self.layers.values():
            h = layer(h) if mask is None else layer(h, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
