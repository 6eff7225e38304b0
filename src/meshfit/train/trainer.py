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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshfit.config import Config
from meshfit.data.boundaries import Packed, counted
from meshfit.layout.data_parallel_kind import data_parallel_kind
from meshfit.models.loss import lm_loss
from meshfit.models.moe_stats import end_step
from meshfit.parallel.compile import compile_seconds, eager_blocks
from meshfit.parallel.data_parallel import set_micro_batch
from meshfit.parallel.moe_parts import sum_moe_grads, tp_routes_slices
from meshfit.train.checkpoint import Checkpointer
from meshfit.train.dist import RankEnv
from meshfit.train.evaluate import evaluate, evaluation_due
from meshfit.train.faults import Faults, StopRequest, Watchdog
from meshfit.train.grad_norm import clip_grad_norm, grad_squares
from meshfit.train.guard import StepGuard
from meshfit.train.metrics import MetricsLog
from meshfit.train.pipelined import pipeline_step
from meshfit.train.records import begin_run, compile_fields, step_record, summarize, write_result
from meshfit.train.trackers import open_trackers
from meshfit.train.run import Run, build_run
from meshfit.util.units import fmt_bytes
from meshfit.train.vote import Ballot, Vote


def _micro_step(run: Run, batch: Packed, sync: bool, scale: float | None) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns its loss (detached): the mean, or with `scale`
    (document masking) the sum times `scale` (see `loss_scale`)."""
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
            loss = _forward_backward(run, batch, scale)
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


def _forward_backward(run: Run, batch: Packed, scale: float | None) -> torch.Tensor:
    run.tracker.reset_mod_stats()  # MemTracker counts one root forward per reset
    run.tracker.phase = "forward"
    device = run.env.device
    # Loss parallelism: cross-entropy on vocabulary-sharded logits, in forward and backward.
    with loss_parallel() if run.cfg.parallel.loss_parallel else contextlib.nullcontext():
        logits = run.model(batch.inputs.to(device), **batch.model_kwargs(device))
        loss = lm_loss(logits, batch.targets.to(device), run.shape.model.vocab_size, scale)
        # Mixture-of-Experts load balancing trains inside the blocks (models/moe.AuxLossScaler), scaled as
        # this loss is (run.py sets it): not added here, not reported as loss.
        run.tracker.phase = "backward"
        (loss / run.shape.accum_steps).backward()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def loss_scale(run: Run, targets: torch.Tensor, read: bool) -> float | None:
    """Under data.document_mask, what each micro-batch's summed loss is multiplied by, so that the step's
    loss and gradients are the sum of every counted target's loss over the global batch divided by their
    global count (what one process computes on the whole batch), however the targets fall on ranks and
    micro-batches: count · (data-parallel replicas, whose gradients are averaged) · (micro-batches, whose
    losses the step averages) / global count. One all-reduce of the rank's count over the replicas. Also
    for prompt/response data (its prompt targets do not count). None otherwise: each micro-batch's mean,
    as every micro-batch then counts alike.

    `read` false (a dry run, on fake tensors): no count can be read; the scale of a batch without
    boundaries stands in."""
    if run.shape.eos_id is None and not run.batches.loss_masked:
        return None
    group = run.meshes.dp_cp
    steps = run.shape.microbatches if run.pipe is not None else run.shape.accum_steps
    if not read:
        return steps / targets.numel()
    count = counted(targets).to(run.env.device, torch.float64)
    dist.all_reduce(count, group=group.get_group())
    return group.size() * steps / max(float(count), 1.0)


def _kind(run: Run) -> str:
    dims = run.shape.dims
    return data_parallel_kind(run.shape.zero_stage, dims.dp * dims.cp, dims.tp, run.shape.mixed_precision)


def _ddp(run: Run) -> bool:
    return _kind(run) == "ddp"


def _token_sum(run: Run) -> Callable[[torch.Tensor], None] | None:
    """Sums a tensor in place over the ranks that see different tokens: the data-parallel ones, the cp
    ranks holding the other parts of their sequences, and the tp ranks under sequence parallelism (Mixture-
    of-Experts blocks count the slice they route; without it every tp rank counts the same tokens)."""
    dims = run.shape.dims
    groups = [run.meshes.dp_cp.get_group()] if dims.dp * dims.cp > 1 else []
    if tp_routes_slices(dims.tp, run.cfg.parallel.sp):
        groups.append(run.meshes.world["tp"].get_group())
    if not groups:
        return None

    def reduce(t: torch.Tensor) -> None:
        for group in groups:
            torch.distributed.all_reduce(t, group=group)
    return reduce


def _moe_sum(run: Run) -> Callable[[torch.Tensor], None] | None:
    """Sums the Mixture-of-Experts counts over the ranks that see different tokens (_token_sum) and, under
    a pipeline, over the stages (each holds the rows of its own blocks, zeros elsewhere): every rank gets
    every layer's."""
    dp_sum = _token_sum(run)
    if run.pipe is None:
        return dp_sum
    stages = run.meshes.world["pp"].get_group()

    def both(t: torch.Tensor) -> None:
        if dp_sum is not None:
            dp_sum(t)
        torch.distributed.all_reduce(t, group=stages)
    return both


