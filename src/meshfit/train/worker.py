"""Entry point of one rank: `python -m meshfit.train.worker RUN_DIR CONFIG [--launched]` (started by
torchrun's machinery).

Reads CONFIG (written and validated by the launcher), trains, and on any error writes
RUN_DIR/failures/rank<N>.json so the launcher can report one clear message (`--launched`: the local
launcher prints it once; otherwise each rank also prints its own). Python warnings go to
RUN_DIR/warnings.log, not the console. Ctrl-C while the rank starts ends it quietly with 130; once
training runs, a signal asks for a clean stop (faults.StopRequest). The process ends with os._exit after
teardown: it avoids a gloo teardown race that can abort a rank after training finished.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshfit.util.kept_warnings import KeptWarnings

INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def guarded_rank(work_dir: Path, body: Callable[[], None], quiet: bool = False) -> int:
    """Run this rank's `body` with its warnings kept in work_dir; returns the exit code. Errors are
    reported in work_dir/failures for the launcher, not raised; the process group is torn down either way."""
    from meshfit.train.dist import teardown
    from meshfit.train.faults import write_failure

    rank = int(os.environ.get("RANK", "0"))
    with warnings_to_log(work_dir, rank):
        try:
            body()
        except KeyboardInterrupt:
            abandon_group()  # Ctrl-C before the stop request was in place: nothing began, nothing to save
            return INTERRUPTED
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
            write_failure(work_dir, rank, exc)
            if not quiet:
                print(f"[rank {rank}] error: {exc}", file=sys.stderr, flush=True)
            abandon_group()
            return 1
        teardown()
    return 0


def run_worker(run_dir: Path, cfg: Any, quiet: bool = False) -> int:
    """Train this rank; returns the exit code. Errors are reported in run_dir/failures, not raised."""
    from meshfit.memory.host_heap import keep_freed_blocks
    from meshfit.train.dist import init_distributed
    from meshfit.train.trainer import train

    def body() -> None:
        env = init_distributed(cfg.train.device, cfg.train.timeout_s)
        if env.device.type == "cpu":  # tensors in the C heap: see memory/host_heap.py
            keep_freed_blocks()
        train(cfg, env, run_dir)

    return guarded_rank(run_dir, body, quiet)


def warnings_to_log(run_dir: Path, rank: int) -> KeptWarnings:
    """Python warnings (torch's included) of this rank go to RUN_DIR/warnings.log, prefixed by the rank."""
    # When the budget stops a forward pass, torch also warns that FSDP's always-call hook saw the same
    # error; the budget error itself is what the user needs.
    return KeptWarnings(Path(run_dir) / "warnings.log", f"rank {rank}",
                        ignore=("module forward hook with ``always_call=True``",))


def abandon_group() -> None:
    # After a failure the other ranks may be inside a collective: no barrier, just drop the group.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def rank_main(run_rank: Callable[[Path, Any, Path], int]) -> None:
    """The body of a launched rank's `__main__`: `run_rank(RUN_DIR, config, CONFIG)` with the validated
    config read from CONFIG (sys.argv[1:3]), then os._exit with its code. Training's ranks and `meshfit
    eval`'s start alike."""
    code = INTERRUPTED
    if "--launched" in sys.argv[3:]:
        from meshfit.util.lifeline import end_with_launcher

        end_with_launcher()  # first: a launcher killed while this rank starts takes it along
    try:
        import yaml

        from meshfit.config import config_from_dict

        run_dir, config_file = Path(sys.argv[1]), Path(sys.argv[2])
        try:
            text = config_file.read_text()
        except FileNotFoundError:
            # The launcher removes it when it ends: Ctrl-C reached it while this rank was still starting.
            sys.exit(INTERRUPTED)
        code = run_rank(run_dir, config_from_dict(yaml.safe_load(text)), config_file)
    except KeyboardInterrupt:
        pass  # Ctrl-C while this rank was still importing: the launcher says what happened
    except SystemExit as exc:
        code = int(exc.code or 0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    rank_main(lambda run_dir, cfg, _: run_worker(run_dir, cfg, quiet="--launched" in sys.argv[3:]))


if __name__ == "__main__":
    main()
