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


def resume_layouts_job(cfg_dicts: dict[str, dict[str, Any]], root: str) -> dict[str, Any]:
    """resume_job for several layouts of the same world size, one after the other on these ranks."""
    return {name: resume_job(cfg, f"{root}/{name}") for name, cfg in cfg_dicts.items()}


def nonfinite_cases_job(cases: list[tuple[dict[str, Any], str]]) -> list[dict[str, Any]]:
    return [nonfinite_job(cfg, fault) for cfg, fault in cases]


def nonfinite_job(cfg_dict: dict[str, Any], fault: str) -> dict[str, Any]:
    """Train 4 steps with `fault` injected in step 3; returns what each step did and whether the parameters
    after a refused step equal those before it."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from meshfit.train.faults import Faults
    from meshfit.train.guard import NonFiniteError, StepGuard
    from meshfit.train.trainer import build_run, train_step

    cfg = config_from_dict(cfg_dict)
    env = init_distributed(cfg.train.device)
    run = build_run(cfg, env, None)
    guard = StepGuard(run, Faults(env.rank, {"MESHFIT_FAULT": fault}), None, None)

    def params() -> dict[str, torch.Tensor]:
        return get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True))

    out: dict[str, Any] = {"records": [], "error": None, "unchanged": None}
    for _ in range(4):
        before = {k: v.clone() for k, v in params().items()}
        try:
            record = train_step(run, guard)
        except NonFiniteError as exc:
            out["error"], out["error_step"] = str(exc), run.step + 1
            out["unchanged"] = all(torch.equal(before[k], v) for k, v in params().items())
            return out
        if record.get("skipped"):
            out["unchanged"] = all(torch.equal(before[k], v) for k, v in params().items())
        out["records"].append({k: record.get(k) for k in ("step", "loss", "skipped")})
    return out
