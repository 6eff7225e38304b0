"""Mixture-of-Experts models as Hugging Face has them: the presets are their config.json files (parameter
counts equal transformers' model of the same values, built on meta), tiny random Mixtral, Qwen3-MoE and
OLMoE models compute transformers' logits and loss, exports load back into transformers, a rank reads only its
experts' tensors, and unmodelled config fields are refused."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers as tf
from hf_families import VOCAB, tokens

from meshfit.commands.main import main
from meshfit.config import load_config
from meshfit.models import PRESETS, build_model, num_params
from meshfit.models.hf import model_from_hf_config
from meshfit.models.hf_read import HFWeights, load_hf
from meshfit.models.hf_weights import hf_model_type, save_hf
from meshfit.models.loss import lm_loss
from meshfit.models.moe import GroupedExperts
from meshfit.train.launch import launch

_MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_act": "silu",
            "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000,
            "router_jitter_noise": 0.0, "output_router_logits": False}
_QWEN3_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
              "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu",
              "max_position_embeddings": 40960, "mlp_only_layers": [], "norm_topk_prob": True,
              "num_experts": 128, "num_experts_per_tok": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
              "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
              "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}
# The config.json files of mistralai/Mixtral-8x7B-v0.1 and -8x22B-v0.1, Qwen/Qwen3-30B-A3B and -235B-A22B.
RELEASED = {
    "mixtral-8x7b": {**_MIXTRAL, "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
                     "num_attention_heads": 32, "num_hidden_layers": 32, "router_aux_loss_coef": 0.02},
    "mixtral-8x22b": {**_MIXTRAL, "hidden_size": 6144, "intermediate_size": 16384, "max_position_embeddings": 65536,
                      "num_attention_heads": 48, "num_hidden_layers": 56, "router_aux_loss_coef": 0.001},
    "qwen3-30b-a3b": {**_QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_attention_heads": 32, "num_hidden_layers": 48, "max_window_layers": 48},
    "qwen3-235b-a22b": {**_QWEN3_MOE, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                        "num_attention_heads": 64, "num_hidden_layers": 94, "max_window_layers": 94},
}
# allenai/OLMoE-1B-7B-0924's config.json.
OLMOE = {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "hidden_act": "silu",
         "attention_bias": False, "attention_dropout": 0.0, "router_aux_loss_coef": 0.01,
         "output_router_logits": False, "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
         "vocab_size": 50304, "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-05,
         "norm_topk_prob": False, "tie_word_embeddings": False, "clip_qkv": None}


def _transformers_count(config: dict) -> int:
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**config))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(RELEASED))
def test_moe_presets_are_their_config_files(tmp_path: Path, name: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(RELEASED[name]))
    assert model_from_hf_config(tmp_path / "config.json") == PRESETS[name]
    assert num_params(PRESETS[name]) == _transformers_count(RELEASED[name])


def test_olmoe_preset_is_its_config_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(OLMOE))
    assert model_from_hf_config(tmp_path / "config.json") == PRESETS["olmoe-1b-7b"]
    assert num_params(PRESETS["olmoe-1b-7b"]) == _transformers_count(OLMOE)


TINY = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "num_experts_per_tok": 2}
CASES = {
    "mixtral": lambda: tf.MixtralConfig(**TINY, intermediate_size=48, num_local_experts=4),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**TINY, intermediate_size=112, moe_intermediate_size=48, num_experts=4,
                                           head_dim=24, mlp_only_layers=[0], norm_topk_prob=True),
    "qwen3_moe-unnormed": lambda: tf.Qwen3MoeConfig(**TINY, intermediate_size=112, moe_intermediate_size=48,
                                                    num_experts=4, norm_topk_prob=False),
    "olmoe": lambda: tf.OlmoeConfig(**TINY, intermediate_size=48, num_experts=4),
    "olmoe-normed": lambda: tf.OlmoeConfig(**TINY, intermediate_size=48, num_experts=4, norm_topk_prob=True),
}


def _save(case: str, folder: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(CASES[case]()).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_loss_equal_transformers_and_the_export_loads_back(tmp_path: Path, case: str) -> None:
    hf = _save(case, tmp_path / "in")
    cfg = model_from_hf_config(tmp_path / "in" / "config.json")
    weights = load_hf(tmp_path / "in", cfg)
    model = build_model(cfg, "cpu")
    model.load_state_dict(weights)
    toks = tokens()
    with torch.no_grad():
        ref = hf(input_ids=toks, labels=toks)
        logits = model.eval()(toks[:, :-1])
    assert (logits - ref.logits[:, :-1]).abs().max().item() < 1e-5
    assert lm_loss(logits, toks[:, 1:], cfg.vocab_size).item() == pytest.approx(ref.loss.item(), abs=1e-5)
    for experts in (m for m in model.modules() if isinstance(m, GroupedExperts)):
        assert experts._grouped(toks.new_zeros(1, cfg.dim).float(), experts.w1, experts.w2, experts.w3)
        experts.kernel = "loop"  # the per-expert fallback computes the same function
    with torch.no_grad():
        assert (model(toks[:, :-1]) - ref.logits[:, :-1]).abs().max().item() < 1e-5
    save_hf(weights, cfg, tmp_path / "out")
    assert model_from_hf_config(tmp_path / "out" / "config.json") == cfg
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(input_ids=toks).logits[:, :-1] - logits).abs().max().item() < 1e-5


def test_a_rank_reads_only_the_experts_it_holds(tmp_path: Path) -> None:
    _save("mixtral", tmp_path)
    cfg = model_from_hf_config(tmp_path / "config.json")
    name = "layers.1.feed_forward.experts.w2"  # [E=4, D=64, F=48]
    full = HFWeights(tmp_path, cfg).full(name, (4, 64, 48))
    reader = HFWeights(tmp_path, cfg)
    block = reader.read(name, (1, 16, 0), (2, 32, 48), torch.float32)  # experts 1-2, rows 16-47
    assert torch.equal(block, full[1:3, 16:48])
    assert reader.bytes_read == 2 * 32 * 48 * 4


_REFUSED = [("mixtral-8x7b", "router_jitter_noise", 0.1), ("qwen3-30b-a3b", "mlp_only_layers", [1]),
            ("qwen3-30b-a3b", "decoder_sparse_step", 2), ("olmoe", "clip_qkv", 8.0),
            ("olmoe", "attention_bias", True), ("olmoe", "head_dim", 64)]


@pytest.mark.parametrize("source, field, value", _REFUSED)
def test_unmodelled_fields_are_refused(tmp_path: Path, source: str, field: str, value: object) -> None:
    config = {**(OLMOE if source == "olmoe" else RELEASED[source]), field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{field}="):
        model_from_hf_config(tmp_path / "config.json")


def test_export_refuses_projection_norms_without_experts() -> None:
    # OLMoE's norms over the whole projections: no dense architecture meshfit writes has them.
    dense = replace(PRESETS["small"], qk_norm=True, qk_norm_scope="projection")
    with pytest.raises(ValueError, match="model.qk_norm_scope='projection'"):
        hf_model_type(dense)
    assert hf_model_type(PRESETS["olmoe-1b-7b"]) == "olmoe"


def test_an_olmoe_folder_trains_through_init_from_and_exports_back(tmp_path: Path) -> None:
    # A step of lr 1e-12 moves an AdamW weight by about 1e-12: the weights that `meshfit export` writes are
    # the ones model.init_from read, so transformers' logits from the export are those of the folder.
    hf = _save("olmoe", tmp_path / "in")
    outcome = launch(load_config(None, [f"model.init_from={tmp_path / 'in'}", "train.steps=1", "train.lr=1e-12",
                                        "train.global_batch=2", "train.seq_len=32"]), tmp_path / "run")
    assert outcome.ok, outcome.message
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "olmoe"
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    toks = tokens()
    with torch.no_grad():
        assert (back(input_ids=toks).logits - hf(input_ids=toks).logits).abs().max().item() < 1e-5
