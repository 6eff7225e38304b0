"""One process at a time in a run directory.

A run (or the demo) holds an exclusive `flock` on `RUN_DIR/.meshfit.lock` from its checks to its end; a
second start into the same directory, with or without --overwrite or --resume, is refused naming the
process that holds it, before it reads or writes anything there. The kernel drops a `flock` when its
holder dies, however it dies (SIGKILL, out of memory), so a lock left behind never blocks a resume; the
file itself only says who held it last. On a shared file system (a multi-node run's --run-dir) rank 0
takes it; Linux maps `flock` to the server's byte-range locks on NFS.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".meshfit.lock"


class RunDirBusy(RuntimeError):
    """Another live process holds the run directory; the message names it."""


def _holder(path: Path) -> str:
    """Who holds the lock, as its file says (written by the holder right after it took the lock)."""
    try:
        info = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started_at"]))
        return f"pid {info['pid']} on {info['host']} since {since} ({info['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that is starting now"


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding the lock on `path`, or None when a live process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder removed the file as it ended, after we opened it: take the new one


@contextlib.contextmanager
def hold(run_dir: Path, flag: str = "--run-dir") -> Iterator[None]:
    """Hold `run_dir` for this process (created if missing) until the block ends; RunDirBusy when another
    live process holds it. A directory made here and left holding nothing else is removed again, so a
    start refused by a later check leaves the disk as it was."""
    run_dir = Path(run_dir)
    created = [folder for folder in (run_dir, *run_dir.parents) if not folder.exists()]  # deepest first
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = _try_lock(path)
    if fd is None:
        raise RunDirBusy(f"{flag} {run_dir} is in use by another meshfit run: {_holder(path)}. Wait for it to "
                         "end or stop it (Ctrl-C saves a checkpoint), or choose another --run-dir")
    try:
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
                  "command": " ".join(["meshfit", *sys.argv[1:]]) if sys.argv[1:] else "meshfit"}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(record).encode())
        yield
    finally:
        path.unlink(missing_ok=True)  # before the release: a waiter then finds no file, or a new one
        os.close(fd)
        for folder in created:
            try:
                folder.rmdir()  # only when empty: nothing of a run is ever removed here
            except OSError:
                break
