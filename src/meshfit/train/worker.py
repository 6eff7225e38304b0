"""Entry point of one rank: `python -m meshfit.train.worker RUN_DIR` (started by torchrun's machinery).

Reads RUN_DIR/config.yaml (written and validated by the launcher), trains, and on any error writes
RUN_DIR/failures/rank<N>.json so the launcher can report one clear message. The process ends with
os._exit after teardown: it avoids a gloo teardown race that can abort a rank after training finished.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import yaml

from meshfit.config import Config, config_from_dict
from meshfit.train.dist import init_distributed, teardown
from meshfit.train.faults import write_failure
from meshfit.train.trainer import train


def run_worker(run_dir: Path, cfg: Config | None = None) -> int:
    """Train this rank; returns the exit code. Errors are reported in run_dir/failures, not raised."""
    if cfg is None:
        cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    rank = int(os.environ.get("RANK", 0))
    # When the budget stops a forward pass, torch also warns that FSDP's always-call hook saw the same
    # error; the budget error itself is what the user needs.
    warnings.filterwarnings("ignore", message="module forward hook with ``always_call=True``")
    try:
        env = init_distributed(cfg.train.device, cfg.train.timeout_s)
        train(cfg, env, run_dir)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
        write_failure(run_dir, rank, exc)
        print(f"[rank {rank}] error: {exc}", file=sys.stderr, flush=True)
        _abandon_group()
        return 1
    teardown()
    return 0


def _abandon_group() -> None:
    # After a failure the other ranks may be inside a collective: no barrier, just drop the group.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    code = run_worker(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
