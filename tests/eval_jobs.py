"""Functions that run on every rank of the validation-loss tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

from dist_jobs import train_job

from meshfit.config import config_from_dict
from meshfit.train.dist import init_distributed


def layouts_job(cfg_dicts: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """train_job for several layouts of the same world size, one after the other on these ranks."""
    return {name: train_job(cfg) for name, cfg in cfg_dicts.items()}


def untouched_job(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Two evaluations around nothing else: whether they agree (dropout off), and whether the modes, the
    gradients, the optimizer and FSDP's sharded parameters were left as they were."""
    from torch.distributed.tensor import DTensor

    from meshfit.train.evaluate import evaluate
    from meshfit.train.run import build_run

    cfg = config_from_dict(cfg_dict)
    run = build_run(cfg, init_distributed(cfg.train.device), None)
    dropouts = [m for m in run.model.modules() if type(m).__name__ == "Dropout" and m.p > 0]
    first, second = evaluate(run)["val_loss"], evaluate(run)["val_loss"]
    return {"first": first, "second": second, "dropouts": len(dropouts),
            "all_training": all(m.training for m in run.model.modules()),
            "grads": sum(p.grad is not None for p in run.model.parameters()),
            "optimizer_state": len(run.optimizer.state),
            "sharded": all(isinstance(p, DTensor) for p in run.model.parameters())}
