"""Start a training run: in this process (one rank), under an outer torchrun, or as N local ranks.

N local ranks go through torch's own torchrun machinery (torch.distributed.launcher.elastic_launch with the
c10d rendezvous on a free local port), so a run behaves the same as under `torchrun --nproc-per-node N`.
Whatever happens, the caller gets one Outcome: the rank-0 result, or one failure naming the rank.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import uuid
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshfit.config import Config
from meshfit.train.shape import resolve_run


@dataclass
class Outcome:
    ok: bool
    result: dict[str, Any] | None = None
    failure: dict[str, Any] | None = None  # the first failing rank's record (see faults.failure_record)
    failed_ranks: tuple[int, ...] = ()
    exit_codes: dict[int, int] = field(default_factory=dict)  # local ranks that exited non-zero (--nproc)
    notes: list[str] = field(default_factory=list)  # e.g. failures a restart recovered from

    @property
    def message(self) -> str:
        if self.ok or not self.failure:
            if self.ok:
                return ""
            codes = ", ".join(f"rank {r}: {_exit_text(c)}" for r, c in sorted(self.exit_codes.items()))
            return "training failed on a rank without an error report" + (f" ({codes})" if codes else " (killed?)")
        others = [r for r in self.failed_ranks if r != self.failure["rank"]]
        label = "rank" if len(others) == 1 else "ranks"
        also = f" ({label} {', '.join(map(str, others))} failed too)" if others else ""
        return self.failure["message"] + also


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def prepare_run_dir(cfg: Config, run_dir: Path) -> None:
    """Write the resolved config the ranks read; stale failure reports and results are removed (metrics of
    steps a resumed run keeps stay: rank 0 trims metrics.jsonl to the step it continues from)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(run_dir / "failures", ignore_errors=True)
    (run_dir / "result.json").unlink(missing_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())


def collect(run_dir: Path, exit_codes: dict[int, int] | None = None) -> Outcome:
    """The run's outcome from what the ranks left in run_dir: result.json, failures/rank<N>.json.

    Failures of an earlier attempt that a restart recovered from become notes of a successful outcome."""
    reports = sorted(
        (json.loads(p.read_text()) for p in (run_dir / "failures").glob("rank*.json")), key=lambda r: r["time"]
    ) if (run_dir / "failures").is_dir() else []
    result_file = run_dir / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    attempt = result.get("attempt", 0) if result else None
    current = [r for r in reports if result is None or r.get("attempt", 0) >= attempt]
    if current:
        return Outcome(ok=False, failure=current[0], failed_ranks=tuple(sorted(r["rank"] for r in current)),
                       exit_codes=exit_codes or {})
    if result is not None:
        notes = [f"recovered: attempt {r.get('attempt', 0)} failed on rank {r['rank']} ({r['message']}); "
                 f"restart {attempt} resumed from the last complete checkpoint" for r in reports[:1]]
        if attempt and not reports:
            notes.append(f"recovered: restart {attempt} resumed from the last complete checkpoint after a rank died")
        return Outcome(ok=True, result=result, notes=notes)
    return Outcome(ok=False, exit_codes=exit_codes or {})


def _launch_local(run_dir: Path, nproc: int, max_restarts: int = 0) -> dict[int, int]:
    """Run the ranks; returns the exit codes of those that failed (empty when all succeeded)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Ranks share the cores: without this each would start one thread per core and oversubscribe them.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8], rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts, monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-m", "meshfit.train.worker", str(run_dir))
    except ChildFailedError as exc:
        # The ranks' own reports in run_dir/failures say what happened; exit codes cover ranks that died.
        return {failure.local_rank: failure.exitcode for failure in exc.failures.values()}
    except SignalException:
        pass  # SIGTERM/SIGINT reached this launcher: torch passed it to the ranks, which saved and stopped
    return {}


def launch(cfg: Config, run_dir: Path, nproc: int | None = None, max_restarts: int = 0) -> Outcome:
    """Validate, then train with `nproc` local ranks (None: one, or the ranks of an outer torchrun).

    `max_restarts`: with local ranks, restart them all up to that many times after a failure; each
    restart resumes from the latest complete checkpoint."""
    run_dir = Path(run_dir)
    from meshfit.train.worker import run_worker

    if under_torchrun():
        # Every rank of an outer torchrun lands here with the same config. The first rank of each node
        # prepares that node's run directory; the others pass it in memory and meet it at the rendezvous.
        resolve_run(cfg, int(os.environ["WORLD_SIZE"]))
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            prepare_run_dir(cfg, run_dir)
        run_worker(run_dir, cfg)
        return collect(run_dir)
    resolve_run(cfg, nproc or 1)  # raises ConfigError before any rank starts
    prepare_run_dir(cfg, run_dir)
    if not nproc or nproc == 1:
        run_worker(run_dir, cfg)
        return collect(run_dir)
    return collect(run_dir, _launch_local(run_dir, nproc, max_restarts))

