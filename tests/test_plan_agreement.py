"""`plan`, `verify` and `train --plan` accept and refuse the same settings, a plan `--out` writes is one
`train --plan` runs, and a plan file whose parts disagree (an edited one) is refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshfit.commands.main import main
from meshfit.config import ConfigError, load_config
from meshfit.hardware.catalog import Cluster
from meshfit.layout.layout import Workload
from meshfit.models.presets import get_preset
from meshfit.planner.planfile import plan_sections, read_plan
from meshfit.planner.search import search
from meshfit.train.shape import resolve_run

TINY2 = ["--model", "tiny", "--gpus-per-node", "2"]


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


class _Launched(Exception):
    """Raised in place of starting ranks: carries what `meshfit train` would launch."""

    def __init__(self, cfg, nproc):
        super().__init__("launch")
        self.cfg, self.nproc = cfg, nproc


def _launched(monkeypatch: pytest.MonkeyPatch, *argv: str) -> _Launched:
    """Run `meshfit train ARGV` up to the launch (its checks included), without starting a rank."""
    from meshfit.train import launch

    def fake(cfg, run_dir, nproc=None, **_):
        resolve_run(cfg, nproc or 1)  # what launch checks before any rank starts
        raise _Launched(cfg, nproc)

    monkeypatch.setattr(launch, "launch", fake)
    with pytest.raises(_Launched) as caught:
        main(["train", *argv])
    return caught.value


def test_a_sequence_beyond_the_models_positions_is_refused_alike(capsys, monkeypatch, tmp_path):
    plan = _run(capsys, "plan", *TINY2, "--seq-len", "100000")
    verify = _run(capsys, "verify", *TINY2, "--seq-len", "100000", "--layout", "dp_shard=2")
    out = _run(capsys, "plan", *TINY2, "--seq-len", "100000", "--out", str(tmp_path / "p.json"))
    assert plan[0] == verify[0] == out[0] == 2
    line = ("error: --seq-len 100000 exceeds the model's max_seq_len=256 (the positions it has); use --seq-len ≤ 256 "
            "(or --dims max_seq_len=…)\n")
    assert plan[2] == verify[2] == out[2] == line
    assert not (tmp_path / "p.json").exists()
    with pytest.raises(ConfigError) as train:
        resolve_run(load_config(None, ["model.preset=tiny", "train.seq_len=100000"]), 1)
    assert str(train.value) == ("train.seq_len=100000 exceeds the model's max_seq_len=256 (the positions it has); "
                                "use train.seq_len ≤ 256 (or model.max_seq_len=…)")
    # The hint works for all three.
    assert _run(capsys, "plan", *TINY2, "--seq-len", "512", "--dims", "max_seq_len=512", "--json")[0] == 0


@pytest.mark.parametrize("preset, seq", [("tiny", 256), ("gpt3-125m", 2048), ("llama3-1b", 4096)])
def test_the_default_sequence_fits_the_model(capsys, preset, seq):
    code, out, err = _run(capsys, "plan", "--model", preset, "--gpus-per-node", "2", "--json", "--top", "1")
    assert code == 0, err
    assert json.loads(out)["workload"]["seq_len"] == seq


def test_a_plan_out_writes_is_one_train_plan_runs(capsys, monkeypatch, tmp_path):
    plan_file = tmp_path / "plan.json"
    code, _, err = _run(capsys, "plan", *TINY2, "--out", str(plan_file))  # every default
    assert code == 0, err
    launched = _launched(monkeypatch, "--plan", str(plan_file), "--nproc", "2", "--run-dir", str(tmp_path / "r"))
    model, _, workload, layout = read_plan(plan_file)
    assert launched.nproc == layout.world_size == 2
    assert launched.cfg.train.seq_len == workload.seq_len == 256 == model.max_seq_len


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])  # untied and tied embeddings
def test_every_layout_the_search_ranks_is_one_train_runs(preset):
    model = get_preset(preset)
    for world, batch in ((4, 8), (4, 4), (2, 2)):
        workload = Workload(seq_len=64, global_batch=batch)
        for candidate in search(model, workload, Cluster("H100-SXM", 1, world)).candidates:
            cfg = load_config(None, sections=plan_sections(model, workload, candidate.layout))
            resolve_run(cfg, world)  # raises ConfigError for a layout train refuses


@pytest.mark.parametrize("argv, needle", [
    (["--model", "tiny-gpt", "--gpus-per-node", "4", "--layout", "pp=2,dp_shard=2"],
     "--layout pp=2 needs untied embeddings"),
    (["--model", "tiny", "--gpus-per-node", "4", "--layout", "pp=4"], "4 stages, but the model has 2 layers"),
    (["--model", "tiny", "--gpus-per-node", "2", "--global-batch", "2", "--layout", "pp=2,micro_batch=2"],
     "micro-batch 2 (--micro-batch, or micro_batch in --layout) leaves 1 pipeline micro-batch(es) per step"),
])
def test_plan_and_verify_refuse_the_pipelines_train_refuses(capsys, argv, needle):
    for command in ("plan", "verify"):
        code, _, err = _run(capsys, command, *argv, "--seq-len", "64")
        assert code == 2 and needle in err and err.count("\n") == 1, err


def test_out_refuses_a_workload_train_does_not_train(capsys, tmp_path):
    code, _, err = _run(capsys, "plan", *TINY2, "--precision", "bf16", "--out", str(tmp_path / "p.json"))
    assert code == 2 and "--out" in err and "precision='bf16'" in err and "--precision mixed" in err
    assert not (tmp_path / "p.json").exists()
    assert _run(capsys, "plan", *TINY2, "--precision", "bf16", "--json", "--top", "1")[0] == 0  # planned, not trained


def _edit(doc: dict, where: str, value) -> None:
    section, key = where.split(".")
    doc[section][key] = value


@pytest.fixture(scope="module")
def plan_doc(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", *TINY2, "--seq-len", "64", "--global-batch", "8", "--precision", "fp32", "--layout",
                 "dp_shard=2", "--out", str(path)]) == 0
    return json.loads(path.read_text())


@pytest.mark.parametrize("edits, needles", [
    ({"cluster.world_size": 4}, ["cluster.world_size=4 is not cluster.nodes × cluster.gpus_per_node = 1 × 2"]),
    ({"cluster.world_size": 4, "cluster.gpus_per_node": 4}, ["cluster.world_size=4, but the layout spans 2 ranks"]),
    ({"model.name": "small"}, ["model.name='small' is a preset", "model.dim=64 (small: 256)"]),
    ({"model.n_layers": 3}, ["model.name='tiny'", "model.n_layers=3 (tiny: 2)"]),
    ({"model.params": 5}, ["model.params=5", "make 106816 parameters"]),
    ({"layout.dp_shard": 1, "layout.tp": 2}, ["layout.dp_shard=1 (predicted.layout.dp_shard=2)", "layout.tp=2"]),
    ({"workload.seq_len": 100000}, ["workload.seq_len=100000 exceeds the model's max_seq_len=256"]),
    ({"workload.global_batch": 3}, ["workload.global_batch=3 is not a multiple", "valid: 2, 4"]),
])
def test_a_plan_file_whose_parts_disagree_is_refused_naming_the_field(capsys, tmp_path, plan_doc, edits, needles):
    doc = json.loads(json.dumps(plan_doc))
    for where, value in edits.items():
        _edit(doc, where, value)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    code, _, err = _run(capsys, "train", "--plan", str(path), "--nproc", "2", "--run-dir", str(tmp_path / "r"))
    assert code == 2 and err.startswith(f"error: --plan {path}: ") and err.count("\n") == 1, err
    for needle in [*needles, "write the plan again with `meshfit plan … --out`"]:
        assert needle in err, err
    assert not (tmp_path / "r").exists()


def test_an_untouched_plan_file_reads_back(tmp_path, plan_doc):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_doc))
    model, name, workload, layout = read_plan(path)
    assert (name, model, workload.seq_len, layout.dp_shard) == ("tiny", get_preset("tiny"), 64, 2)


def test_a_config_json_in_a_folder_named_like_a_preset_is_not_named_as_the_preset(capsys, tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "intermediate_size": 256, "max_position_embeddings": 128,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}))
    plan_file = tmp_path / "plan.json"
    code, _, err = _run(capsys, "plan", "--model", str(folder / "config.json"), "--gpus-per-node", "2",
                        "--out", str(plan_file))
    assert code == 0, err
    assert read_plan(Path(plan_file))[1] == str(folder / "config.json")


def test_a_plan_file_naming_a_key_twice_is_refused_naming_key_and_lines(capsys, tmp_path, plan_doc):
    # json keeps the last of two equal keys: an edited plan would train on whichever came second.
    text = json.dumps(plan_doc, indent=1).replace('"world_size": 2', '"world_size": 2,\n  "world_size": 4', 1)
    path = tmp_path / "twice.json"
    path.write_text(text)
    code, _, err = _run(capsys, "train", "--plan", str(path), "--nproc", "2", "--run-dir", str(tmp_path / "r"))
    assert code == 2 and err.count("\n") == 1, err
    assert f"{path}: key 'world_size' is given twice in one object (lines " in err, err
    assert not (tmp_path / "r").exists()


def test_a_hardware_profile_or_model_config_naming_a_key_twice_is_refused(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 64,\n "hidden_size": 128}')
    code, _, err = _run(capsys, "plan", "--model", str(path), "--gpus-per-node", "2")
    assert code == 2 and "key 'hidden_size' is given twice in one object (lines 1, 2)" in err, err
