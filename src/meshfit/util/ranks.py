"""Run a function on N gloo ranks from a test (or any script) and get every rank's return value.

    results = run_ranks(fn, 2, arg1, arg2, timeout_s=120)

`fn(*args)` must be importable (defined at module level). Each rank is a fresh process, forked from a
server that imported torch and meshfit once (starting a rank then costs milliseconds, not the seconds of
a new interpreter's imports), with this process's environment, the torchrun variables set (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port) and a gloo process group already
initialized; the group is torn down afterwards and the process ends with os._exit (gloo's teardown race).
The server is multiprocessing's one per process, started at the first call: what torch and meshfit read
from the environment at import time, and meshfit's code itself, are as they were then (a process that
reloads meshfit or changes such variables between calls should use its own spawn context). If any rank
raises, the others are killed at once and the error is raised here with that rank's traceback; past the
timeout every rank is killed and TimeoutError raised. A caller that ends without its clean-up (killed)
takes its ranks along (meshfit.util.lifeline).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from meshfit.util.lifeline import end_with

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def loopback_store(port: int = 0, timeout: timedelta = timedelta(seconds=60)) -> Any:
    """A torch TCPStore server on 127.0.0.1:`port` (0: a free port, read back from `.port`) and nowhere
    else: TCPStore binds its own server to every interface, so it is handed a socket already bound to the
    loopback address (`master_listen_fd`). Local ranks never need to be reached from the network."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, port))
        listener.listen(socket.SOMAXCONN)
        store = dist.TCPStore(LOOPBACK, listener.getsockname()[1], is_master=True, timeout=timeout,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the descriptor now
    return store


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


# Imported once by the fork server: what every rank needs before it runs `fn`.
PRELOAD = ["torch", "torch.distributed", "meshfit.train.trainer"]


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, results: Any, args: tuple,
               environ: dict[str, str], launcher: int) -> None:
    end_with(launcher)  # a caller killed without clean-up (e.g. out of memory) takes its ranks along
    # The fork server's environment is the one it started with; the caller's may have changed since.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port)})
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = loopback_store(port) if rank == 0 else dist.TCPStore(LOOPBACK, port, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        value = fn(*args)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, False, traceback.format_exc()))
        code = 1
    # Queue.put hands the data to a feeder thread; flush it before os._exit skips interpreter shutdown.
    results.close()
    results.join_thread()
    os._exit(code)


def _context() -> Any:
    """A fork-server context preloading PRELOAD: forking from it is safe (the server has started no
    threads), unlike forking this process, which may have."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """Run fn(*args) on `world_size` gloo ranks; returns the values in rank order."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, results, args, environ, os.getpid()),
                         daemon=True) for r in range(world_size)]
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:  # inside the try: ranks started before a failing start are ended too
            proc.start()
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(values))} did not finish "
                                   f"within {timeout_s:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    raise RankFailed(f"a rank died with exit code {dead[0]} without reporting") from None
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            values[rank] = value
    finally:
        for proc in procs:
            if proc.pid is None:
                continue  # never started
            proc.join(timeout=5 if len(values) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [values[r] for r in range(world_size)]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path → contents): compare two to show nothing on disk changed."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
