"""The training loop that runs on every rank.

One optimizer step: the rank's part of the global batch is split into micro-batches; each runs forward and
backward (gradient synchronization only on the last one); then gradients are clipped, the optimizer steps
and gradients are freed. Steps are measured under the rank's memory tracker, which also enforces the
memory budget on CPU, when `train.memory_tracking` says so (memory/meter.py), and rank 0 writes one metrics
record with every rank's peak memory breakdown, measured or carried over.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshfit.config import Config
from meshfit.data import TokenBatches
from meshfit.data.heldout import HeldOut
from meshfit.memory.meter import MemoryMeter, rank_tracker
from meshfit.memory.tracker import limit_cuda_memory
from meshfit.models import build_model, flops_per_token
from meshfit.parallel.dims import Meshes
from meshfit.parallel.data_parallel import GradientStash, gradient_stash, set_micro_batch
from meshfit.parallel.host_reduce import HostReduceScatter, host_reduce_scatter
from meshfit.parallel.compile import compile_seconds, eager_blocks
from meshfit.parallel.context_parallel import shard_sequence
from meshfit.parallel.kinds import data_parallel_kind, reduces_in_background
from meshfit.parallel.parallelize import parallelize
from meshfit.train.checkpoint import Checkpointer
from meshfit.train.dist import RankEnv
from meshfit.train.evaluate import evaluate, evaluation_due
from meshfit.train.faults import Faults, StopRequest, Watchdog
from meshfit.train.grad_norm import clip_grad_norm, grad_squares
from meshfit.train.guard import StepGuard
from meshfit.train.held_out import data_sources, held_out_reader
from meshfit.train.loss import lm_loss
from meshfit.train.metrics import MetricsLog, peak_flops
from meshfit.train.optim import build_optimizer, build_scheduler
from meshfit.train.pipelined import Pipe, build_pipeline, pipeline_step
from meshfit.train.shape import RunShape, resolve_run
from meshfit.train.records import begin_run, compile_fields, step_record, summarize, write_result
from meshfit.train.vote import Ballot, Vote


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
    host_reduce: HostReduceScatter | None = None  # FSDP2's reduce-scatters on CPU ranks (host_reduce.py)
    held_out: HeldOut | None = None  # validation batches (train.eval_every > 0)
    context: tuple[int, int] = (1, 0)  # (parallel.cp, this rank's index along it)

    def local_tokens(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a batch's sequences: all of them, or under context parallelism its chunks."""
        cp, rank = self.context
        if cp == 1:
            return inputs, targets
        return shard_sequence(inputs, cp, rank), shard_sequence(targets, cp, rank)


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
    optimizer = build_optimizer(model, cfg.train)
    source, held = data_sources(cfg, model_cfg.vocab_size, str(run_dir) if run_dir else None)
    # Named by data.path: tokenized text is an in-memory array, which would otherwise be "token array".
    batches = TokenBatches(source, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch,
                           dp_rank=meshes.dp.get_local_rank(), dp_size=shape.dims.dp,
                           name=cfg.data.path if cfg.data.source != "synthetic" else None)
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
               context=(shape.dims.cp, meshes.world["cp"].get_local_rank()))


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


