"""Hugging Face models of every family meshfit reads compute what transformers computes: logits, loss and
gradients of tiny random models saved by transformers, on one process and under TP, ZeRO-3 and CP on 2
gloo ranks; exports load back into transformers; config fields meshfit does not model are refused."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from hf_families import SEQ, VOCAB, as_transformers4, family_configs, layouts_job, reference, save_random_model, tokens

from meshfit.commands.main import main
from meshfit.config import ConfigError, load_config
from meshfit.models import ModelConfig, build_model, num_params
from meshfit.models.hf import model_from_hf_config
from meshfit.models.hf_read import load_hf
from meshfit.models.hf_weights import hf_model_type, save_hf
from meshfit.models.loss import lm_loss
from meshfit.parallel.context_parallel import shard_sequence
from meshfit.train.shape import resolve_run
from meshfit.util.ranks import run_ranks

FAMILIES = list(family_configs())


def _folder_model(folder: Path) -> ModelConfig:
    """The model `meshfit train` builds for model.init_from=folder."""
    return load_config(None, [f"model.init_from={folder}", f"train.seq_len={SEQ}"]).model.resolve()


def _meshfit(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = build_model(cfg, "cpu")
    model.load_state_dict(weights)
    return model.eval()


def _logits_and_loss(model: torch.nn.Module, cfg: ModelConfig, toks: torch.Tensor) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        logits = model(toks[:, :-1])
    return logits, lm_loss(logits, toks[:, 1:], cfg.vocab_size).item()


def test_explicit_head_dim_sets_the_attention_width() -> None:
    # As Qwen3 32B (64 heads of 128 on 5120), in small: 4 heads of 48 on a 100-wide residual stream.
    cfg = ModelConfig(family="llama", dim=100, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_hidden=128,
                      max_seq_len=64, tie_embeddings=False, head_dim=48, qk_norm=True, qkv_bias=True)
    model = build_model(cfg, "cpu")
    attention = model.layers["0"].attention
    assert attention.wq.weight.shape == (192, 100) and attention.wk.bias.shape == (96,)
    assert attention.wo.weight.shape == (100, 192) and attention.q_norm.weight.shape == (48,)
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)
    assert model(tokens()[:, :16]).shape == (2, 16, cfg.vocab_size)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_loss_equal_transformers(tmp_path: Path, family: str) -> None:
    hf = save_random_model(family, tmp_path)
    cfg = _folder_model(tmp_path)
    toks = tokens()
    ref = reference(hf, toks)
    logits, loss = _logits_and_loss(_meshfit(cfg, load_hf(tmp_path, cfg)), cfg, toks)
    assert (logits - ref["logits"]).abs().max().item() < 1e-5
    assert loss == pytest.approx(ref["loss"], abs=1e-5)


@pytest.mark.parametrize("family", ["llama3.1", "llama-linear"])
def test_rope_scaling_changes_the_logits_at_this_length(tmp_path: Path, family: str) -> None:
    """The parity above would fail if the scaling were dropped, as meshfit once dropped it."""
    hf = save_random_model(family, tmp_path)
    cfg = _folder_model(tmp_path)
    unscaled = dataclasses.replace(cfg, rope_scaling="none", rope_factor=None, rope_low_freq_factor=None,
                                   rope_high_freq_factor=None, rope_original_max_seq_len=None)
    logits, _ = _logits_and_loss(_meshfit(unscaled, load_hf(tmp_path, unscaled)), unscaled, tokens())
    assert (logits - reference(hf, tokens())["logits"]).abs().max().item() > 0.1


@pytest.mark.parametrize("family", ["llama2", "llama3.1", "llama-linear", "qwen2", "qwen3"])
def test_both_rope_spellings_give_one_model(tmp_path: Path, family: str) -> None:
    save_random_model(family, tmp_path)
    five = model_from_hf_config(tmp_path / "config.json")  # transformers 5 writes rope_parameters
    as_transformers4(tmp_path)
    assert "rope_parameters" not in json.loads((tmp_path / "config.json").read_text())
    assert model_from_hf_config(tmp_path / "config.json") == five


@pytest.mark.parametrize("family, kind", [("llama3.1", "llama"), ("llama3.2", "llama"), ("mistral", "mistral"),
                                          ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("gpt2", "gpt2")])
def test_export_writes_the_family_and_loads_in_transformers(tmp_path: Path, family: str, kind: str) -> None:
    save_random_model(family, tmp_path / "in")
    cfg = _folder_model(tmp_path / "in")
    weights = load_hf(tmp_path / "in", cfg)
    # What a checkpoint's meshfit.json keeps of the model (its model_config) gives the same model back.
    assert ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    save_hf(weights, cfg, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == kind == hf_model_type(cfg)
    assert model_from_hf_config(tmp_path / "out" / "config.json") == cfg
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    logits, _ = _logits_and_loss(_meshfit(cfg, weights), cfg, tokens())
    assert (logits - reference(hf, tokens())["logits"]).abs().max().item() < 1e-5


def test_training_from_a_qwen3_folder_exports_a_qwen3(tmp_path: Path) -> None:
    """The model of the folder trains (one process), its checkpoint keeps every modelled field, and the
    export is a Qwen3 that transformers runs to meshfit's logits."""
    from meshfit.runs.export import find_checkpoint, read_model
    from meshfit.train.launch import launch

    save_random_model("qwen3", tmp_path / "qwen3")
    cfg = load_config(None, [f"model.init_from={tmp_path / 'qwen3'}", "train.steps=1", f"train.seq_len={SEQ}",
                             "train.global_batch=2", "train.device=cpu"])
    from meshfit.train.launch import banner

    assert f"meshfit train: model qwen3 of {tmp_path / 'qwen3'}, " in banner(cfg, resolve_run(cfg, 1), tmp_path, 1, None)
    assert launch(cfg, tmp_path / "run").ok
    weights, model, _ = read_model(find_checkpoint(tmp_path / "run"))
    assert model == cfg.model.resolve() and model.qk_norm and model.head_dim == 24
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    logits, _ = _logits_and_loss(_meshfit(model, weights), model, tokens())
    assert (logits - reference(hf, tokens())["logits"]).abs().max().item() < 1e-5


