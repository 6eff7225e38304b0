"""`meshfit export` to Hugging Face safetensors, checked against transformers; training from such weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from dist_jobs import PARITY_BASE

from meshfit.commands.main import main
from meshfit.config import load_config
from meshfit.models import build_model
from meshfit.models.hf import model_from_hf_config
from meshfit.models.hf_read import HFWeights
from meshfit.models.init import init_weights
from meshfit.runs.export import find_checkpoint, read_model
from meshfit.train.launch import launch


def _trained(run_dir: Path, *overrides: str, nproc: int | None = None) -> Path:
    outcome = launch(load_config(None, [*PARITY_BASE, "train.steps=2", *overrides]), run_dir, nproc)
    assert outcome.ok, outcome.message
    return run_dir


def _meshfit_logits(weights: dict[str, torch.Tensor], model_cfg, tokens: torch.Tensor) -> torch.Tensor:
    model = build_model(model_cfg, "cpu")
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("preset, shard", [("tiny", "5GB"), ("tiny-gpt", "100KB")])
def test_export_matches_transformers_and_round_trips(tmp_path: Path, preset: str, shard: str) -> None:
    run_dir = _trained(tmp_path / "run", f"model.preset={preset}")
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf"), "--max-shard-size", shard]) == 0
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    if shard == "5GB":
        assert shards == ["model.safetensors"] and not (tmp_path / "hf" / "model.safetensors.index.json").exists()
    else:  # transformers' names and index; no shard above the size unless it holds a single larger tensor
        count = len(shards)
        assert count > 2 and shards == [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
        index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(shards)
        data = {s: (tmp_path / "hf" / s).stat().st_size - 8 - int.from_bytes(
            (tmp_path / "hf" / s).read_bytes()[:8], "little") for s in shards}  # less the safetensors header
        assert index["metadata"]["total_size"] == sum(data.values())
        held = {s: list(index["weight_map"].values()).count(s) for s in shards}
        assert all(size <= 100_000 or held[s] == 1 for s, size in data.items()), (data, held)
    weights, model_cfg, marker = read_model(find_checkpoint(run_dir))
    assert marker["step"] == 2
    assert model_from_hf_config(tmp_path / "hf" / "config.json") == model_cfg
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, _meshfit_logits(weights, model_cfg, tokens), atol=1e-5, rtol=1e-5)
    back = build_model(model_cfg, "cpu")
    init_weights(back, 0, model_cfg, HFWeights(tmp_path / "hf", model_cfg))  # init_from's reader
    state = back.state_dict()
    assert all(torch.equal(state[k], weights[k]) for k in weights)


@pytest.mark.multiproc
def test_training_starts_from_exported_weights_under_any_layout(tmp_path: Path) -> None:
    """A TP run saves, is exported, and a 2-rank FSDP run and a one-process run start from those weights:
    both begin at the same loss, which is the exported model's loss on the first batch."""
    _trained(tmp_path / "source", "parallel.tp=2", nproc=2)
    assert main(["export", str(tmp_path / "source"), "--out", str(tmp_path / "hf")]) == 0
    start = [*PARITY_BASE, "train.steps=1", f"model.init_from={tmp_path / 'hf'}", "checkpoint.at_end=false"]
    fsdp = launch(load_config(None, [*start, "parallel.dp_shard=2"]), tmp_path / "fsdp", 2)
    single = launch(load_config(None, start), tmp_path / "single")
    fresh = launch(load_config(None, [*PARITY_BASE, "train.steps=1"]), tmp_path / "fresh")
    assert fsdp.ok and single.ok and fresh.ok, fsdp.message or single.message
    assert fsdp.result["losses"][0] == pytest.approx(single.result["losses"][0], abs=1e-5)
    assert abs(single.result["losses"][0] - fresh.result["losses"][0]) > 1e-3  # not the random start


def test_bad_export_and_init_inputs_are_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A broken model.init_from is refused before any rank starts (exit 2, one line, no run directory):
    not safetensors, truncated, another model's names or shapes."""
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "hf")]) == 2
    assert "nothing does not exist: give a step-N checkpoint folder" in capsys.readouterr().err
    run_dir = _trained(tmp_path / "small")
    main(["export", str(run_dir), "--out", str(tmp_path / "hf")])
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    whole = (tmp_path / "hf" / "model.safetensors").read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "model.safetensors").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "cut" / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    one_file = "hf/model.safetensors"  # one weights file: the model section gives the shape
    main(["export", str(run_dir), "--out", str(tmp_path / "shards"), "--max-shard-size", "100KB"])
    (tmp_path / "shards" / "model-00002-of-00005.safetensors").unlink()
    (tmp_path / "ints").mkdir()
    save_file({k: v.long() for k, v in load_file(tmp_path / "hf" / "model.safetensors").items()},
              tmp_path / "ints" / "model.safetensors")
    (tmp_path / "ints" / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    cases = [
        ("shards", [], "names shard model-00002-of-00005.safetensors, which is not in"),
        ("ints", [], "stores lm_head.weight as I64; the model's weights are floating point"),
        ("bad.safetensors", [], "bad.safetensors cannot be read as safetensors"),
        ("cut", [], "cut/model.safetensors cannot be read as safetensors"),
        (one_file, ["model.dim=128"], "has shape (256, 64) there, the model needs (256, 128)"),
        (one_file, ["model.n_layers=3"], "the weights have no tensor for 'layers.2."),
        ("hf", ["model.dim=128"], "model.dim=128 disagrees with"),  # a folder: its config.json is the model
    ]
    capsys.readouterr()
    for folder, overrides, message in cases:
        sets = [x for item in [*overrides, f"model.init_from={tmp_path / folder}"] for x in ("--set", item)]
        code = main(["train", *sets, "--nproc", "2", "--run-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], (folder, err)
        assert not (tmp_path / "run").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden_size"] == 64


def test_the_start_line_names_offload_compile_and_starting_weights(tmp_path: Path) -> None:
    from meshfit.train.launch import banner
    from meshfit.train.shape import resolve_run

    main(["export", str(_trained(tmp_path / "small")), "--out", str(tmp_path / "hf")])
    plain = load_config(None, PARITY_BASE)
    line = banner(plain, resolve_run(plain, 2), tmp_path, 2, None)
    assert not [word for word in ("offloaded", "compiled", "weights from") if word in line], line
    cfg = load_config(None, [*PARITY_BASE, "parallel.dp_shard=2", "parallel.offload=true", "train.compile=true",
                             f"model.init_from={tmp_path / 'hf'}"])
    line = banner(cfg, resolve_run(cfg, 2), tmp_path, 2, None)
    assert f", offloaded to host memory, compiled blocks, weights from {tmp_path / 'hf'}; steps up to" in line, line
