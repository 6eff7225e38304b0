"""models.traffic against the bytes meshfit's real model code moves through its element-wise operators.

Every operator torch dispatches in one block's forward + backward (and in the loss's) is counted by the
bytes of its tensor arguments and results, except matmuls, the attention kernel, views and allocations.
Counting at two batch sizes and taking the difference leaves the bytes per token (the weights and RoPE
tables, read once per call, drop out). The norm runs as one stand-in kernel charged what the fused
kernel moves on a GPU (torch's CPU RMSNorm is a chain of small operators).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from meshfit.models import ModelConfig, build_model
from meshfit.models.loss import lm_loss
from meshfit.models.traffic import elementwise_traffic

NOT_ELEMENTWISE = {
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "embedding", "embedding_dense_backward",
    "nll_loss_forward", "view", "_unsafe_view", "t", "transpose", "expand", "detach", "alias", "permute",
    "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes", "as_strided", "unbind",
    "lift_fresh", "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "zeros",
    "zeros_like", "ones_like", "full", "arange", "scalar_tensor", "randn_like", "_local_scalar_dense",
}


class _Bytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if self.paused or name in NOT_ELEMENTWISE:
            return out
        # The loss's gradient scatter writes its output; reading the log-probabilities is not part of it.
        counted = out if name == "nll_loss_backward" else (args, kwargs, out)
        self.total += sum(t.numel() * t.element_size() for t in tree_flatten(counted)[0]
                          if isinstance(t, torch.Tensor))
        return out


def _fused_norm(meter: _Bytes):
    """A stand-in for F.rms_norm charged as one fused kernel: forward reads x and writes y (2 values),
    backward reads x and the output gradient and writes the input gradient (3 values)."""

    class Norm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shape, weight, eps):
            meter.paused += 1
            y = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * weight
            meter.paused -= 1
            ctx.save_for_backward(weight)
            meter.total += 2 * x.numel() * x.element_size()
            return y

        @staticmethod
        def backward(ctx, grad):
            (weight,) = ctx.saved_tensors
            meter.paused += 1
            out = grad * weight  # the value does not matter for counting
            meter.paused -= 1
            meter.total += 3 * grad.numel() * grad.element_size()
            return out, None, None, None

    return lambda x, shape, weight=None, eps=None: Norm.apply(x, shape, weight, eps)


def _block_bytes(cfg: ModelConfig, dtype: torch.dtype, batch: int, seq: int, monkeypatch) -> int:
    net = build_model(cfg, torch.device("cpu")).to(dtype).train()
    block = net.layers["0"]
    block.attention.core.dropout = 0.0  # the attention kernel's own dropout stays inside the fused kernel
    x = torch.randn(batch, seq, cfg.dim, dtype=dtype, requires_grad=True)
    extra = (net.rope.cos, net.rope.sin) if cfg.family == "llama" else ()
    meter = _Bytes()
    monkeypatch.setattr(F, "rms_norm", _fused_norm(meter))
    with meter:
        y = block(x, *extra)
        y.backward(torch.randn_like(y))
    return meter.total


def _loss_bytes(cfg: ModelConfig, dtype: torch.dtype, batch: int, seq: int) -> int:
    logits = torch.randn(batch, seq, cfg.padded_vocab, dtype=dtype, requires_grad=True)
    meter = _Bytes()
    with meter:
        lm_loss(logits, torch.randint(0, cfg.vocab_size, (batch, seq)), cfg.vocab_size).backward()
    return meter.total


# Qwen2's q/k/v biases; Qwen3's q/k norms with heads wider than dim / heads.
VARIANTS = {"plain": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True, "head_dim": 48}}


@pytest.mark.parametrize("family,dropout,vocab,variant", [("llama", 0.0, 320, "plain"), ("gpt", 0.0, 320, "plain"),
                                                          ("gpt", 0.1, 300, "plain"), ("llama", 0.0, 320, "qwen2"),
                                                          ("llama", 0.0, 320, "qwen3")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_counted_bytes_per_token_match_the_model_code(family, dropout, vocab, variant, dtype, monkeypatch):
    torch.manual_seed(0)
    # A vocabulary of 300 padded to 320: the loss masks the padding's logits.
    cfg = ModelConfig(family=family, dim=128, n_layers=1, n_heads=4, n_kv_heads=2 if family == "llama" else 4,
                      vocab_size=vocab, ffn_hidden=352, max_seq_len=64, tie_embeddings=False, dropout=dropout,
                      pad_vocab_to=64, **VARIANTS[variant])
    t = elementwise_traffic(cfg, dtype.itemsize)
    seq = 64
    block = (_block_bytes(cfg, dtype, 2, seq, monkeypatch) - _block_bytes(cfg, dtype, 1, seq, monkeypatch)) / seq
    loss = (_loss_bytes(cfg, dtype, 2, seq) - _loss_bytes(cfg, dtype, 1, seq)) / seq
    # Left out by the count: a few scalars per token (norm statistics, the targets), 8-32 bytes here; the
    # smallest counted operator moves c · dim = 512 or more.
    assert t.block <= block <= t.block + 32
    assert t.vocab < loss <= t.vocab + 8


def test_split_parts_scale_with_the_widths_tensor_parallelism_divides():
    base = ModelConfig(family="llama", dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=512,
                       ffn_hidden=704, max_seq_len=64, tie_embeddings=False)
    t = elementwise_traffic(base, 2)
    # Wider FFNs and more key/value heads (RoPE on more keys) add to the split part only.
    for wider in (dataclasses.replace(base, ffn_hidden=1408), dataclasses.replace(base, n_kv_heads=8)):
        w = elementwise_traffic(wider, 2)
        assert (w.wide_fwd, w.wide_bwd, w.gathered_bwd) == (t.wide_fwd, t.wide_bwd, t.gathered_bwd)
        assert w.split_fwd > t.split_fwd and w.split_bwd > t.split_bwd
    # fp32 values: no casts, so fewer bytes than twice bf16's.
    assert elementwise_traffic(base, 4).block < 2 * t.block
