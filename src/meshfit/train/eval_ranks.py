"""`meshfit eval` on the ranks: a model laid out as training lays it out, its weights from a checkpoint
(resharded from whatever layout saved them) or from Hugging Face safetensors (`model.init_from`, as a
training run starts from them), and training's own validation loss (evaluate.py) over the held-out windows
the config names.

The launcher's side hands the ranks WORK/config.yaml (validated before any rank starts) and WORK/eval.json
(`{"checkpoint": folder or null}`); rank 0 writes WORK/result.json and a failing rank
WORK/failures/rank<N>.json, which `launch.collect` reads as it does for training. WORK is a temporary
folder: nothing is written anywhere else, and no run directory or its lock is involved.

    python -m meshfit.train.eval_ranks WORK WORK/config.yaml --launched
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from meshfit.config import Config
from meshfit.train.launch import Outcome, collect, launch_local, under_torchrun
from meshfit.train.worker import INTERRUPTED, guarded_rank, rank_main

JOB = "eval.json"


def evaluate_model(cfg: Config, env: Any, checkpoint: Path | None) -> dict[str, Any]:
    """This rank's part of the evaluation: `val_loss` (the same on every rank) and `val_time_s`."""
    from meshfit.train.checkpoint import load_model_weights
    from meshfit.train.evaluate import evaluate
    from meshfit.train.run import build_run

    run = build_run(cfg, env, None)  # model.init_from: the Hugging Face weights are its starting weights
    if checkpoint is not None:
        load_model_weights(run, checkpoint)
    return evaluate(run)


def eval_rank(work: Path, cfg: Config, checkpoint: Path | None, quiet: bool = False) -> int:
    """Evaluate on this rank; returns the exit code. Errors go to work/failures, not raised."""
    from meshfit.train.dist import init_distributed
    from meshfit.train.faults import Watchdog

    def body() -> None:
        env = init_distributed(cfg.train.device, cfg.train.timeout_s)
        with Watchdog(cfg.train.timeout_s, env.rank, work) as watchdog:
            watchdog.arm("the evaluation")
            result = evaluate_model(cfg, env, checkpoint)
        if env.rank == 0:
            record = {**result, "status": "finished", "finished_at": time.time(), "world_size": env.world_size}
            (work / "result.json").write_text(json.dumps(record))

    return guarded_rank(work, body, quiet)


def run_eval(cfg: Config, checkpoint: Path | None, nproc: int | None) -> Outcome:
    """Evaluate with `nproc` local ranks (None or 1: this process; under torchrun: its ranks). The outcome's
    result is rank 0's (`val_loss`, `val_time_s`, `world_size`); None on the other ranks of a torchrun."""
    with tempfile.TemporaryDirectory(prefix="meshfit-eval-") as tmp:
        work, since = Path(tmp), time.time()
        if under_torchrun() or not nproc or nproc == 1:
            code = eval_rank(work, cfg, checkpoint, quiet=not under_torchrun())
            if code == 0:
                result = json.loads((work / "result.json").read_text()) if (work / "result.json").is_file() else None
                return Outcome(ok=True, result=result)
            return _signalled(collect(work, since=since), "SIGINT" if code == INTERRUPTED else "")
        config_file = work / "config.yaml"
        config_file.write_text(cfg.to_yaml())
        (work / JOB).write_text(json.dumps({"checkpoint": str(checkpoint) if checkpoint else None}))
        try:
            codes, received = launch_local(work, config_file, nproc, __name__, cfg.train.timeout_s)
        except OSError as exc:  # e.g. fork or exec refused: no more processes or memory for them
            return Outcome(ok=False, failure={"rank": -1, "message": f"could not start {nproc} local ranks: {exc}"})
        return _signalled(collect(work, codes, since), received)


def _signalled(outcome: Outcome, received: str) -> Outcome:
    outcome.signal = received
    return outcome


def _launched_rank(work: Path, cfg: Config, config_file: Path) -> int:
    job = json.loads((config_file.parent / JOB).read_text())
    return eval_rank(work, cfg, Path(job["checkpoint"]) if job["checkpoint"] else None, quiet=True)


if __name__ == "__main__":
    rank_main(_launched_rank)
