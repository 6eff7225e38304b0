"""Validation loss: the model's mean loss over the held-out tokens, under any layout.

An evaluation runs after every train.eval_every-th optimizer step (counted from the run's first step, so
a resumed run keeps the schedule), reads the same train.eval_batches global batches every time
(data/heldout.py), and leaves training exactly as it found it:

* forward only, under ``torch.no_grad()``: no gradient is made or touched, no optimizer state either;
  DDP prepares no gradient reduction without grad mode, and the pipeline runs torch's forward-only pass
  of its schedule (`schedule.eval`);
* every module in eval mode (dropout off), and each back in the mode it had afterwards;
* FSDP2 modules resharded afterwards: ZeRO-1/2 keep the gathered weights after a forward until the
  step's last backward, which an evaluation has not; without the reshard a rank would hold whole weights
  from the evaluation until the next step's backward (through a checkpoint save, say), which is more
  than its layout holds between steps.

Each rank adds up its per-token losses and counts its tokens; one all-reduce over the world sums both,
so the mean is over every held-out token whatever the layout (tensor-parallel ranks hold the same loss
and count the same tokens, which leaves the ratio unchanged; only the last pipeline stage has a loss).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshfit.data.boundaries import Packed, counted
from meshfit.layout.schedules import v_shaped
from meshfit.models.loss import lm_loss
from meshfit.train.pipelined import pipeline_step

if TYPE_CHECKING:  # the trainer imports this module
    from meshfit.train.run import Run


def evaluation_due(run: Run) -> bool:
    """After this step (run.step, counted over the whole run) an evaluation runs."""
    every = run.cfg.train.eval_every
    return run.held_out is not None and every > 0 and run.step % every == 0


def evaluate(run: Run) -> dict[str, Any]:
    """The validation loss on every rank (the same value), and how long it took: the fields the step's
    metrics record gains."""
    start = time.perf_counter()
    modes = [(module, module.training) for module in run.model.modules()]
    run.model.eval()
    try:
        with torch.no_grad():
            total = torch.zeros((), dtype=torch.float64, device=run.env.device)
            tokens = 0
            for inputs, targets in run.held_out:
                batch = run.local_batch(inputs, targets)
                total += _loss_sum(run, batch)
                tokens += int(counted(batch.targets))
            holds_loss = run.pipe is None or run.pipe.last
            summed = torch.stack([total, torch.tensor(float(tokens if holds_loss else 0), dtype=torch.float64,
                                                      device=run.env.device)])
            dist.all_reduce(summed)  # the one collective: Σ loss and Σ tokens over every rank
    finally:
        for module, training in modes:
            module.training = training
        _reshard(run.model)
    loss_sum, count = summed.cpu().tolist()
    return {"val_loss": loss_sum / count, "val_time_s": time.perf_counter() - start}


def _loss_sum(run: Run, batch: Packed) -> torch.Tensor:
    """Σ of this rank's per-token losses over one batch (fp64), the targets a document mask ignores left
    out; zero on ranks without the last stage."""
    device, use_lp = run.env.device, run.cfg.parallel.loss_parallel
    if run.pipe is not None:
        v_schedule = v_shaped(run.cfg.pipeline.schedule)
        # Each micro-batch's summed loss times their number: the mean the schedule returns is their sum.
        with _forward_actions_only(run.pipe.schedule) if v_schedule else contextlib.nullcontext():
            mean = pipeline_step(run.pipe, batch, device, use_lp, forward_only=True,
                                 scale=float(run.shape.microbatches))
        return mean.double()
    total = torch.zeros((), dtype=torch.float64, device=device)
    # Loss parallelism: cross-entropy on vocabulary-sharded logits, as in training.
    with loss_parallel() if use_lp else contextlib.nullcontext():
        for part in batch.split(run.shape.micro_batch):
            logits = run.model(part.inputs.to(device), **part.model_kwargs(device))
            loss = lm_loss(logits, part.targets.to(device), run.shape.model.vocab_size, scale=1.0)
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            total += loss.double()
    return total


# The actions of a torch pipeline schedule that belong to the backward (torch's _ComputationType values).
_BACKWARD_ACTIONS = frozenset({"B", "I", "W", "SEND_B", "RECV_B", "REDUCE_GRAD"})


@contextlib.contextmanager
def _forward_actions_only(schedule: Any) -> Iterator[None]:
    """The V schedules' own action lists, less their backward actions, for the length of one `eval`.

    torch 2.13's `schedule.eval` runs a schedule's backward actions as no-ops, but where a rank holds two
    adjacent stages (the V schedules' special case) it still hands the backward's input gradient from one
    to the other and fails ("can't steal_bwd_input if this stage doesn't have backward"). Without the
    backward actions the same schedule runs its forwards, sends and receives in its own order: a forward
    waits only on the forward of the stage before it, so the order cannot deadlock.
    """
    order = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {rank: _forwards(actions) for rank, actions in order.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order


def _forwards(actions: list[Any]) -> list[Any]:
    kept = []
    for action in actions:
        # An overlapped forward-and-backward (DualPipeV) keeps its forward half.
        for part in action.sub_actions or [action]:
            if part.computation_type not in _BACKWARD_ACTIONS:
                kept.append(part)
    return kept


def _reshard(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # not recursive: every FSDP module is resharded on its own
