"""Pipeline-parallel pieces of a run: build this rank's stages and run one step of the schedule."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshfit.config import Config
from meshfit.data.boundaries import Packed
from meshfit.models import ModelConfig, build_model
from meshfit.models.init import WeightSource
from meshfit.models.loss import lm_loss
from meshfit.parallel.dims import Meshes
from meshfit.parallel.parallelize import parallelize
from meshfit.parallel.pipeline_memory import SendWaits
from meshfit.parallel.pipeline_parallel import build_schedule, cut_stage, make_stage
from meshfit.train.shape import RunShape


@dataclass
class Pipe:
    schedule: Any
    stage_ids: list[int]
    first: bool  # this rank runs stage 0 (it feeds the inputs)
    last: bool  # this rank runs the last stage (it computes the loss)
    loss: StageLoss  # the schedule's loss function
    sends: SendWaits | None = None  # sends the schedule left to meshfit to wait for


class StageLoss:
    """The last stage's loss of one micro-batch: the mean (the schedule scales gradients by 1/micro-batches),
    or the sum times `scale` when the step sets one (document masking: trainer.loss_scale)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.scale: float | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets, self.vocab_size, self.scale)


def build_pipeline(cfg: Config, shape: RunShape, meshes: Meshes, model_cfg: ModelConfig, device: torch.device,
                   materialize: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                   weights: WeightSource | None = None) -> tuple[nn.ModuleList, Pipe]:
    """This rank's stage modules (each laid out like a whole model would be) and the schedule.

    `materialize`: see `parallelize`."""
    plan = shape.stages
    ids = plan.stages_of_rank(meshes.world["pp"].get_local_rank(), shape.dims.pp)
    last = plan.n_stages - 1
    modules = []
    for sid in ids:
        stage = cut_stage(build_model(model_cfg, "meta"), plan.layers[sid], sid == 0, sid == last)
        modules.append(parallelize(stage, shape.dims, meshes, model_cfg, parallel=cfg.parallel,
                                   zero_stage=shape.zero_stage, mixed_precision=shape.mixed_precision,
                                   device=device, seed=cfg.train.seed, weights=weights,
                                   materialize=materialize, compile_blocks=cfg.train.compile,
                                   seq_len=cfg.train.seq_len))
    group = meshes.world["pp"].get_group()
    stages = [make_stage(m, sid, plan.n_stages, device, group) for m, sid in zip(modules, ids, strict=True)]
    loss_fn = StageLoss(model_cfg.vocab_size)
    schedule, sends = build_schedule(cfg.pipeline.schedule, stages, shape.microbatches, loss_fn)
    return nn.ModuleList(modules), Pipe(schedule, ids, 0 in ids, last in ids, loss_fn, sends)


def pipeline_step(pipe: Pipe, batch: Packed, device: torch.device, use_loss_parallel: bool,
                  forward_only: bool = False, scale: float | None = None) -> torch.Tensor:
    """Forward and backward of every micro-batch through the schedule; returns the mean of the micro-batch
    losses on the last stage, which alone computes them, and zero on the others (the step's vote averages
    the holders' losses). `scale`: see `StageLoss`.

    Document ids and positions go to every stage (each builds its blocks' mask and positions from them),
    as keyword inputs, which the schedule splits into micro-batches like the tokens.

    `forward_only` (evaluation): torch's own forward-only pass of the same schedule, `schedule.eval`."""
    losses: list[torch.Tensor] = []
    pipe.loss.scale = scale
    args = (batch.inputs.to(device),) if pipe.first else ()
    kwargs = batch.model_kwargs(device)
    if pipe.last:
        kwargs.update(target=batch.targets.to(device), losses=losses)
    if pipe.last and "return_outputs" in inspect.signature(pipe.schedule.step).parameters:
        # Only the losses are used: without this the last stage keeps every micro-batch's logits.
        kwargs["return_outputs"] = False
    with loss_parallel() if use_loss_parallel else contextlib.nullcontext():
        try:
            (pipe.schedule.eval if forward_only else pipe.schedule.step)(*args, **kwargs)
        except BaseException:
            if pipe.sends is not None:
                pipe.sends.drain(failed=True)
            raise
        if pipe.sends is not None:
            pipe.sends.drain()
    if not pipe.last:
        return torch.zeros((), device=device)
    parts = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]
    return torch.stack([p.detach() for p in parts]).mean()
