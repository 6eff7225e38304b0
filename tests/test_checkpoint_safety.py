"""Loading a checkpoint never runs code from it: a crafted `.metadata` (whose SHA-256 in meshfit.json was
rewritten to match) is refused by `--resume`, `--resume-from` and `meshfit export`, naming the file and the
object, exit 2, before any rank starts and with nothing executed."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshfit.train import checkpoint_reader
from meshfit.train import checkpoint_store as store


class _Writes:
    """Unpickled, it writes a file: what a crafted checkpoint would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _craft(folder: Path, sentinel: Path) -> None:
    """Replace the folder's index by a pickle that runs code, and re-sign it in the marker."""
    (folder / ".metadata").write_bytes(pickle.dumps(_Writes(sentinel)))
    marker = json.loads((folder / store.MARKER).read_text())
    marker["files"][".metadata"] = store.digest(folder / ".metadata")
    (folder / store.MARKER).write_text(json.dumps(marker))


def _meshfit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshfit", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    common = ["--set", "model.preset=tiny", "--set", "train.seq_len=32", "--set", "checkpoint.interval=1"]
    trained = _meshfit("train", *common, "--set", "train.steps=2", "--nproc", "2", "--run-dir", str(run),
                       cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    sentinel = tmp_path / "ran"
    newest = store.step_dir(run / "checkpoints", 2)
    _craft(newest, sentinel)
    attempts = {
        "--resume": ["train", *common, "--set", "train.steps=3", "--nproc", "2", "--run-dir", str(run), "--resume"],
        "--resume-from": ["train", *common, "--set", "train.steps=3", "--nproc", "2", "--run-dir", str(run),
                          "--resume-from", str(newest)],
        "export": ["export", str(run), "--out", str(tmp_path / "hf")],
    }
    for name, args in attempts.items():
        result = _meshfit(*args, cwd=tmp_path)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2, (name, result.stderr)
        assert len(lines) == 1 and lines[0].startswith("error:"), (name, result.stderr)
        assert f"{newest / '.metadata'}" in lines[0] and "posix.system" in lines[0], (name, lines[0])
        assert "Traceback" not in result.stderr
        assert not sentinel.exists(), f"{name} ran the checkpoint's code"
    assert not (tmp_path / "hf").exists()
    assert newest.is_dir()  # refused, not set aside as if merely damaged
    assert json.loads((run / "result.json").read_text())["end_step"] == 2  # the run is as it was


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_index_of_a_real_checkpoint_reads_through_the_allow_list(tmp_path: Path) -> None:
    """Every class a checkpoint's index holds is allowed: a one-process save reads back, and loads."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16),
             "meta": {"step": 3, "lrs": [0.1, 0.2], "betas": (0.9, 0.95), "name": "x", "flag": None}}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    metadata = checkpoint_reader.read_metadata(tmp_path)
    assert set(metadata.state_dict_metadata) >= {"w", "b"}
    loaded = {"w": torch.zeros(2, 3), "b": torch.zeros(2, dtype=torch.bfloat16),
              "meta": {"step": 0, "lrs": [0.0, 0.0], "betas": (0.0, 0.0), "name": "", "flag": 1}}
    checkpoint_reader.load(loaded, tmp_path, no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
    assert loaded["meta"] == state["meta"]


def test_a_crafted_entry_is_refused_by_the_weights_only_loader(tmp_path: Path) -> None:
    """Non-tensor entries (schedule, data position) are read by torch's weights-only loader, not DCP's own
    `torch.load(weights_only=False)`."""
    sentinel = tmp_path / "ran"
    blob = io.BytesIO()
    torch.save({"step": _Writes(sentinel)}, blob)
    blob.seek(0)

    class Item:
        class dest_index:
            fqn = "train.data"

    planner = checkpoint_reader.WeightsOnlyLoadPlanner()
    with pytest.raises(checkpoint_reader.UnsafeCheckpoint, match="train.data"):
        planner.load_bytes(Item(), blob)
    assert not sentinel.exists()


def test_a_crafted_index_is_refused_in_process(tmp_path: Path) -> None:
    sentinel = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Writes(sentinel)))
    with pytest.raises(checkpoint_reader.UnsafeCheckpoint, match=r"\.metadata names posix\.system"):
        checkpoint_reader.read_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(store.CheckpointError, match="corrupt"):
        checkpoint_reader.read_metadata(tmp_path)
    assert not sentinel.exists()
