"""Paths users give meshfit: files it reads (a clear error instead of an OSError) and files it writes
(checked before any work starts, and never replaced without --overwrite)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class PathError(ValueError):
    """A path argument cannot be read or written; the message names the flag or file and what would do."""


def read_text(path: str | Path, what: str, hint: str = "") -> str:
    """The UTF-8 text of ``path``; PathError naming the file when it is missing, a directory, unreadable or
    not text. ``what`` names the expected content ("hardware profile"); ``hint`` says how to get one."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PathError(f"{path}: no such {what}{f' ({hint})' if hint else ''}") from None
    except IsADirectoryError:
        raise PathError(f"{path} is a directory, not a {what}{f' ({hint})' if hint else ''}") from None
    except UnicodeDecodeError as exc:
        raise PathError(f"{path}: not a {what} (byte {exc.start} is not UTF-8 text)") from None
    except OSError as exc:  # permissions, a broken device, a name too long ...
        raise PathError(f"{path}: the {what} cannot be read ({exc.strerror or exc})") from None


def check_out_file(path: Path, flag: str, overwrite: bool, example: str, make_parents: bool = False) -> None:
    """``path`` can be written before the work that produces it starts: it is not a directory, an existing
    file is only replaced with --overwrite, and the file can really be created there (tried, then removed:
    permissions alone miss read-only mounts and special file systems such as /proc). ``make_parents``: the
    command creates missing folders itself, so the nearest existing one must be a writable folder."""
    path = Path(path)
    if path.is_dir():
        raise PathError(f"{flag} {path} is a directory; give a file name, e.g. {path / example}")
    if path.exists() and not overwrite:
        raise PathError(f"{flag} {path} exists: replace it with --overwrite or choose another file")
    parent = path.parent
    if not parent.exists():
        if not make_parents:
            raise PathError(f"{flag} {path}: the folder {parent} does not exist")
        check_out_dir(parent, flag)  # the command makes the folder, then writes the file in it
        return
    if not parent.is_dir():
        raise PathError(f"{flag} {path}: {parent} is a file, so {path.name} cannot be written under it")
    _try_write(path, flag)


def _try_write(path: Path, flag: str) -> None:
    """Open ``path`` for writing without changing it: an existing file is opened in place (not truncated),
    a new one is created and removed again."""
    existed = path.exists()
    try:
        with open(path, "r+b" if existed else "xb"):
            pass
    except OSError as exc:
        raise PathError(f"{flag} {path} cannot be written ({exc.strerror or exc}): choose a writable "
                        "location") from None
    if not existed:
        path.unlink(missing_ok=True)


def check_out_dir(path: Path, flag: str) -> None:
    """A folder can be made at ``path`` and written: it is not a file, the nearest existing ancestor is a
    folder, and files can be created in it (tried with a temporary file that is removed again:
    permissions alone miss read-only mounts and special file systems such as /proc)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise PathError(f"{flag} {path} is a file, not a directory: choose another path")
    folder = path
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise PathError(f"{flag} {path}: {folder} is a file, so no directory can be made under it")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".meshfit-probe-")
    except OSError as exc:
        raise PathError(f"{flag} {path} cannot be written ({exc.strerror or exc} in {folder}): choose a "
                        "writable location") from None
    os.close(fd)
    os.unlink(probe)