def _starting_weights(cfg: Config, model_cfg: Any) -> dict[str, torch.Tensor] | None:
    if not cfg.model.init_from:
        return None
    from meshfit.config import ConfigError
    from meshfit.models.hf_weights import load_hf

    try:
        return load_hf(cfg.model.init_from, model_cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _micro_step(run: Run, inputs: torch.Tensor, targets: torch.Tensor, sync: bool) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns its mean loss (detached)."""
    no_sync = getattr(run.model, "no_sync", None)
    ctx = contextlib.nullcontext() if (sync or no_sync is None) else no_sync()
    set_micro_batch(run.model, run.shape.zero_stage, last=sync)
    if run.stash is not None:
        run.stash.begin(last=sync)
    if run.host_reduce is not None:
        # The stash reads each reduced shard as soon as FSDP2 sets it: those micro-batches reduce blocking.
        run.host_reduce.begin(enabled=run.stash is None or sync)
    try:
        with ctx:
            loss = _forward_backward(run, inputs, targets)
    except BaseException:
        if run.host_reduce is not None:
            run.host_reduce.abandon()  # no gradient of an earlier micro-batch stays hidden
        raise
    if run.host_reduce is not None:
        run.host_reduce.finish()
    if run.stash is not None:
        if not sync:
            run.tracker.claim_gradients(run.stash.stash())
        else:
            run.stash.merge()
    return loss.detach()


def _forward_backward(run: Run, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    run.tracker.reset_mod_stats()  # MemTracker counts one root forward per reset
    run.tracker.phase = "forward"
    # Loss parallelism: cross-entropy on vocabulary-sharded logits, in forward and backward.
    with loss_parallel() if run.cfg.parallel.loss_parallel else contextlib.nullcontext():
        logits = run.model(inputs.to(run.env.device))
        loss = lm_loss(logits, targets.to(run.env.device), run.shape.model.vocab_size)
        run.tracker.phase = "backward"
        (loss / run.shape.accum_steps).backward()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _kind(run: Run) -> str:
    dims = run.shape.dims
    return data_parallel_kind(run.shape.zero_stage, dims.dp * dims.cp, dims.tp, run.shape.mixed_precision)


def _ddp(run: Run) -> bool:
    return _kind(run) == "ddp"


def _optimizer_step(run: Run, losses: list[torch.Tensor], guard: StepGuard | None, tracking: bool,
                    read: bool) -> tuple[torch.Tensor, Vote]:
    run.tracker.phase = "optimizer step"
    params = list(run.model.parameters())
    squares = grad_squares(params, run.env.world_size // run.shape.dims.pp)
    local_ok = guard.locally_finite(losses, squares) if guard is not None else True
    if _ddp(run) and tracking:
        run.tracker.claim_gradients(params)
    holds_loss = run.pipe is None or run.pipe.last
    stop, saving = guard.requests() if guard is not None else (False, False)
    vote = Vote(Ballot(square=squares.weighted(), loss=torch.stack(losses).mean() if holds_loss else None,
                       nonfinite=not local_ok, stop=stop, saving=saving,
                       compiled=run.cfg.train.compile and compile_seconds() > run.compiling_since,
                       counter=run.meter.reading() if run.meter is not None and read else None), run.env.device)
    grad_norm = clip_grad_norm(squares, run.cfg.train.grad_clip, vote.square, read=read)
    if guard is not None and not guard.allow_step(vote.tally, grad_norm):
        return grad_norm, vote  # skipped: gradients dropped, parameters, optimizer and schedule untouched
    run.optimizer.step()
    run.scheduler.step()
    # DDP's gradients are views into its buckets: zeroing them in place keeps them so (the next
    # micro-batches accumulate into the buckets); freeing them would add a second copy next to the buckets.
    # DDP re-orders its buckets once, at the forward after a launch's first step, and views still held
    # then keep the old buckets alive next to the new ones. Without gradient accumulation they are freed
    # after the first step; with it that step's next micro-batches would allocate whole new gradients
    # outside the buckets, a larger cost than the old buckets at the start of the forward.
    accumulating = run.shape.accum_steps > 1 or (run.pipe is not None and run.shape.microbatches > 1)
    run.optimizer.zero_grad(set_to_none=not _ddp(run) or (run.launch_steps == 0 and not accumulating))
    run.launch_steps += 1
    return grad_norm, vote


def train_step(run: Run, guard: StepGuard | None = None) -> dict[str, Any]:
    """One optimizer step; returns its metrics record (identical on every rank but for a compiled run's
    `compile_s`, this rank's own)."""
    start = time.perf_counter()
    if run.cfg.train.compile:
        run.compiling_since = compile_seconds()
    lr = run.scheduler.get_last_lr()[0]
    inputs, targets = run.batches.next_batch()
    _, grad_norm, vote = measured_step(run, inputs, targets, guard, read=True)
    tally = vote.tally
    elapsed = time.perf_counter() - start
    run.step += 1
    record = step_record(run, tally, float(grad_norm), lr, elapsed)
    if run.cfg.train.compile:
        compile_fields(run, record, compile_seconds() - run.compiling_since, tally.compiled)
    if guard is not None and guard.skipped:
        record["skipped"] = True
    return record


def measured_step(run: Run, inputs: torch.Tensor, targets: torch.Tensor,
                  guard: StepGuard | None = None, read: bool = False) -> tuple[list[torch.Tensor], torch.Tensor, Vote]:
    """Forward, backward and optimizer step of one batch under the rank's tracker (one peak window).

    Returns the micro-batch losses, the gradient norm and the step's vote (vote.py). `read`: the step's
    values may be read back to the host (training; a dry run's are fake), as the guard (training, not dry
    runs) does with the vote before the optimizer step (guard.py).
    """
    micro = run.shape.micro_batch
    inputs, targets = run.local_tokens(inputs, targets)
    tracking = run.meter is None or run.meter.tracking()
    try:
        # The per-operator tracker is a TorchDispatchMode, under which torch.compile cannot run: its steps
        # run the blocks eagerly, and their breakdown is an eager step's (the record says so).
        eager = tracking and run.tracker.per_operator and run.cfg.train.compile
        with run.tracker if tracking else contextlib.nullcontext(), eager_blocks(eager):
            if run.pipe is not None:
                run.tracker.reset_mod_stats()
                run.tracker.phase = "pipeline forward/backward"
                losses = [pipeline_step(run.pipe, inputs, targets, run.env.device, run.cfg.parallel.loss_parallel)]
            else:
                losses = [
                    _micro_step(run, x, y, sync=(i == run.shape.accum_steps - 1))
                    for i, (x, y) in enumerate(zip(inputs.split(micro), targets.split(micro), strict=True))
                ]
            if guard is not None:
                losses = guard.after_backward(losses)
            grad_norm, vote = _optimizer_step(run, losses, guard, tracking, read or guard is not None)
            if tracking:
                run.tracker.settle()
    except torch.OutOfMemoryError:
        # On CUDA the allocator enforces the budget; report it like the tracker does on CPU.
        if run.cfg.train.memory_budget is None:
            raise
        raise run.tracker.over_budget_error() from None
    return losses, grad_norm, vote


def train(cfg: Config, env: RankEnv, run_dir: Path | None) -> dict[str, Any]:
    """Train `cfg` on this rank; rank 0 writes config.yaml (once training begins), metrics.jsonl and
    result.json into run_dir.

    Resumes from a checkpoint when asked (checkpoint.resume / resume_from) or when torchrun restarted the
    run after a failure; saves every checkpoint.interval steps, at the end, and when a signal asks to stop.
    """
    faults = Faults(env.rank)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    stop = StopRequest()
    stop.install()
    writer = env.rank == 0 and run_dir is not None
    with Watchdog(cfg.train.timeout_s, env.rank, run_dir) as watchdog:
        try:
            watchdog.arm("building the run")
            run = build_run(cfg, env, run_dir)
            ckpt = Checkpointer(cfg, env.rank, run_dir, faults)
            watchdog.arm("loading the checkpoint")
            run.step = run.start_step = ckpt.restore(run, restarted=attempt > 0)
            if writer:
                begin_run(cfg, run_dir, run.start_step)
            try:
                guard = StepGuard(run, faults, stop, ckpt)
                _loop(run, ckpt, guard, watchdog, faults)
            except BaseException as exc:
                if writer:  # the run began: its result says it failed (the failure report says why)
                    write_result(run_dir, {**summarize(run), "status": "failed", "error": str(exc),
                                            "attempt": attempt})
                raise
        finally:
            stop.uninstall()
    result = summarize(run)
    result.update(attempt=attempt, checkpoint=str(ckpt.last_folder) if ckpt.last_folder else None,
                  checkpoint_save_s=ckpt.save_seconds, status="finished")
    end = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    if guard.stop_requested and run.step < end:  # every rank agreed to stop before the launch's last step
        result.update(status="interrupted", signal=stop.signal_name,
                      stopped=f"{stop.signal_name or 'stop request'} after step {run.step}")
    if writer:
        write_result(run_dir, result)
    return result


def _loop(run: Run, ckpt: Checkpointer, guard: StepGuard, watchdog: Watchdog, faults: Faults) -> None:
    cfg = run.cfg
    end = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    log = MetricsLog(run.run_dir / "metrics.jsonl" if run.run_dir else None, end, cfg.train.log_every,
                     enabled=run.env.rank == 0, start_step=run.step, tensorboard=cfg.metrics.tensorboard)
    try:
        while run.step < end and not guard.stop_requested:
            watchdog.arm(f"step {run.step + 1}")
            faults.at_step_start(run.step + 1)
            run.history.append(train_step(run, guard))
            if evaluation_due(run):
                watchdog.arm(f"the evaluation after step {run.step}")
                run.history[-1].update(evaluate(run))
            log.record(run.history[-1])
            if ckpt.due(run.step) and not guard.stop_requested:
                watchdog.arm(f"the checkpoint save after step {run.step}")
                ckpt.save(run, run.step)
        if ckpt.enabled and (cfg.checkpoint.at_end or guard.stop_requested) and ckpt.last_saved != run.step \
                and run.step > run.start_step:
            watchdog.arm(f"the checkpoint save after step {run.step}")
            ckpt.save(run, run.step)
        watchdog.arm("finishing the checkpoint save")
        ckpt.wait()
    finally:
        log.close()
