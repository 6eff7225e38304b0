"""Local ranks never outlive the process that launched them.

A launcher can end without its own clean-up: killed by the kernel's out-of-memory killer, by SIGKILL, or
by an error inside torch's launcher while it was still starting ranks. Its ranks would then wait for
peers or for a launcher that is gone, for as long as their collectives' timeouts allow. So every local
rank watches its launcher (`end_with`), whoever started it: torch's elastic agent (a child process in a
session of its own) or meshfit.util.ranks's fork server (whose children keep the server alive in turn, so
only the launcher's end can release them). And a launcher that is still there reaps what it started
(`kill_children`) however its launch ended.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from pathlib import Path

LAUNCHER_ENV = "MESHFIT_LAUNCHER_PID"  # set for the ranks of `meshfit train --nproc N` and `meshfit demo`


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def end_with(pid: int) -> None:
    """SIGKILL this process as soon as process `pid` ends (at once if it already has).

    A daemon thread waits on a pidfd (Linux ≥ 5.3), else polls once a second. The kernel's
    PR_SET_PDEATHSIG would not do: it follows the parent, and a fork-server rank's parent is the server."""
    try:
        handle: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except (AttributeError, OSError):
        handle = None

    def watch() -> None:
        if handle is not None:
            select.select([handle], [], [])  # readable once the process has ended
        else:
            while _alive(pid):
                time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="meshfit-lifeline", daemon=True).start()


def end_with_launcher() -> None:
    """end_with the launcher named in LAUNCHER_ENV (nothing when unset: e.g. under an outer torchrun)."""
    pid = os.environ.get(LAUNCHER_ENV, "")
    if pid.isdigit():
        end_with(int(pid))


def kill_children(marker: str) -> list[int]:
    """SIGKILL this process's children whose command line contains `marker`; returns their pids.
    (Linux /proc; elsewhere nothing is found.)"""
    killed = []
    me = os.getpid()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after its ")".
            ppid = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != me or marker not in entry.joinpath("cmdline").read_text().replace("\0", " "):
                continue
            os.kill(int(entry.name), signal.SIGKILL)
            killed.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile
    for pid in killed:
        try:
            os.waitpid(pid, 0)  # no zombie left either
        except ChildProcessError:
            pass
    return killed
