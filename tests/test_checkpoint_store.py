"""Checkpoint folders, completeness markers and damage checks; fault specs; checkpoint config (one process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshfit.config import ConfigError, load_config
from meshfit.train import checkpoint_store as store
from meshfit.train.checkpoint_store import CheckpointError
from meshfit.train.faults import Fault, Faults, FaultSpecError, parse_faults


def _checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    folder = store.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * (step + 1))
    (folder / ".metadata").write_bytes(b"meta" * step)
    if complete:
        store.write_marker(folder, {"step": step}, store.digest_files(folder, ["__0_0.distcp", ".metadata"]))
    return folder


def test_only_folders_with_a_marker_count_newest_first(tmp_path: Path) -> None:
    for step in (2, 4):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 6, complete=False)  # an interrupted save
    assert [p.name for p in store.complete_checkpoints(tmp_path)] == ["step-00000004", "step-00000002"]
    folder, marker = store.choose(tmp_path)
    assert folder.name == "step-00000004" and marker["step"] == 4


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_file_is_named_and_the_previous_checkpoint_is_used(tmp_path: Path, damage: str) -> None:
    _checkpoint(tmp_path, 2)
    latest = _checkpoint(tmp_path, 4)
    data = latest / "__0_0.distcp"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:100])
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[7] ^= 0xFF
        data.write_bytes(bytes(raw))
    else:
        data.unlink()
    with pytest.raises(CheckpointError, match=str(data)):
        store.verify(latest)
    with pytest.warns(UserWarning, match="__0_0.distcp"):
        folder, _ = store.choose(tmp_path)
    assert folder.name == "step-00000002"
    with pytest.raises(CheckpointError, match="__0_0.distcp"):  # pinned: no fallback
        store.choose(tmp_path, pinned=latest)


def test_a_corrupt_marker_is_named_and_no_intact_checkpoint_is_an_error(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, 3)
    (folder / store.MARKER).write_text('{"step": 3, "fi')
    with pytest.raises(CheckpointError, match=f"no intact checkpoint.*\n.*{folder / store.MARKER}.*corrupt"):
        store.choose(tmp_path)
    assert store.choose(tmp_path / "empty") == (None, None)


def test_damaged_checkpoints_a_resume_skips_move_aside_and_nothing_is_written_over(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2)
    for step in (4, 6):
        (_checkpoint(tmp_path, step) / "__0_0.distcp").write_bytes(b"flipped")
    earlier = tmp_path / store.DAMAGED / "step-00000006"  # set aside by an earlier resume
    earlier.mkdir(parents=True)
    (earlier / "kept").write_text("earlier")
    folder, marker, damaged = store.pick(tmp_path)
    assert folder.name == "step-00000002" and marker["step"] == 2
    assert [(f.name, "is truncated or damaged" in why) for f, why in damaged] == [("step-00000006", True),
                                                                               ("step-00000004", True)]
    lines = store.set_aside_damaged(tmp_path, damaged, folder)
    shelf = tmp_path / store.DAMAGED
    assert sorted(p.name for p in shelf.iterdir()) == ["step-00000004", "step-00000006", "step-00000006.1"]
    assert (earlier / "kept").read_text() == "earlier"
    assert (shelf / "step-00000006.1" / "__0_0.distcp").read_bytes() == b"flipped"
    assert lines[0].startswith("warning: skipped the damaged checkpoint step-00000006 (checkpoint file ")
    assert lines[0].endswith(f"resuming from step-00000002; moved it to {shelf / 'step-00000006.1'} "
                             "(kept, never resumed from)")
    assert [p.name for p in store.complete_checkpoints(tmp_path)] == ["step-00000002"]
    # Pruning and setting aside newer checkpoints leave the damaged ones alone.
    store.prune(tmp_path, 2, folder)
    store.set_aside_newer(tmp_path, 1, keep=2)
    assert sorted(p.name for p in shelf.iterdir()) == ["step-00000004", "step-00000006", "step-00000006.1"]


def test_a_checkpoint_the_launcher_verified_is_not_hashed_again_unless_its_marker_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _checkpoint(tmp_path, 2)
    monkeypatch.setenv(store.VERIFIED_ENV, store.launcher_token(folder))
    trusted = store.trusted_by_launcher()
    assert trusted == (folder, store.digest(folder / store.MARKER)["sha256"])
    (folder / "__0_0.distcp").write_bytes(b"changed after the launcher's check")
    assert store.verify(folder, trusted)["step"] == 2  # the files are not read again
    with pytest.raises(CheckpointError, match="__0_0.distcp"):
        store.verify(folder)
    store.write_marker(folder, {"step": 2, "other": True}, store.read_marker(folder)["files"])
    with pytest.raises(CheckpointError, match="__0_0.distcp"):  # another marker: checked in full
        store.verify(folder, trusted)


def test_prune_keeps_the_newest_and_drops_interrupted_saves(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 4, complete=False)
    current = _checkpoint(tmp_path, 5)
    store.prune(tmp_path, keep=2, current=current)
    assert sorted(p.name for _, p in store.step_folders(tmp_path)) == ["step-00000003", "step-00000005"]


def test_checkpoints_newer_than_a_resumed_step_are_set_aside_not_deleted(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    moved, deleted = store.set_aside_newer(tmp_path, 3, keep=2)  # resumed from 2, about to save 3
    assert sorted(p.name for p in moved) == ["step-00000004", "step-00000006"] and deleted == []
    assert [p.name for p in store.complete_checkpoints(tmp_path)] == ["step-00000002"]
    assert json.loads((tmp_path / "superseded" / "step-00000006" / store.MARKER).read_text())["step"] == 6
    # Later: a complete checkpoint of the step about to be saved is set aside too, never overwritten; the
    # shelf keeps the newest `keep` folders.
    for step in (3, 6):
        _checkpoint(tmp_path, step)
    moved, deleted = store.set_aside_newer(tmp_path, 3, keep=2)
    assert sorted(p.name for p in moved) == ["step-00000003", "step-00000006"]
    assert sorted(p.name for p in (tmp_path / "superseded").iterdir()) == ["step-00000003", "step-00000006"]
    assert len(deleted) == 2  # the first set-aside's folders


def test_fault_specs() -> None:
    assert parse_faults("kill:rank=1:step=6; kill-in-save:step=2:delay=0.5") == [
        Fault("kill", 1, 6), Fault("kill-in-save", 0, 2, 0.5)]
    with pytest.raises(FaultSpecError, match="unknown fault 'explode'; valid: kill, segfault, hang"):
        parse_faults("explode:step=1")
    with pytest.raises(FaultSpecError, match="needs step"):
        parse_faults("kill:rank=1")
    with pytest.raises(FaultSpecError, match="bad field 'when=3'"):
        parse_faults("kill:when=3")
    # Only this rank's faults, and only in the first attempt: a restarted run recovers.
    assert Faults(1, {"MESHFIT_FAULT": "kill:rank=1:step=6"}).faults == [Fault("kill", 1, 6)]
    assert Faults(0, {"MESHFIT_FAULT": "kill:rank=1:step=6"}).faults == []
    assert Faults(1, {"MESHFIT_FAULT": "kill:rank=1:step=6", "TORCHELASTIC_RESTART_COUNT": "1"}).faults == []


def test_checkpoint_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="checkpoint.keep_latest: must be ≥ 2"):
        load_config(None, ["checkpoint.keep_latest=1"])
    with pytest.raises(ConfigError, match="checkpoint.interval: must be ≥ 0"):
        load_config(None, ["checkpoint.interval=-1"])
    with pytest.raises(ConfigError, match="train.on_nonfinite"):
        load_config(None, ["train.on_nonfinite=ignore"])
    with pytest.raises(ConfigError, match="train.timeout_s: must be a positive"):
        load_config(None, ["train.timeout_s=0"])
