"""The presets of released models are their config.json files: read by meshfit they give the preset, and
transformers builds (on the meta device, no weights) a model of exactly the preset's parameter count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from meshfit.models import PRESETS, num_params
from meshfit.models.hf import model_from_hf_config

_LLAMA31 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "silu", "max_position_embeddings": 131072, "mlp_bias": False,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "vocab_size": 128256,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
_QWEN25 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
           "hidden_act": "silu", "max_position_embeddings": 131072, "rope_theta": 1000000.0,
           "sliding_window": 131072, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 152064}
_QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
          "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960,
          "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
          "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}

# The fields of each model's config.json on the Hugging Face Hub (meta-llama/Llama-3.1-8B, -70B, -405B,
# Llama-3.2-1B, -3B; Qwen/Qwen2.5-7B, -72B; Qwen/Qwen3-8B, -32B; mistralai/Mistral-7B-v0.1), as copies of
# those files carry them (e.g. citsjtu2020/LLM-Prof sglang/Model_Config.md, Lightning-AI/litgpt config.py).
RELEASED = {
    "llama3.1-8b": {**_LLAMA31, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                    "num_hidden_layers": 32, "tie_word_embeddings": False},
    "llama3.1-70b": {**_LLAMA31, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                     "num_hidden_layers": 80, "tie_word_embeddings": False},
    "llama3.1-405b": {**_LLAMA31, "hidden_size": 16384, "intermediate_size": 53248, "num_attention_heads": 128,
                      "num_hidden_layers": 126, "tie_word_embeddings": False},
    "llama3.2-1b": {**_LLAMA31, "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192,
                    "num_attention_heads": 32, "num_hidden_layers": 16, "tie_word_embeddings": True,
                    "rope_scaling": {**_LLAMA31["rope_scaling"], "factor": 32.0}},
    "llama3.2-3b": {**_LLAMA31, "head_dim": 128, "hidden_size": 3072, "intermediate_size": 8192,
                    "num_attention_heads": 24, "num_hidden_layers": 28, "tie_word_embeddings": True,
                    "rope_scaling": {**_LLAMA31["rope_scaling"], "factor": 32.0}},
    "qwen2.5-7b": {**_QWEN25, "hidden_size": 3584, "intermediate_size": 18944, "max_window_layers": 28,
                   "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
                   "rms_norm_eps": 1e-06},
    "qwen2.5-72b": {**_QWEN25, "hidden_size": 8192, "intermediate_size": 29568, "max_window_layers": 80,
                    "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
                    "rms_norm_eps": 1e-05},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 36,
                 "num_attention_heads": 32, "num_hidden_layers": 36},
    "qwen3-32b": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 25600, "max_window_layers": 64,
                  "num_attention_heads": 64, "num_hidden_layers": 64},
    "mistral-7b": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_act": "silu",
                   "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
                   "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                   "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
                   "tie_word_embeddings": False, "vocab_size": 32000},
}


def _transformers_count(config: dict) -> int:
    """Parameters of transformers' model of `config`, built on the meta device (tied tensors once)."""
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_presets_are_their_config_files(tmp_path: Path, name: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(RELEASED[name]))
    assert model_from_hf_config(tmp_path / "config.json") == PRESETS[name]
    assert num_params(PRESETS[name]) == _transformers_count(RELEASED[name])

