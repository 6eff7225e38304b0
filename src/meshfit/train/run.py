"""What one rank holds for a training run (`Run`) and how it is built from the config (`build_run`): the
model laid out over the mesh, its optimizer, data, memory tracker, and the layout's helpers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.config import Config
from meshfit.data import TokenBatches
from meshfit.data.boundaries import Packed, pack
from meshfit.data.heldout import HeldOut
from meshfit.layout.data_parallel_kind import reduces_in_background
from meshfit.memory.meter import MemoryMeter, rank_tracker
from meshfit.memory.tracker import limit_cuda_memory
from meshfit.models import build_model, flops_per_token
from meshfit.models.hf_read import HFWeights
from meshfit.models.moe_stats import set_aux_loss_scale
from meshfit.parallel.context_parallel import shard_sequence
from meshfit.parallel.data_parallel import GradientStash, gradient_stash
from meshfit.parallel.dims import Meshes
from meshfit.parallel.host_reduce import HostReduceScatter, host_reduce_scatter
from meshfit.parallel.parallelize import parallelize
from meshfit.train.dist import RankEnv
from meshfit.train.held_out import data_name, data_sources, held_out_reader, window_order
from meshfit.train.metrics import peak_flops
from meshfit.train.optim import build_optimizer, build_scheduler
from meshfit.train.pipelined import Pipe, build_pipeline
from meshfit.train.shape import RunShape, resolve_run


@dataclass
class Run:
    """Everything one rank holds for a training run."""

    cfg: Config
    env: RankEnv
    shape: RunShape
    meshes: Meshes
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    batches: TokenBatches
    tracker: Any  # meshfit.memory.meter.rank_tracker
    flops_per_token: float
    peak_flops: float | None
    pipe: Pipe | None = None  # pipeline parallelism: this rank's stages and schedule
    run_dir: Path | None = None
    step: int = 0  # optimizer steps done, counting those before a resume
    start_step: int = 0  # the step this launch started from (> 0 when resumed)
    launch_steps: int = 0  # optimizer steps taken by this process (dry runs included)
    history: list[dict[str, Any]] = field(default_factory=list)  # this launch's step records
    meter: MemoryMeter | None = None  # when the tracker runs (None: every step, as in dry runs)
    stash: GradientStash | None = None  # ZeRO-2 under mixed precision with gradient accumulation
    compiling_since: float = 0.0  # the process's compile seconds when the step began (train.compile)
    init_from: HFWeights | None = None  # model.init_from's reader: what this rank read (bytes, seconds)
    host_reduce: HostReduceScatter | None = None  # FSDP2's reduce-scatters on CPU ranks (host_reduce.py)
    held_out: HeldOut | None = None  # validation batches (train.eval_every > 0)
    context: tuple[int, int] = (1, 0)  # (parallel.cp, this rank's index along it)
    moe_counts: Any = None  # the last step's Mixture-of-Experts counts (models/moe_stats.StepCounts)

    def local_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> Packed:
        """This rank's part of a batch's sequences (all of them, or under context parallelism its chunks),
        with their document ids and positions under data.document_mask (read from the whole sequences,
        then split alike)."""
        batch = pack(inputs, targets, self.shape.eos_id)
        cp, rank = self.context
        if cp == 1:
            return batch
        return batch.map(lambda t: shard_sequence(t, cp, rank))


def build_run(cfg: Config, env: RankEnv, run_dir: Path | None,
              materialize: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> Run:
    """This rank's run. `materialize` is entered where the model is materialized (see `parallelize`): a dry
    run passes a FakeTensorMode, so that the device mesh and the layout are built outside it."""
    shape = resolve_run(cfg, env.world_size)
    meshes = shape.dims.build_mesh(env.device.type)
    model_cfg = shape.model
    torch.manual_seed(cfg.train.seed)
    weights = _starting_weights(cfg, model_cfg)
    pipe = None
    if shape.stages is not None:
        model, pipe = build_pipeline(cfg, shape, meshes, model_cfg, env.device, materialize, weights)
    else:
        model = parallelize(build_model(model_cfg, "meta"), shape.dims, meshes, model_cfg, parallel=cfg.parallel,
                            zero_stage=shape.zero_stage, mixed_precision=shape.mixed_precision,
                            device=env.device, seed=cfg.train.seed, weights=weights, materialize=materialize,
                            compile_blocks=cfg.train.compile, seq_len=cfg.train.seq_len)
    # Mixture-of-Experts load balancing trains in the blocks with the gradient the step gives its loss:
    # 1 / accumulation steps, or 1 under a pipeline (its schedule divides the gradients by the micro-batches).
    set_aux_loss_scale(model, 1.0 if pipe is not None else 1.0 / shape.accum_steps)
    optimizer = build_optimizer(model, cfg.train)
    source, held = data_sources(cfg, model_cfg.vocab_size, str(run_dir) if run_dir else None)
    batches = TokenBatches(source, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch,
                           dp_rank=meshes.dp.get_local_rank(), dp_size=shape.dims.dp, name=data_name(cfg),
                           shuffle=window_order(cfg, cfg.data.path), seed=cfg.train.seed)
    tracker = rank_tracker(model, optimizer, env.device, env.rank, cfg.train.memory_tracking, cfg.train.memory_budget,
                           cfg.parallel.offload, pipeline=pipe is not None)
    meter = _meter(cfg, env, tracker)
    limit_cuda_memory(env.device, cfg.train.memory_budget)
    return Run(cfg=cfg, env=env, shape=shape, meshes=meshes, model=model, optimizer=optimizer,
               scheduler=build_scheduler(optimizer, cfg.train), batches=batches, tracker=tracker,
               flops_per_token=flops_per_token(model_cfg, cfg.train.seq_len),
               peak_flops=peak_flops(env.device, cfg.train.peak_flops), pipe=pipe, run_dir=run_dir, meter=meter,
               stash=None if pipe else gradient_stash(model, shape.zero_stage, shape.mixed_precision,
                                                      shape.accum_steps),
               host_reduce=_host_reduce(model, shape, pipe is not None, dist.get_backend(meshes.dp.get_group()),
                                        cfg.parallel.reduce_dtype),
               held_out=held_out_reader(cfg, held, meshes.dp.get_local_rank(), shape.dims.dp),
               context=(shape.dims.cp, meshes.world["cp"].get_local_rank()), init_from=weights)


def _host_reduce(model: nn.Module, shape: RunShape, pipelined: bool, backend: str,
                 reduce_dtype: str) -> HostReduceScatter | None:
    """meshfit's reduce-scatter for FSDP2 on gloo; in the background where the layout allows it."""
    background = reduces_in_background(shape.zero_stage, shape.dims.dp_shard * shape.dims.cp,
                                       shape.dims.dp_replicate > 1,
                                       shape.mixed_precision, pipelined, backend, reduce_dtype)
    # The pipeline schedule runs the backward itself, without begin() and finish() around it.
    assert not (background and pipelined)
    return host_reduce_scatter(model, backend, background)


def _meter(cfg: Config, env: RankEnv, tracker: Any) -> MemoryMeter:
    train = cfg.train  # memory_tracking=off with a CPU budget is refused by resolve_run
    return MemoryMeter(tracker, env.device, train.memory_tracking, train.memory_tracked_steps, train.memory_budget)


def _starting_weights(cfg: Config, model_cfg: Any) -> HFWeights | None:
    """model.init_from, read part by part as the layout places each parameter (checked before the start)."""
    if not cfg.model.init_from:
        return None
    from meshfit.config import ConfigError

    try:
        return HFWeights(cfg.model.init_from, model_cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
