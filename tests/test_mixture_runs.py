"""data.sources in a run: bad input refused before any rank starts, naming the field; a resume on a
changed mixture refused naming what changed (unless --new-data); a resume under another data-parallel
size continuing the same stream."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshfit.commands.main import main
from meshfit.config import load_config
from meshfit.data import write_token_file
from meshfit.data.fingerprint import data_identity, identity_differences
from meshfit.train.launch import launch

BASE = ["model.preset=tiny", "data.source=tokens", "train.seq_len=32", "train.global_batch=4", "train.seed=3"]


def _sources(tmp_path: Path, weights=(1, 2, 4), sizes=(2000, 3000, 900), val: float = 0.0) -> str:
    """data.sources over token files whose ids are disjoint ([60 s, 60 s + 60))."""
    entries = []
    for s, (w, n) in enumerate(zip(weights, sizes, strict=True)):
        path = tmp_path / f"s{s}.npy"
        if not path.exists():
            write_token_file(path, 60 * s + np.arange(n) % 60, "uint16")
        entries.append(f"{{path: {path}, weight: {w}" + (f", val_fraction: {val}}}" if val else "}"))
    return f"data.sources=[{', '.join(entries)}]"


def _sets(*items: str) -> list[str]:
    return [x for item in items for x in ("--set", item)]


@pytest.mark.parametrize("items,error", [
    (['data.sources=[{path: S0, weight: 0}]'], "data.sources[0].weight: must be > 0 (got 0)"),
    (['data.sources=[{path: S0, weight: 1}, {path: S1, weight: -2}]'], "data.sources[1].weight: must be > 0"),
    (['data.sources=[{path: S0, weight: .inf}]'], "data.sources[0].weight: must be a finite number"),
    (['data.sources=[{path: S0, weight: .nan}]'], "data.sources[0].weight: must be a finite number"),
    (['data.sources=[{path: S0}]'], "data.sources[0].weight: is required"),
    (['data.sources=[]'], "data.sources: lists no source; give at least one {path, weight}"),
    (['data.sources=[{path: S0, weight: 1}]', 'data.path=S0'], "error: data.path and data.sources are both set"),
    (['data.sources=[{path: S0, weight: 1}, {path: NOWHERE, weight: 1}]'],
     "error: data.sources[1].path='NOWHERE' does not exist; give a .npy or .bin token file"),
    (['data.sources=[{path: S0, weight: 1}]', 'data.source=synthetic'],
     "error: data.sources needs data.source=tokens or text"),
    (['data.sources=[{path: S0, weight: 1}]', 'data.val_fraction=0.1'],
     "error: data.val_fraction holds out a share of data.path; with data.sources give each source its own"),
    (['data.sources=[{path: S0, weight: 1}, {path: S1, weight: 5000}]'],
     ("error: data.sources[0].weight=1 gives that source 0 of every data.mix_block=1000 sequences; raise "
      "data.mix_block to ≥ 5001")),
    (['data.sources=[{path: S0, weight: 1}]', 'train.eval_every=2'],
     "error: train.eval_every=2 needs held-out data: set data.val_path, or a val_fraction on the sources"),
    (['data.sources=[{path: S0, weight: 1, val_fraction: 0.99}]'],
     "error: data.sources[0].val_fraction=0.99 leaves 20 of its 2000 tokens for training"),
])
def test_bad_mixtures_are_one_error_naming_the_field(tmp_path, capsys, items, error):
    _sources(tmp_path)
    items = [item.replace("S0", str(tmp_path / "s0.npy")).replace("S1", str(tmp_path / "s1.npy"))
             for item in items]
    assert main(["train", *_sets(*BASE, *items), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("error:") == 1 and "Traceback" not in err
    assert error.replace("S0", str(tmp_path / "s0.npy")) in err, err
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_a_changed_weight_or_source_is_named_by_the_data_identity(tmp_path):
    before = data_identity(load_config(None, [*BASE, _sources(tmp_path)]).data, seed=3)
    assert before["sources"] == 3 and before["sources[1].weight"] == 2 and before["sources[2].bytes"] > 0
    assert identity_differences(before, before) == []
    heavier = data_identity(load_config(None, [*BASE, _sources(tmp_path, weights=(1, 3, 4))]).data, seed=3)
    assert identity_differences(before, heavier) == ["data sources[1].weight: saved 2.0, now 3.0"]
    reseeded = data_identity(load_config(None, [*BASE, _sources(tmp_path)]).data, seed=4)
    assert identity_differences(before, reseeded) == ["data seed: saved 3, now 4"]
    (tmp_path / "s2.npy").rename(tmp_path / "s3.npy")
    write_token_file(tmp_path / "s2.npy", 120 + np.arange(901) % 60, "uint16")  # one token more
    grown = data_identity(load_config(None, [*BASE, _sources(tmp_path)]).data, seed=3)
    lines = identity_differences(before, grown)
    assert [line.split(":")[0] for line in lines] == ["data sources[2].bytes",
                                                      "data sources[2].contents (fingerprint)"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_resume_with_a_changed_weight_is_refused_unless_new_data(tmp_path, capsys):
    run = ["--run-dir", str(tmp_path / "run")]
    assert main(["train", *_sets(*BASE, _sources(tmp_path), "train.steps=2"), *run]) == 0
    capsys.readouterr()
    changed = _sets(*BASE, _sources(tmp_path, weights=(1, 2, 8)), "train.steps=3")
    assert main(["train", *changed, *run, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "error: cannot resume from" in err and "data sources[2].weight: saved 4.0, now 8.0" in err
    assert main(["train", *changed, *run, "--resume", "--new-data"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 3 and records[-1]["new_data"] == ["data sources[2].weight: saved 4.0, now 8.0"]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_mixture_resumed_under_another_dp_size_trains_on_the_same_stream(tmp_path):
    """One process for 4 steps, against one process for 2 steps resumed on 2 ranks (dp 2) for 2 more:
    the same training and validation losses (held-out shares of each source, evaluated every 2 steps)."""
    base = [*BASE, _sources(tmp_path, val=0.2), "data.shuffle=true", "train.steps=4", "train.eval_every=2",
            "train.eval_batches=2"]
    reference = launch(load_config(None, base), tmp_path / "reference")
    assert reference.ok, reference.message
    first = launch(load_config(None, [*base, "train.stop_after=2"]), tmp_path / "run")
    assert first.ok, first.message
    second = launch(load_config(None, [*base, "checkpoint.resume=true"]), tmp_path / "run", 2)
    assert second.ok, second.message
    assert second.result["start_step"] == 2 and second.result["layout"] != first.result["layout"]
    losses = first.result["losses"] + second.result["losses"]
    assert losses == pytest.approx(reference.result["losses"], abs=1e-5, rel=0)
    val = [v["val_loss"] for v in first.result["val_losses"] + second.result["val_losses"]]
    assert val == pytest.approx([v["val_loss"] for v in reference.result["val_losses"]], abs=1e-5, rel=0)
    assert len(val) == 2
