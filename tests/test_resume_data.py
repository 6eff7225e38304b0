"""A resume continues on the data its checkpoint was saved on: another path or changed contents are refused
before any rank starts, naming what differs, unless --new-data, which the metrics record."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from meshfit.commands.main import main
from meshfit.config import load_config
from meshfit.data import fingerprint
from meshfit.train import checkpoint_store as store

SETTINGS = ["data.source=text", "train.seq_len=32", "train.steps=2", "checkpoint.interval=1"]


def _text(path: Path, seed: int, size: int = 20_000) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(rng.choice("abcdefgh \n") for _ in range(size)))
    return path


def _train(run_dir: Path, data: Path, *flags: str, steps: int = 2) -> int:
    sets = [x for item in [*SETTINGS, f"data.path={data}", f"train.steps={steps}"] for x in ("--set", item)]
    return main(["train", *sets, "--run-dir", str(run_dir), *flags])


def test_the_fingerprint_sees_every_byte_or_says_it_samples(tmp_path, monkeypatch):
    data = load_config(None, ["data.source=text", f"data.path={_text(tmp_path / 'a.txt', 0)}"]).data
    before = fingerprint.data_identity(data)
    assert before["fingerprint"].startswith("sha256:") and before["bytes"] == 20_000 and before["files"] == 1
    text = (tmp_path / "a.txt").read_bytes()
    (tmp_path / "a.txt").write_bytes(text[:9_999] + (b"x" if text[9_999:10_000] != b"x" else b"y") + text[10_000:])
    after = fingerprint.data_identity(data)
    assert fingerprint.identity_differences(before, after) == [
        f"data contents (fingerprint): saved {before['fingerprint'][:19]}…, now {after['fingerprint'][:19]}…"]
    monkeypatch.setattr(fingerprint, "FULL_HASH_BYTES", 1000)  # a corpus too large to hash whole at each start
    monkeypatch.setattr(fingerprint, "SAMPLE_BYTES", 100)
    sampled = fingerprint.data_identity(data)
    assert sampled["fingerprint"].startswith("sha256-sampled:")
    (tmp_path / "a.txt").write_bytes(text + b"more")
    assert fingerprint.data_identity(data)["fingerprint"] != sampled["fingerprint"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_resume_on_other_data_is_refused_unless_asked(tmp_path, capsys):
    run_dir, first, other = tmp_path / "run", _text(tmp_path / "a.txt", 0), _text(tmp_path / "b.txt", 1)
    assert _train(run_dir, first) == 0
    marker = json.loads((store.step_dir(run_dir / "checkpoints", 2) / store.MARKER).read_text())
    assert marker["data"]["path"] == str(first.resolve()) and marker["data"]["bytes"] == 20_000
    capsys.readouterr()

    assert _train(run_dir, other, "--resume", steps=3) == 2
    err = capsys.readouterr().err
    assert "error: cannot resume from" in err and "on this data: it was saved on other data" in err
    assert f"data path: saved '{first.resolve()}', now '{other.resolve()}'" in err and "--new-data" in err

    first.write_text(first.read_text()[::-1])  # same path, same size, other contents
    assert _train(run_dir, first, "--resume", steps=3) == 2
    assert "data contents (fingerprint): saved sha256:" in capsys.readouterr().err
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2  # nothing of the run was touched

    assert _train(run_dir, other, "--resume", "--new-data", steps=3) == 0
    assert "warning: --new-data: continuing on other data" in capsys.readouterr().err
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "new_data" not in records[1]
    assert records[2]["step"] == 3 and any("data path: saved" in line for line in records[2]["new_data"])
    assert main(["train", "--new-data", "--run-dir", str(tmp_path / "x")]) == 2
    assert "--new-data continues a run on other data: give it with --resume" in capsys.readouterr().err
