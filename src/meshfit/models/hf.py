"""Model shapes from a Hugging Face ``config.json`` (Llama- and GPT-2-family models)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshfit.models.config import ModelConfig
from meshfit.util.jsonfile import read_json_object

# model_type values whose architecture is meshfit's Llama block (RMSNorm, RoPE, SwiGLU, GQA, no biases).
LLAMA_TYPES = ("llama", "mistral")
GPT_TYPES = ("gpt2",)


def _need(cfg: dict[str, Any], path: Path, *keys: str) -> Any:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    raise ValueError(f"{path}: missing field {' or '.join(repr(k) for k in keys)} for model_type "
                     f"{cfg.get('model_type')!r}")


def _llama(cfg: dict[str, Any], path: Path) -> ModelConfig:
    heads = _need(cfg, path, "num_attention_heads")
    return ModelConfig(
        family="llama", dim=_need(cfg, path, "hidden_size"), n_layers=_need(cfg, path, "num_hidden_layers"),
        n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
        vocab_size=_need(cfg, path, "vocab_size"), ffn_hidden=_need(cfg, path, "intermediate_size"),
        max_seq_len=_need(cfg, path, "max_position_embeddings"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
    )


def _gpt2(cfg: dict[str, Any], path: Path) -> ModelConfig:
    dim = _need(cfg, path, "n_embd", "hidden_size")
    heads = _need(cfg, path, "n_head", "num_attention_heads")
    return ModelConfig(
        family="gpt", dim=dim, n_layers=_need(cfg, path, "n_layer", "num_hidden_layers"), n_heads=heads,
        n_kv_heads=heads, vocab_size=_need(cfg, path, "vocab_size"), ffn_hidden=cfg.get("n_inner") or 4 * dim,
        max_seq_len=_need(cfg, path, "n_positions", "max_position_embeddings"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)), dropout=float(cfg.get("resid_pdrop", 0.0)),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
    )


def model_from_hf_config(path: str | Path) -> ModelConfig:
    """Read a Hugging Face ``config.json``; raises ValueError naming the file and what is wrong."""
    path = Path(path)
    cfg = read_json_object(path, "file", "give the path of a Hugging Face config.json")
    kind = cfg.get("model_type")
    if kind in LLAMA_TYPES:
        model = _llama(cfg, path)
    elif kind in GPT_TYPES:
        model = _gpt2(cfg, path)
    else:
        raise ValueError(f"{path}: model_type {kind!r} is not supported; supported: "
                         f"{', '.join(LLAMA_TYPES + GPT_TYPES)} (Llama- and GPT-2-style decoders)")
    try:
        model.validate()
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return model
