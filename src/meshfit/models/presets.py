"""Named model shapes: tiny ones for tests and the published Llama 3 / GPT-3 sizes."""

from __future__ import annotations

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
    "small-gpt": ModelConfig(
        family="gpt", dim=256, n_layers=4, n_heads=8, n_kv_heads=8, vocab_size=512,
        ffn_hidden=1024, max_seq_len=512, tie_embeddings=True, dropout=0.0,
    ),
    # Llama 3.2 1B/3B (tied) and Llama 3/3.1 8B/70B/405B. RoPE frequency
    # scaling used for 3.1's 128k context is not modelled.
    "llama3-1b": _llama3(2048, 16, 32, 8192, tied=True),
    "llama3-3b": _llama3(3072, 28, 24, 8192, tied=True),
    "llama3-8b": _llama3(4096, 32, 32, 14336, tied=False),
    "llama3-70b": _llama3(8192, 80, 64, 28672, tied=False),
    "llama3-405b": _llama3(16384, 126, 128, 53248, tied=False),
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
