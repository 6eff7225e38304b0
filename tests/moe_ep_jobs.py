"""Rank functions of tests/test_moe_ep_checkpoints.py (importable by spawned ranks): a one-process run that
saves half-way, and, on 2 ranks under expert parallelism, its resume and a run whose saved model is read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from meshfit.config import Config, config_from_dict
from meshfit.train.checkpoint import Checkpointer
from meshfit.train.dist import init_distributed
from meshfit.train.run import build_run
from meshfit.train.trainer import train


def _resuming(cfg: Config) -> Config:
    return cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": True})})


def _stopping(cfg: Config, step: int) -> Config:
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"stop_after": step})})


def save_halfway_job(cfg_dict: dict[str, Any], folder: str, stop: int) -> dict[str, Any]:
    """The uninterrupted run's losses (no folder), then the same run's first `stop` steps saved in `folder`."""
    cfg = config_from_dict(cfg_dict)
    env = init_distributed(cfg.train.device)
    full = train(cfg, env, None)["losses"]
    first = train(_stopping(cfg, stop), env, Path(folder))["losses"]
    return {"full": full, "first": first}


def saved_logits(cfg: Config, env: Any, run_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the model the run saved last in run_dir, restored under cfg's layout (every rank takes
    part: the expert exchange is collective)."""
    run = build_run(_resuming(cfg), env, run_dir)
    Checkpointer(_resuming(cfg), env.rank, run_dir).restore(run)
    run.model.eval()
    with torch.no_grad():
        return run.model(tokens.to(env.device)).float().cpu()


def resume_and_export_job(resume: tuple[dict[str, Any], str], export: tuple[dict[str, Any], str],
                          tokens: list[list[int]]) -> dict[str, Any]:
    """`resume` (config, folder): continue the run saved in the folder under this config (losses of the
    steps trained here). `export` (config, folder): train and save in the folder, then the logits on
    `tokens` of the saved model read back under the same layout."""
    cfg = config_from_dict(resume[0])
    env = init_distributed(cfg.train.device)
    resumed = train(_resuming(cfg), env, Path(resume[1]))["losses"]
    exported = config_from_dict(export[0])
    train(exported, env, Path(export[1]))
    logits = saved_logits(exported, env, Path(export[1]), torch.tensor(tokens))
    # numpy: a tensor would travel to the test process in shared memory, gone when the rank exits
    return {"resumed": resumed, "logits": logits.numpy().copy()}
