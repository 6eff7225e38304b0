"""Checkpoint folders on disk: which are complete, which is the latest, whether their files are intact.

    CHECKPOINT_DIR/step-00000005/   .metadata, __<rank>_<n>.distcp   (torch.distributed.checkpoint)
                                    meshfit.json                    the completeness marker

`meshfit.json` is written last, atomically, once every rank's files are on disk. It records the step, the
layout that saved it and every file's size and SHA-256, so a truncated or corrupt file is found and named
before anything is loaded. A folder without it is an interrupted save and is never resumed from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

MARKER = "meshfit.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the folder or file and what is wrong."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def digest(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of one file."""
    with open(path, "rb") as handle:
        sha = hashlib.file_digest(handle, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": sha}


def digest_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: digest(folder / name) for name in names}


def write_marker(folder: Path, info: dict[str, Any], files: dict[str, dict[str, Any]]) -> None:
    """Write the completeness marker atomically (temporary file, fsync, rename)."""
    tmp = folder / f".{MARKER}.tmp"
    with open(tmp, "w") as handle:
        json.dump({**info, "files": files}, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, folder / MARKER)


def read_marker(folder: Path) -> dict[str, Any]:
    path = Path(folder) / MARKER
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is not a complete checkpoint: {MARKER} is missing (an interrupted "
                              "save, or not a meshfit checkpoint folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or "step" not in data:
        raise CheckpointError(f"checkpoint file {path} is corrupt: it lacks 'step' or 'files'")
    return data


def verify(folder: Path) -> dict[str, Any]:
    """The marker of a complete, intact checkpoint; raises CheckpointError naming the damaged file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    marker = read_marker(folder)
    for name, expected in marker["files"].items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"checkpoint file {path} is truncated or damaged: {size} bytes, "
                                  f"{expected['bytes']} when saved")
        if digest(path)["sha256"] != expected["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is corrupt: its SHA-256 differs from the one saved")
    return marker


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """Every step-N folder under root, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def complete_checkpoints(root: Path) -> list[Path]:
    """Folders with a completeness marker, newest first (not yet checked for damage)."""
    return [p for _, p in step_folders(root) if (p / MARKER).is_file()]


def choose(root: Path, pinned: Path | None = None) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to resume from: `pinned` (it must be intact), else the newest intact complete one.

    A damaged checkpoint is skipped with a warning naming the file, falling back to the one before it.
    Returns (None, None) when there is none; raises CheckpointError when every one is damaged.
    """
    if pinned is not None:
        return Path(pinned), verify(pinned)
    problems = []
    for folder in complete_checkpoints(root):
        try:
            return folder, verify(folder)
        except CheckpointError as exc:
            problems.append(str(exc))
            warnings.warn(f"skipping damaged checkpoint: {exc}; falling back to the previous one", stacklevel=2)
    if problems:
        raise CheckpointError("no intact checkpoint to resume from:\n  " + "\n  ".join(problems))
    return None, None


def set_aside_newer(root: Path, step: int, keep: int) -> tuple[list[Path], list[Path]]:
    """Move checkpoints newer than `step` (a run resumed from an older one), and a complete one of `step`
    itself, to ROOT/superseded/ before `step` is saved, so the latest checkpoint is always on the current
    run's timeline and nothing complete is overwritten. ROOT/superseded/ keeps its newest `keep`
    folders (by the time they were set aside). Returns (moved, deleted)."""
    moved = []
    shelf = Path(root) / "superseded"
    now = time.time()  # one time for everything set aside together: ties fall back to the step
    for number, folder in step_folders(root):
        if number > step or (number == step and (folder / MARKER).is_file()):
            target = shelf / folder.name
            if target.exists():  # the same step set aside before: keep both, the older one renamed
                target.rename(shelf / f"{folder.name}.{int(target.stat().st_mtime)}")
            shelf.mkdir(exist_ok=True)
            folder.rename(target)
            os.utime(target, (now, now))  # its time on the shelf counts from now
            moved.append(target)
    deleted = []
    if shelf.is_dir():
        shelved = sorted(shelf.iterdir(), key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
        for folder in shelved[keep:]:
            shutil.rmtree(folder, ignore_errors=True)
            deleted.append(folder)
    return moved, deleted


def prune(root: Path, keep: int, current: Path) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` and interrupted saves other than `current`."""
    removed = []
    complete = 0
    for _, folder in step_folders(root):
        if folder == current:
            complete += 1
            continue
        if (folder / MARKER).is_file():
            complete += 1
            if complete <= keep:
                continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
