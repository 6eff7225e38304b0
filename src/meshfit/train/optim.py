"""AdamW with linear warmup and cosine decay to `min_lr_ratio · lr`."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshfit.config import TrainSection


def build_optimizer(model: nn.Module, train: TrainSection) -> torch.optim.Optimizer:
    """AdamW; weight decay only on matrices (norm gains, biases and 1-D tensors are not decayed).

    Sharded layouts (ZeRO-1/2/3) hold DTensor shards here, so the states are sharded with them. The fused
    implementation updates each tensor in one kernel: torch's multi-tensor (foreach) default would keep
    a temporary as large as all the rank's parameters during step().
    """
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            # One fused call takes either plain tensors or DTensors (tensor-parallel weights can sit next
            # to plain norm gains), so each kind gets its own group.
            groups.setdefault((p.ndim >= 2, isinstance(p, DTensor)), []).append(p)
    param_groups = [{"params": params, "weight_decay": train.weight_decay if decay else 0.0}
                    for (decay, _), params in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]
    return torch.optim.AdamW(param_groups, lr=train.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainSection) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, train.warmup_steps, train.steps, train.min_lr_ratio)
    )


def continue_schedule(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                      train: TrainSection) -> None:
    """After loading a checkpoint: keep its position in the schedule (`scheduler.last_epoch`) but take the
    peak rate and shape from this run's config, so a changed train.lr, steps or warmup applies from the
    first resumed step instead of the saved groups' rates."""
    factor = lr_factor(scheduler.last_epoch, train.warmup_steps, train.steps, train.min_lr_ratio)
    scheduler.base_lrs = [train.lr for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["initial_lr"] = train.lr
        group["lr"] = train.lr * factor
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
