"""`meshfit eval`: the loss of a checkpoint, a run's latest checkpoint or an exported Hugging Face folder on a
token file equals the validation loss training logged on the same windows, in one process and under 2-rank
layouts; it writes nothing and leaves the run directory and its lock alone. Refused inputs are in
test_bad_inputs.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from meshfit.commands.main import main
from meshfit.data import MarkovSource, write_token_file
from meshfit.util import run_lock
from meshfit.util.ranks import snapshot

SEQ, WINDOWS = 32, 8  # training evaluates 2 batches of 4 sequences of 32 + 1 tokens: the file's first 8 windows
TRAIN = ["--set", "model.preset=tiny", "--set", "model.n_layers=4", "--set", f"train.seq_len={SEQ}",
         "--set", "train.steps=4", "--set", "train.global_batch=4", "--set", "train.eval_every=2",
         "--set", "train.eval_batches=2", "--set", "checkpoint.interval=2", "--set", "train.seed=3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 4-step run on token files, evaluated and saved after steps 2 and 4; its logged validation losses."""
    root = tmp_path_factory.mktemp("eval")
    chain = MarkovSource(256, seed=5)  # text of one language: the model learns something in 4 steps
    data = write_token_file(root / "train.npy", chain.sequences(range(64), SEQ + 1).flatten().numpy(), "uint16")
    val = write_token_file(root / "val.npy", chain.sequences(range(900, 910), SEQ + 1).flatten().numpy(), "uint16")
    run = root / "run"
    assert main(["train", *TRAIN, "--set", "data.source=tokens", "--set", f"data.path={data}",
                 "--set", f"data.val_path={val}", "--run-dir", str(run)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(logged) == [2, 4]
    return {"root": root, "run": run, "val": val, "logged": logged}


def _eval(model: Path, val: Path, capsys: pytest.CaptureFixture, *extra: str) -> dict:
    capsys.readouterr()
    code = main(["eval", str(model), "--data", str(val), "--seq-len", str(SEQ), "--windows", str(WINDOWS),
                 "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_checkpoint_and_run_equal_the_logged_validation_loss(trained: dict, capsys) -> None:
    run, val, logged = trained["run"], trained["val"], trained["logged"]
    latest = _eval(run, val, capsys)  # a run directory: its latest intact checkpoint (step 4)
    earlier = _eval(run / "checkpoints" / "step-00000002", val, capsys)
    print(f"eval vs logged val_loss: step 4 {latest['loss']!r} vs {logged[4]!r}, "
          f"step 2 {earlier['loss']!r} vs {logged[2]!r}")
    assert latest["step"] == 4 and earlier["step"] == 2 and logged[2] != logged[4]
    # One batch of 8 windows here, two of 4 in training: fp32 sums in another grouping.
    assert abs(latest["loss"] - logged[4]) <= 1e-6 and abs(earlier["loss"] - logged[2]) <= 1e-6
    assert latest["tokens"] == WINDOWS * SEQ and latest["windows"] == WINDOWS and latest["model_kind"] == "checkpoint"
    assert math.isclose(latest["perplexity"], math.exp(latest["loss"]))
    # Read in training's own batches, the windows give training's figure to the last bit.
    for step, folder in ((4, run), (2, run / "checkpoints" / "step-00000002")):
        assert _eval(folder, val, capsys, "--set", "train.global_batch=4")["loss"] == logged[step]


def test_windows_are_the_files_first_in_order(trained: dict, capsys, tmp_path: Path) -> None:
    """Tokens after the first K windows do not count; the windows before them do."""
    tokens = np.load(trained["val"])
    need = WINDOWS * SEQ + 1
    longer = write_token_file(tmp_path / "longer.npy", np.concatenate([tokens[:need], tokens[::-1]]), "uint16")
    shifted = write_token_file(tmp_path / "shifted.npy", tokens[SEQ:], "uint16")
    base = _eval(trained["run"], trained["val"], capsys)["loss"]
    assert _eval(trained["run"], longer, capsys)["loss"] == base
    assert _eval(trained["run"], shifted, capsys)["loss"] != base


def test_exported_folder_equals_its_checkpoint(trained: dict, capsys) -> None:
    hf = trained["root"] / "hf"
    assert main(["export", str(trained["run"]), "--out", str(hf)]) == 0
    exported = _eval(hf, trained["val"], capsys)
    checkpoint = _eval(trained["run"], trained["val"], capsys)
    print(f"eval of the export {exported['loss']!r}, of its checkpoint {checkpoint['loss']!r}")
    assert exported["model_kind"] == "huggingface" and exported["loss"] == checkpoint["loss"]


def test_writes_nothing_but_out_and_leaves_a_held_run_alone(trained: dict, capsys, tmp_path: Path) -> None:
    run = trained["run"]
    out = tmp_path / "eval.json"
    with run_lock.hold(run):  # a run in progress holds its directory: an evaluation reads it all the same
        before = snapshot(run)
        capsys.readouterr()
        assert main(["eval", str(run), "--data", str(trained["val"]), "--seq-len", str(SEQ), "--windows",
                     str(WINDOWS), "--out", str(out)]) == 0
        assert snapshot(run) == before
    line = capsys.readouterr().out.strip()
    report = json.loads(out.read_text())
    assert line == (f"loss {report['loss']:.4f}  perplexity {report['perplexity']:.4g}  over {WINDOWS} windows × "
                    f"{SEQ} tokens ({WINDOWS * SEQ:,} tokens)")
    assert list(tmp_path.iterdir()) == [out]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_two_rank_layouts_equal_the_logged_validation_loss(trained: dict, capsys) -> None:
    """The checkpoint, saved by one process, resharded into TP 2 (+ SP, loss parallel), ZeRO-3 and a
    2-stage pipeline (which evaluates without ever having taken a step)."""
    layouts = {"tp": "tp=2,sp=true,loss_parallel=true", "zero3": "dp_shard=2,zero_stage=3", "pp": "pp=2"}
    deltas = {}
    for name, layout in layouts.items():
        result = _eval(trained["run"], trained["val"], capsys, "--nproc", "2", "--layout", layout)
        assert result["world_size"] == 2 and result["step"] == 4, name
        deltas[name] = abs(result["loss"] - trained["logged"][4])
    print("|eval - logged val_loss| at step 4:", {k: f"{v:.1e}" for k, v in deltas.items()})
    assert max(deltas.values()) <= 1e-5, deltas
