"""Fault handling on each rank: the hang watchdog, the stop request (SIGTERM) and fault injection.

Fault injection is a test switch, read from the environment so that it reaches ranks started by torchrun:

    MESHFIT_FAULT="kill:rank=1:step=6"               rank 1 dies (SIGKILL) when step 6 starts
    MESHFIT_FAULT="segfault:rank=1:step=6"           rank 1 crashes in native code (a null read) at step 6
    MESHFIT_FAULT="hang:rank=0:step=3"               rank 0 stops making progress at step 3
    MESHFIT_FAULT="nan-grad:rank=1:step=4"           rank 1's gradients turn NaN in step 4
    MESHFIT_FAULT="inf-loss:rank=0:step=4"           rank 0's loss turns Inf in step 4
    MESHFIT_FAULT="sigterm:rank=0:step=3"            rank 0 receives SIGTERM during step 3
    MESHFIT_FAULT="kill-in-save:rank=0:step=5:delay=0.02"   rank 0 dies 0.02 s into the save after step 5
    MESHFIT_FAULT="disk-full-in-save:rank=1:step=4"  rank 1 writes its files of the save after step 4, then
                                                     fails as a full disk does (OSError ENOSPC)

Several faults are separated by ';'. A fault fires only in the first attempt of a run (torchrun's
TORCHELASTIC_RESTART_COUNT = 0), so a restarted run can recover from it.
"""

from __future__ import annotations

import ctypes
import errno
import faulthandler
import io
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshfit.memory.tracker import MemoryBudgetExceeded

ENV_VAR = "MESHFIT_FAULT"
KINDS = ("kill", "segfault", "hang", "nan-grad", "inf-loss", "sigterm", "kill-in-save", "disk-full-in-save")


class FaultSpecError(ValueError):
    """MESHFIT_FAULT cannot be parsed; the message says what would be valid."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    delay: float = 0.0  # kill-in-save: seconds into the save


def parse_faults(text: str) -> list[Fault]:
    """Parse MESHFIT_FAULT (see the module docstring)."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, *fields = item.split(":")
        if kind not in KINDS:
            raise FaultSpecError(f"{ENV_VAR}={text!r}: unknown fault {kind!r}; valid: {', '.join(KINDS)}")
        values: dict[str, str] = {}
        for field in fields:
            key, sep, value = field.partition("=")
            if not sep or key not in ("rank", "step", "delay"):
                raise FaultSpecError(f"{ENV_VAR}={text!r}: bad field {field!r}; write KIND:rank=R:step=S"
                                     "[:delay=SECONDS]")
            values[key] = value
        try:
            faults.append(Fault(kind, int(values.get("rank", 0)), int(values["step"]),
                                float(values.get("delay", 0.0))))
        except (KeyError, ValueError):
            raise FaultSpecError(f"{ENV_VAR}={text!r}: {item!r} needs step=<int> (and rank=<int>, "
                                 "delay=<seconds> as numbers)") from None
    return faults


