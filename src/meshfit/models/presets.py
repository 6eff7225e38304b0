"""Named model shapes: tiny ones for tests, the published Llama 3 / GPT-3 sizes, and the released Llama 3.1/3.2,
Qwen2.5, Qwen3 and Mistral models as their Hugging Face config.json files describe them (RoPE scaling,
head widths, biases and norms included), so that `plan` and `verify` need no weights."""

from __future__ import annotations

from dataclasses import replace

from meshfit.models.config import ModelConfig
from meshfit.util.did_you_mean import did_you_mean


def _llama3(dim: int, n_layers: int, n_heads: int, ffn_hidden: int, tied: bool) -> ModelConfig:
    return ModelConfig(
        family="llama",
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=ffn_hidden,
        max_seq_len=8192,
        tie_embeddings=tied,
        norm_eps=1e-5,
        rope_theta=500000.0,
    )


def _llama31(dim: int, n_layers: int, n_heads: int, ffn_hidden: int, tied: bool, factor: float) -> ModelConfig:
    # meta-llama/Llama-3.1-{8B,70B,405B} and Llama-3.2-{1B,3B} config.json: Llama 3's shapes with 131072
    # positions and rope_scaling {rope_type llama3, factor, low_freq_factor 1, high_freq_factor 4,
    # original_max_position_embeddings 8192} (8 for 3.1, 32 for 3.2).
    return replace(_llama3(dim, n_layers, n_heads, ffn_hidden, tied), max_seq_len=131072, rope_scaling="llama3",
                   rope_factor=factor, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                   rope_original_max_seq_len=8192)


def _qwen(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, vocab: int, max_seq: int,
          eps: float, qwen3: bool) -> ModelConfig:
    # Qwen/Qwen2.5-* (q/k/v biases) and Qwen/Qwen3-* (q/k norms, head_dim 128) config.json: rope_theta 1e6,
    # untied embeddings, no sliding window in use.
    return ModelConfig(family="llama", dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       vocab_size=vocab, ffn_hidden=ffn_hidden, max_seq_len=max_seq, tie_embeddings=False,
                       norm_eps=eps, rope_theta=1000000.0, qkv_bias=not qwen3, qk_norm=qwen3,
                       head_dim=128 if qwen3 and dim != 128 * n_heads else None)


def _mixtral(dim: int, n_layers: int, n_heads: int, ffn_hidden: int, max_seq: int) -> ModelConfig:
    # mistralai/Mixtral-8x7B-v0.1 and -8x22B-v0.1 config.json: 8 experts of intermediate_size, top 2
    # (softmax, renormalised), 8 key/value heads, vocabulary 32000, rope_theta 1e6, no sliding window.
    return ModelConfig(family="llama", dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, vocab_size=32000,
                       ffn_hidden=ffn_hidden, max_seq_len=max_seq, tie_embeddings=False, norm_eps=1e-5,
                       rope_theta=1000000.0, moe_experts=8, moe_top_k=2, moe_ffn_hidden=ffn_hidden,
                       moe_aux_loss_coeff=0.02 if dim == 4096 else 0.001)


def _qwen3_moe(dim: int, n_layers: int, n_heads: int, ffn_hidden: int, moe_hidden: int) -> ModelConfig:
    # Qwen/Qwen3-30B-A3B and -235B-A22B config.json: Qwen3's attention (q/k norms, head_dim 128, 4 key/value
    # heads), 128 experts, top 8 renormalised, every layer sparse (decoder_sparse_step 1, no mlp_only_layers;
    # intermediate_size is then unused), router_aux_loss_coef 0.001.
    return replace(_qwen(dim, n_layers, n_heads, 4, ffn_hidden, 151936, 40960, 1e-6, qwen3=True), moe_experts=128,
                   moe_top_k=8, moe_ffn_hidden=moe_hidden, moe_aux_loss_coeff=0.001)


def _gpt3(dim: int, n_layers: int, n_heads: int) -> ModelConfig:
    # Brown et al. 2020, Table 2.1: 2048-token context, 4x MLP, tied embeddings.
    return ModelConfig(
        family="gpt",
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        vocab_size=50257,
        ffn_hidden=4 * dim,
        max_seq_len=2048,
        tie_embeddings=True,
    )


