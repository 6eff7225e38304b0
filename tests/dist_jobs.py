"""Functions that run on every rank of a multi-process test (importable by spawned ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshfit.config import config_from_dict, load_config
from meshfit.train.dist import init_distributed
from meshfit.train.trainer import train

# A small llama-family model and synthetic data: one step is well under a second on one core.
PARITY_BASE = ["model.preset=tiny", "train.steps=10", "train.global_batch=8", "train.seq_len=64",
               "train.lr=3e-3", "train.warmup_steps=2", "train.seed=7"]


def parity_config(*overrides: str) -> dict[str, Any]:
    return load_config(None, [*PARITY_BASE, *overrides]).model_dump()


def train_job(cfg_dict: dict[str, Any], run_dir: str | None = None) -> dict[str, Any]:
    """Train on this rank (the process group is already up) and return the run's result."""
    cfg = config_from_dict(cfg_dict)
    env = init_distributed(cfg.train.device)
    return train(cfg, env, Path(run_dir) if run_dir else None)


def resume_job(cfg_dict: dict[str, Any], root: str) -> dict[str, Any]:
    """10 uninterrupted steps (root/full), then 5 steps + resume + 5 steps (root/split), on these ranks."""
    cfg = config_from_dict(cfg_dict)
    env = init_distributed(cfg.train.device)
    full = train(cfg, env, Path(root) / "full")
    stopped = train(cfg.model_copy(update={"train": cfg.train.model_copy(update={"stop_after": 5})}), env,
                    Path(root) / "split")
    resumed_cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": True})})
    resumed = train(resumed_cfg, env, Path(root) / "split")
    return {"full": full, "first": stopped, "second": resumed}
