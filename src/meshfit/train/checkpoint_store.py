"""Checkpoint folders on disk: which are complete, which is the latest, whether their files are intact.

    CHECKPOINT_DIR/step-00000005/   .metadata, __<rank>_<n>.distcp   (torch.distributed.checkpoint)
                                    meshfit.json                    the completeness marker

`meshfit.json` is written last, atomically, once every rank's files are on disk. It records the step, the
layout that saved it and every file's size and SHA-256, so a truncated or corrupt file is found and named
before anything is loaded. A folder without it is an interrupted save and is never resumed from.

A complete checkpoint that a resume skips as damaged is moved to CHECKPOINT_DIR/damaged/ at once: it is
never resumed from, written over or deleted by meshfit (keep_latest counts only intact checkpoints).
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
DAMAGED = "damaged"  # ROOT/damaged/: checkpoints a resume skipped, kept for the user to inspect
# Set by the launcher for its ranks: the checkpoint it verified ("FOLDER\tMARKER_SHA256"), so rank 0 does
# not hash the same files again (see `trusted_by_launcher`).
VERIFIED_ENV = "MESHFIT_VERIFIED_CHECKPOINT"
# The data the launcher identified (data/fingerprint.py) and what changed at a --new-data resume, as JSON.
DATA_ENV = "MESHFIT_DATA"
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


def verify(folder: Path, trusted: tuple[Path, str] | None = None) -> dict[str, Any]:
    """The marker of a complete, intact checkpoint; raises CheckpointError naming the damaged file.

    `trusted` (folder, marker SHA-256): a checkpoint verified moments ago by the launcher; when this is it,
    with the same marker, only the marker is read."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    marker = read_marker(folder)
    if trusted is not None and Path(trusted[0]) == folder and digest(folder / MARKER)["sha256"] == trusted[1]:
        return marker
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


def trusted_by_launcher() -> tuple[Path, str] | None:
    """The checkpoint the launcher verified before starting this rank (VERIFIED_ENV), if any."""
    folder, _, sha = os.environ.get(VERIFIED_ENV, "").partition("\t")
    return (Path(folder), sha) if folder and sha else None


def launcher_token(folder: Path) -> str:
    """The VERIFIED_ENV value for a checkpoint folder that was just verified."""
    return f"{Path(folder)}\t{digest(Path(folder) / MARKER)['sha256']}"


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


def pick(root: Path | None, pinned: Path | None = None, trusted: tuple[Path, str] | None = None
         ) -> tuple[Path | None, dict[str, Any] | None, list[tuple[Path, str]]]:
    """The checkpoint to resume from and its marker: `pinned` (it must be intact), else the newest intact
    complete one under root; and the newer complete ones skipped as damaged, each with what is wrong.

    Returns (None, None, []) when there is none; raises CheckpointError when every one is damaged (or the
    pinned one is)."""
    if pinned is not None:
        return Path(pinned), verify(pinned, trusted), []
    damaged: list[tuple[Path, str]] = []
    for folder in complete_checkpoints(root) if root is not None else []:
        try:
            return folder, verify(folder, trusted), damaged
        except CheckpointError as exc:
            damaged.append((folder, str(exc)))
    if damaged:
        raise CheckpointError("no intact checkpoint to resume from:\n  " + "\n  ".join(why for _, why in damaged))
    return None, None, []


def choose(root: Path, pinned: Path | None = None) -> tuple[Path | None, dict[str, Any] | None]:
    """`pick`, with a warning for each damaged checkpoint skipped."""
    folder, marker, damaged = pick(root, pinned)
    for _, why in damaged:
        warnings.warn(f"skipping damaged checkpoint: {why}; falling back to the previous one", stacklevel=2)
    return folder, marker


def set_aside_damaged(root: Path, damaged: list[tuple[Path, str]], chosen: Path) -> list[str]:
    """Move the damaged checkpoints a resume skipped (from `pick`) to ROOT/damaged/, a name taken there
    getting a suffix (nothing is written over); one line for each, naming what is wrong and where it went.
    Nothing there is pruned: what to do with it is the user's call."""
    shelf = Path(root) / DAMAGED
    lines = []
    for folder, why in damaged:
        shelf.mkdir(exist_ok=True)
        target, n = shelf / folder.name, 1
        while target.exists():
            target, n = shelf / f"{folder.name}.{n}", n + 1
        folder.rename(target)
        lines.append(f"warning: skipped the damaged checkpoint {folder.name} ({why}); resuming from "
                     f"{chosen.name}; moved it to {target} (kept, never resumed from)")
    return lines


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