# (family, change to config.json, what the one error line says)
REFUSED = [
    ("llama3.1", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type='yarn' is not modelled by meshfit: modelled RoPE types: default, linear, llama3"),
    ("llama2", {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type='dynamic' is not modelled"),
    ("llama3.1", {"rope_parameters": {**family_configs()["llama3.1"].rope_parameters, "attention_factor": 2.0}},
     "rope_parameters.attention_factor=2.0 is not modelled"),
    ("llama2", {"hidden_act": "gelu"}, "hidden_act='gelu' is not modelled by meshfit: meshfit's block computes "
     "'silu', 'swish'"),
    ("llama2", {"attention_bias": True}, "attention_bias=True is not modelled"),
    ("llama2", {"mlp_bias": True}, "mlp_bias=True is not modelled"),
    ("qwen3", {"attention_bias": True}, "attention_bias=True is not modelled"),
    ("qwen2", {"attention_dropout": 0.1}, "attention_dropout=0.1 is not modelled"),
    ("gpt2", {"activation_function": "relu"}, "activation_function='relu' is not modelled"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True is not modelled"),
    ("gpt2", {"attn_pdrop": 0.1}, "attn_pdrop=0.1 is not modelled by meshfit: meshfit's GPT block drops out with "
     "one probability everywhere"),
    ("qwen2", {"model_type": "gemma"}, "model_type 'gemma' is not supported; supported: llama, mistral, qwen2, "
     "qwen3, mixtral, qwen3_moe, olmoe, gpt2"),
]


@pytest.mark.parametrize("family, change, message", REFUSED)
def test_unmodelled_fields_are_refused(tmp_path: Path, family: str, change: dict, message: str) -> None:
    save_random_model(family, tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match="^" + re.escape(str(path))) as exc:
        model_from_hf_config(path)
    assert message in str(exc.value)


def test_a_window_shorter_than_the_sequence_is_refused(tmp_path: Path) -> None:
    save_random_model("mistral", tmp_path / "mistral")  # window SEQ
    save_random_model("qwen2", tmp_path / "qwen2")
    path = tmp_path / "qwen2" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "layer_types": ["sliding_attention"] * 2,
                                "use_sliding_window": True, "sliding_window": 64}))
    # As long as the window: the whole sequence is the window.
    assert resolve_run(load_config(None, [f"model.init_from={tmp_path / 'mistral'}", f"train.seq_len={SEQ}"]), 1)
    for folder, window in (("mistral", SEQ), ("qwen2", 64)):
        cfg = load_config(None, [f"model.init_from={tmp_path / folder}", f"train.seq_len={2 * SEQ}"])
        with pytest.raises(ConfigError, match=f"train.seq_len={2 * SEQ} exceeds the model's sliding_window="
                                              f"{window}: meshfit attends to the whole sequence"):
            resolve_run(cfg, 1)


def test_bad_init_from_folders_are_one_error_line_before_any_rank(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    save_random_model("qwen3", tmp_path / "qwen3")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "model.safetensors").write_bytes((tmp_path / "qwen3" / "model.safetensors").read_bytes())
    save_random_model("llama3.1", tmp_path / "yarn")
    cfg_path = tmp_path / "yarn" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "rope_parameters": None, "rope_theta": 1e4,
                                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    save_random_model("qwen2", tmp_path / "gemma")
    cfg_path = tmp_path / "gemma" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "model_type": "gemma"}))
    cases = [("bare", [], "model.init_from=" + str(tmp_path / "bare") + ": the folder has no config.json"),
             ("yarn", [], "rope_scaling.rope_type='yarn' is not modelled by meshfit"),
             ("gemma", [], "model_type 'gemma' is not supported"),
             ("qwen3", ["model.preset=tiny"], "model.preset=tiny disagrees with"),
             ("qwen3", ["model.head_dim=16"], "model.head_dim=16 disagrees with"),
             ("qwen3", ["train.seq_len=512"], "train.seq_len=512 exceeds the model's max_seq_len=256")]
    capsys.readouterr()
    for folder, sets, message in cases:
        args = [x for item in [*sets, f"model.init_from={tmp_path / folder}"] for x in ("--set", item)]
        code = main(["train", *args, "--nproc", "2", "--run-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], (folder, err)
        assert not (tmp_path / "run").exists()


def test_plan_reads_the_model_train_builds(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from meshfit.commands.plan_flags import resolve_model

    save_random_model("qwen3", tmp_path)
    assert resolve_model(str(tmp_path / "config.json"), "")[1] == _folder_model(tmp_path)
    assert main(["plan", "--model", "qwen3-32b", "--gpus-per-node", "8", "--seq-len", "4096"]) == 0
    capsys.readouterr()
    assert main(["plan", "--model", "mistral-7b", "--gpus-per-node", "8", "--seq-len", "8192"]) == 2
    assert "--seq-len 8192 exceeds the model's sliding_window=4096" in capsys.readouterr().err
    # --dims applies a scaling as the config's model section does: a new one starts without the old parameters.
    assert resolve_model("llama3.1-8b", "rope_scaling=none")[1].rope_factor is None


# Layouts on 2 gloo ranks; the model always comes from the folder (model.init_from).
LAYOUTS = {"tp2": ["parallel.tp=2"], "tp2-sp": ["parallel.tp=2", "parallel.sp=true"],
           "tp2-op-recompute": ["parallel.tp=2", "parallel.activation_checkpointing=op"],
           "zero3": ["parallel.dp_shard=2", "parallel.zero_stage=3"],
           "zero3-full-recompute": ["parallel.dp_shard=2", "parallel.zero_stage=3",
                                    "parallel.activation_checkpointing=full"],
           "cp2": ["parallel.cp=2"]}
CASES = [*((family, "tp2") for family in FAMILIES), ("llama3.1", "zero3"), ("qwen3", "zero3"), ("gpt2", "zero3"),
         ("qwen2", "zero3-full-recompute"), ("qwen3", "tp2-sp"), ("qwen3", "tp2-op-recompute"), ("llama3.1", "cp2"),
         ("qwen3", "cp2")]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_parallel_layouts_equal_transformers(tmp_path: Path) -> None:
    """Every family under TP 2, and the variants under ZeRO-3, SP, recompute and CP: meshfit's logits, loss and
    gradients (gathered to full tensors, in Hugging Face names) equal transformers' within 1e-5."""
    toks = tokens()
    refs = {family: reference(save_random_model(family, tmp_path / family), toks)
            for family in {family for family, _ in CASES}}
    cases = [(f"{family}/{layout}", load_config(None, [f"model.init_from={tmp_path / family}", f"train.seq_len={SEQ}",
                                                       "train.global_batch=2", "train.device=cpu",
                                                       *LAYOUTS[layout]]).model_dump())
             for family, layout in CASES]
    results = run_ranks(layouts_job, 2, cases, toks, timeout_s=240)[0]
    assert len(results) == len(CASES)
    for name, got in results.items():
        family, layout = name.split("/")
        ref = refs[family]
        want = shard_sequence(ref["logits"], 2, 0) if layout == "cp2" else ref["logits"]  # rank 0's chunks
        assert (torch.from_numpy(got["logits"]) - want).abs().max().item() < 1e-5, name
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5), name
        assert got["grads"].keys() == ref["grads"].keys(), name
        for key, grad in ref["grads"].items():
            torch.testing.assert_close(torch.from_numpy(got["grads"][key]), grad, atol=1e-5, rtol=1e-4,
                                       msg=f"{name} {key}")