PRESETS: dict[str, ModelConfig] = {
    # Fast CPU test models.
    "tiny": ModelConfig(
        family="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
        ffn_hidden=128, max_seq_len=256, tie_embeddings=False,
    ),
    "tiny-gpt": ModelConfig(
        family="gpt", dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256,
        ffn_hidden=256, max_seq_len=256, tie_embeddings=True, dropout=0.0,
    ),
    "small": ModelConfig(
        family="llama", dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512,
        ffn_hidden=688, max_seq_len=512, tie_embeddings=False,
    ),
    # Mixture-of-Experts test models: 8 experts, top 2, the first block dense (as DeepSeek's first_k_dense).
    "tiny-moe": ModelConfig(
        family="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
        ffn_hidden=128, max_seq_len=256, tie_embeddings=False, moe_experts=8, moe_top_k=2, moe_ffn_hidden=32,
        moe_dense_layers=1, moe_aux_loss_coeff=0.01,
    ),
    "small-moe": ModelConfig(
        family="llama", dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512,
        ffn_hidden=688, max_seq_len=512, tie_embeddings=False, moe_experts=8, moe_top_k=2, moe_ffn_hidden=176,
        moe_shared_experts=1, moe_dense_layers=1, moe_aux_loss_coeff=0.01,
    ),
    "small-gpt": ModelConfig(
        family="gpt", dim=256, n_layers=4, n_heads=8, n_kv_heads=8, vocab_size=512,
        ffn_hidden=1024, max_seq_len=512, tie_embeddings=True, dropout=0.0,
    ),
    # Llama 3.2 1B/3B shapes (tied) and Llama 3 8B/70B/405B, with Llama 3's 8192 positions and unscaled
    # RoPE (the llama3.1-* and llama3.2-* presets below are the released models).
    "llama3-1b": _llama3(2048, 16, 32, 8192, tied=True),
    "llama3-3b": _llama3(3072, 28, 24, 8192, tied=True),
    "llama3-8b": _llama3(4096, 32, 32, 14336, tied=False),
    "llama3-70b": _llama3(8192, 80, 64, 28672, tied=False),
    "llama3-405b": _llama3(16384, 126, 128, 53248, tied=False),
    # Released models, from their config.json (tests/test_hf_presets.py builds each in transformers from the
    # same values and compares the parameter count).
    "llama3.1-8b": _llama31(4096, 32, 32, 14336, tied=False, factor=8.0),
    "llama3.1-70b": _llama31(8192, 80, 64, 28672, tied=False, factor=8.0),
    "llama3.1-405b": _llama31(16384, 126, 128, 53248, tied=False, factor=8.0),
    "llama3.2-1b": _llama31(2048, 16, 32, 8192, tied=True, factor=32.0),
    "llama3.2-3b": _llama31(3072, 28, 24, 8192, tied=True, factor=32.0),
    "qwen2.5-7b": _qwen(3584, 28, 28, 4, 18944, 152064, 131072, 1e-6, qwen3=False),
    "qwen2.5-72b": _qwen(8192, 80, 64, 8, 29568, 152064, 131072, 1e-5, qwen3=False),
    "qwen3-8b": _qwen(4096, 36, 32, 8, 12288, 151936, 40960, 1e-6, qwen3=True),
    "qwen3-32b": _qwen(5120, 64, 64, 8, 25600, 151936, 40960, 1e-6, qwen3=True),
    # mistralai/Mistral-7B-v0.1 config.json: a 4096-token sliding window (longer sequences are refused).
    "mistral-7b": ModelConfig(family="llama", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                              ffn_hidden=14336, max_seq_len=32768, tie_embeddings=False, norm_eps=1e-5,
                              rope_theta=10000.0, sliding_window=4096),
    # Mixture-of-Experts models (tests/test_moe_presets.py counts each against transformers).
    "mixtral-8x7b": _mixtral(4096, 32, 32, 14336, 32768),
    "mixtral-8x22b": _mixtral(6144, 56, 48, 16384, 65536),
    "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 6144, 768),
    "qwen3-235b-a22b": _qwen3_moe(4096, 94, 64, 12288, 1536),
    # allenai/OLMoE-1B-7B-0924 config.json: 64 experts of 1024, top 8 not renormalised (norm_topk_prob
    # false), q/k norms over the whole projections, multi-head attention, rope_theta 1e4, no clip_qkv.
    "olmoe-1b-7b": ModelConfig(family="llama", dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, vocab_size=50304,
                               ffn_hidden=1024, max_seq_len=4096, tie_embeddings=False, norm_eps=1e-5,
                               rope_theta=10000.0, qk_norm=True, qk_norm_scope="projection", moe_experts=64,
                               moe_top_k=8, moe_norm_topk=False, moe_aux_loss_coeff=0.01),
    "gpt3-125m": _gpt3(768, 12, 12),
    "gpt3-350m": _gpt3(1024, 24, 16),
    "gpt3-760m": _gpt3(1536, 24, 16),
    # The paper lists n_heads=24 with d_head=128 for 1.3B, which does not
    # multiply to d_model=2048; 16 heads keeps d_head=128.
    "gpt3-1.3b": _gpt3(2048, 24, 16),
    "gpt3-2.7b": _gpt3(2560, 32, 32),
    "gpt3-6.7b": _gpt3(4096, 32, 32),
    # The paper lists d_model=5140, which 40 heads do not divide; 5120 = 40 * 128.
    "gpt3-13b": _gpt3(5120, 40, 40),
    "gpt3-175b": _gpt3(12288, 96, 96),
}


def get_preset(name: str) -> ModelConfig:
    """Return the named preset; unknown names raise ``ValueError`` listing the valid ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; {did_you_mean(name, PRESETS)}"
                         f"valid presets: {', '.join(PRESETS)}") from None