def _moe_layers(run: Run) -> list[int] | None:
    """Every MoE layer of the model under a pipeline (a stage holds some); None: this rank holds them all."""
    model = run.shape.model
    return [i for i in range(model.n_layers) if model.is_moe_layer(i)] if run.pipe is not None else None


def _optimizer_step(run: Run, losses: list[torch.Tensor], guard: StepGuard | None, tracking: bool,
                    read: bool) -> tuple[torch.Tensor, Vote]:
    run.tracker.phase = "optimizer step"
    if tp_routes_slices(run.shape.dims.tp, run.cfg.parallel.sp):
        sum_moe_grads(run.model, run.meshes.world["tp"])  # MoE blocks routed a slice each (none: nothing)
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
    allowed = guard is None or guard.allow_step(vote.tally, grad_norm)
    # Mixture-of-Experts counts of the step, summed over the data-parallel ranks; the expert biases move
    # with the step (not on a skipped one).
    run.moe_counts = end_step(run.model, _moe_sum(run), update_bias=allowed, layers=_moe_layers(run),
                              experts=run.shape.model.moe_experts)
    if not allowed:
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
    batch = run.local_batch(inputs, targets)
    scale = loss_scale(run, batch.targets, read or guard is not None)
    tracking = run.meter is None or run.meter.tracking()
    try:
        # The per-operator tracker is a TorchDispatchMode, under which torch.compile cannot run: its steps
        # run the blocks eagerly, and their breakdown is an eager step's (the record says so).
        eager = tracking and run.tracker.per_operator and run.cfg.train.compile
        with run.tracker if tracking else contextlib.nullcontext(), eager_blocks(eager):
            if run.pipe is not None:
                run.tracker.reset_mod_stats()
                run.tracker.phase = "pipeline forward/backward"
                losses = [pipeline_step(run.pipe, batch, run.env.device, run.cfg.parallel.loss_parallel, scale=scale)]
            else:
                losses = [_micro_step(run, part, sync=(i == run.shape.accum_steps - 1), scale=scale)
                          for i, part in enumerate(batch.split(micro))]
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
            if run.init_from is not None and env.rank == 0:
                read = run.init_from
                print(f"model.init_from: rank 0 read {fmt_bytes(read.bytes_read)} of the weights (its part) in "
                      f"{read.seconds:.1f} s", flush=True)
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
    # No tracker run for a launch with no step left to train (e.g. resumed at train.stop_after).
    tracked = run.env.rank == 0 and run.run_dir is not None and run.step < end
    log = MetricsLog(run.run_dir / "metrics.jsonl" if run.run_dir else None, end, cfg.train.log_every,
                     enabled=run.env.rank == 0, start_step=run.step, tensorboard=cfg.metrics.tensorboard,
                     trackers=open_trackers(cfg, run.run_dir) if tracked else ())
    ok = False
    try:
        while run.step < end and not guard.stop_requested:
            watchdog.arm(f"step {run.step + 1}")
            faults.at_step_start(run.step + 1)
            run.history.append(train_step(run, guard))
            if ckpt.data and ckpt.data["changed"] and len(run.history) == 1:
                run.history[-1]["new_data"] = ckpt.data["changed"]  # --new-data: what changed, once
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
        ok = True
    finally:
        log.close(ok)