class Faults:
    """The faults this rank injects (none unless MESHFIT_FAULT is set, and only in the first attempt)."""

    def __init__(self, rank: int, env: dict[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        first_attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        spec = env.get(ENV_VAR, "")
        self.faults = [f for f in parse_faults(spec) if f.rank == rank] if spec and first_attempt else []

    def _due(self, kind: str, step: int) -> Fault | None:
        return next((f for f in self.faults if f.kind == kind and f.step == step), None)

    def at_step_start(self, step: int) -> None:
        if self._due("kill", step):
            _say(f"injected fault: killing this rank at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("segfault", step):
            _say(f"injected fault: this rank reads address 0 at step {step}")
            ctypes.string_at(0)  # a real crash in native code: the kernel sends SIGSEGV
        if self._due("sigterm", step):
            os.kill(os.getpid(), signal.SIGTERM)
        if self._due("hang", step):
            _say(f"injected fault: this rank hangs at step {step}")
            while True:
                time.sleep(0.05)

    def after_backward(self, step: int, params: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        """Corrupt this rank's gradients or loss when a fault is due; returns the (possibly) changed loss."""
        if self._due("nan-grad", step):
            for p in params:
                if p.grad is not None:
                    _local(p.grad).fill_(float("nan"))
                    break
        if self._due("inf-loss", step):
            loss = loss * float("inf")
        return loss

    def during_save(self, step: int) -> threading.Timer | None:
        fault = self._due("kill-in-save", step)
        if fault is None:
            return None
        timer = threading.Timer(fault.delay, lambda: os.kill(os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()
        return timer


    def storage_writer(self, step: int, folder: Path) -> Any:
        """DCP's file writer for the save after `step`: None (DCP's default) unless a full disk is due."""
        if not self._due("disk-full-in-save", step):
            return None
        from torch.distributed.checkpoint import FileSystemWriter

        class FullDisk(FileSystemWriter):
            def write_data(self, plan: Any, planner: Any) -> Any:
                super().write_data(plan, planner).wait()  # this rank's files are written, in part
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        _say(f"injected fault: the disk fills up during the save after step {step}")
        return FullDisk(str(folder))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _say(text: str) -> None:
    print(f"[rank {os.environ.get('RANK', 0)}] {text}", file=sys.stderr, flush=True)


def failure_record(rank: int, exc: BaseException) -> dict[str, Any]:
    record = {"rank": rank, "time": time.time(), "error": type(exc).__name__, "message": str(exc),
              "traceback": traceback.format_exc(), "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}
    if isinstance(exc, MemoryBudgetExceeded):
        record["budget"] = exc.to_dict()
    return record


def write_failure(run_dir: Path, rank: int, exc: BaseException) -> None:
    """RUN_DIR/failures/rank<N>.json: what the launcher reports (the first failure in time wins)."""
    folder = run_dir / "failures"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps(failure_record(rank, exc), indent=2))


class StopRequest:
    """SIGTERM or SIGINT asks for a clean stop: the ranks agree at the end of a step, save and stop (result
    status "interrupted"; the command exits 0 after SIGTERM, 130 after Ctrl-C)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        # The first signal names the stop: a launcher passes the user's Ctrl-C on to ranks that already
        # got it from the terminal, and a second one must not abort the save.
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
        self.requested = True

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class Watchdog:
    """Ends a rank that makes no progress for `timeout_s`: it writes the failure report, dumps every
    thread's stack to stderr and exits 1. A second, C-level timer (faulthandler) backs it up for hangs
    that hold the interpreter lock."""

    def __init__(self, timeout_s: float, rank: int, run_dir: Path | None) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.run_dir = run_dir
        self._timer: threading.Timer | None = None
        self.what = "start-up"

    def arm(self, what: str) -> None:
        """(Re)start the countdown for the next piece of work, described by `what` in the report."""
        self.disarm()
        self.what = what
        self._timer = threading.Timer(self.timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()
        try:  # the real stderr: a captured one (tests, notebooks) has no file descriptor
            faulthandler.dump_traceback_later(self.timeout_s + 5.0, exit=True, file=sys.__stderr__)
        except (AttributeError, ValueError, io.UnsupportedOperation):
            pass  # no usable descriptor: the Python timer alone watches this rank

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        faulthandler.cancel_dump_traceback_later()

    def _fire(self) -> None:
        message = (f"rank {self.rank} made no progress for {self.timeout_s:g} s during {self.what} (a hung rank "
                   "or collective); every rank stops. Raise train.timeout_s if this work is just slow.")
        if self.run_dir is not None:
            write_failure(self.run_dir, self.rank, TimeoutError(message))
        _say(message)
        try:
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        except (AttributeError, ValueError, io.UnsupportedOperation):
            pass
        sys.stderr.flush()
        os._exit(1)

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disarm()
