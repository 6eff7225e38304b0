"""FSDP2's gradient reduce-scatters on CPU ranks: an all-to-all and a sum, in gloo's threads where they can.

On gloo, meshfit reduce-scatters through `reduce_scatter`: one all-to-all of the unit's gradients and a sum
of the chunks received, 2-2.5x faster than gloo's own reduce-scatter (see there). `HostReduceScatter`, FSDP2's
public custom reduce-scatter hook (`set_custom_reduce_scatter`), runs it for every FSDP2 unit on gloo.

FSDP2 reduce-scatters each unit's gradients as soon as the unit's backward is done. On an accelerator the
collective runs on its own stream; on the host it is a blocking call, so every unit's backward waits for its
reduce-scatter, and the ranks meet once per unit: each meeting also absorbs how far the ranks have drifted
apart since the last one. DDP's bucketed all-reduce, by contrast, runs in the background and meets once.
So where the layout allows it (`kinds.reduces_in_background`), the hook issues the collective
asynchronously, and a unit's reduced gradient is not read until the collective is done:

- the next unit's reduce-scatter waits for the previous one before it allocates its own input, so at most
  one collective is in flight;
- `finish()`, after the backward, waits for the last one before anything (clipping, the optimizer, the
  next micro-batch) reads a gradient;
- FSDP2 adds a micro-batch's reduced shard into the gradient already there right after the collective is
  issued, which would read it too early. So before a micro-batch that reduces into existing gradients,
  `begin()` takes those gradients aside; each new shard, once its collective is done, is added into them
  (in the same order and dtype as FSDP2 would), and `finish()` puts the sums back.

The background applies only where FSDP2 reads nothing else of the reduced shard before it is set as the
gradient (no HSDP all-reduce, no cast, no pipeline schedule; meshfit sets no FSDP2 divide factor and no
all-reduce hook, and a collective that FSDP2 would follow by a division blocks), and not while a
post-accumulate hook reads it: the bf16 GradientStash of ZeRO-2 turns it off for its micro-batches.
Elsewhere every call blocks.

Memory: the chunks received take a buffer the size of the unit's input (gloo's own call copies its input
too). In the background, a unit's input, chunks and shard stay until the next unit's reduce-scatter starts,
through the next block's backward; CPU plans count both (planner/memory/estimate.py).
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

# The fallback for ops other than SUM and AVG is the call FSDP2 makes (torch 2.13 names it deprecated; its
# replacement is newer than 2.11).
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor` is deprecated")


class Waitable(Protocol):
    def wait(self) -> object: ...


class HostReduceScatter:
    """FSDP2's reduce-scatter on gloo, asynchronous where the layout allows it; see the module docstring.

    It has the two methods of FSDP2's ReduceScatter interface, which torch does not export publicly.
    """

    def __init__(self, params: list[nn.Parameter], background: bool) -> None:
        self.params = params
        self.background = background  # kinds.reduces_in_background: else every call blocks
        self.enabled = background  # off: the blocking call (a micro-batch whose shards a hook reads at once)
        self.pending: list[tuple[Waitable, list[nn.Parameter]]] = []
        self.aside: dict[nn.Parameter, torch.Tensor] = {}  # gradients of earlier micro-batches, by parameter
        for p in params:
            p.register_post_accumulate_grad_hook(self._reduced)

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # Called first for the unit's reduce-scatter input (then for its output): the previous unit's
        # collective finishes before this input exists, as the blocking call frees the previous input before
        # allocating this one.
        self._settle()
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        # FSDP2 never asks for async_op (it passes nothing it could wait on); whether the call blocks is
        # decided here. Any other op than AVG (a sum, or a pre-scaled sum) is followed by a division of the
        # output inside FSDP2, which must see the reduced values: those calls block.
        background = self.enabled and op == dist.ReduceOp.AVG
        work = reduce_scatter(output_tensor, input_tensor, group, op, async_op=background)
        if background:
            self.pending.append((work, []))
        return None

    @torch.no_grad()
    def _reduced(self, p: nn.Parameter) -> None:
        """FSDP2 has set p's gradient to a shard of the latest collective's output."""
        if self.enabled and self.pending:
            self.pending[-1][1].append(p)  # added into the earlier gradient once the collective is done
        elif p in self.aside:  # reduced by a blocking call: its values are there already
            _local(self.aside[p]).add_(_local(p.grad))
            p.grad = None

    def begin(self, enabled: bool) -> None:
        """Before a micro-batch's backward: gradients that FSDP2 would add into are taken aside."""
        self.enabled = enabled and self.background
        if not self.enabled:
            return
        for p in self.params:
            if p.grad is not None:
                self.aside[p] = p.grad
                p.grad = None

    def finish(self) -> None:
        """After the backward: every collective done, and the gradients of earlier micro-batches put back."""
        self._settle()
        for p, grad in self.aside.items():
            p.grad = grad
        self.aside.clear()

    def abandon(self) -> None:
        """After a forward or backward that raised: the gradients taken aside are put back as they were
        (the step is not taken), without waiting for collectives that peers may never join; gradients set
        to outputs those collectives never wrote are dropped."""
        for _, params in self.pending:
            for p in params:
                p.grad = None
        for p, grad in self.aside.items():
            p.grad = grad
        self.aside.clear()
        self.pending.clear()

    @torch.no_grad()
    def _settle(self) -> None:
        while self.pending:
            work, params = self.pending.pop(0)  # a wait that raises leaves no finished handle behind
            work.wait()
            for p in params:
                if p in self.aside:
                    _local(self.aside[p]).add_(_local(p.grad))
                    p.grad = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class AllToAllReduce:
    """A reduce-scatter on gloo as one all-to-all and a local sum (see `reduce_scatter`)."""

    def __init__(self, output: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool) -> None:
        self.output, self.op, self.size = output, op, dist.get_world_size(group)
        if input_tensor.numel() != output.numel() * self.size:
            raise ValueError(f"reduce_scatter: input of {input_tensor.numel()} elements for an output of "
                             f"{output.numel()} on {self.size} ranks (needs output × ranks)")
        # received[j]: rank j's chunk of this rank's shard.
        self.received = torch.empty_like(input_tensor)
        self.work = dist.all_to_all_single(self.received, input_tensor, group=group, async_op=async_op)

    @torch.no_grad()
    def wait(self) -> None:
        """Finish the exchange, then sum (in rank order) into the output; AVG divides by the group size.
        16-bit chunks are summed and divided in fp32 and rounded once."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        chunks = self.received.view(self.size, *self.output.shape)
        if self.op == dist.ReduceOp.AVG and self.output.dtype != torch.float32:
            self.output.copy_(torch.sum(chunks, dim=0, dtype=torch.float32).div_(self.size))
        else:
            torch.sum(chunks, dim=0, out=self.output)
            if self.op == dist.ReduceOp.AVG:
                self.output.div_(self.size)
        del self.received


def reduce_scatter(output: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                   op: dist.ReduceOp, async_op: bool = False) -> Waitable | None:
    """reduce_scatter_tensor(output, input_tensor) for gloo: with `async_op` the handle to wait on, else None.

    gloo's own reduce-scatter takes 2-2.5x the time of an all-to-all of the same buffer followed by the
    sum of the received chunks (2 gloo ranks, 1-16 MiB fp32 buffers: 4.3 vs 2.0 ms at 3 MiB, 21.9 vs
    9.7 ms at 16 MiB; 4 ranks: 9.1 vs 3.0 ms at 3 MiB), and more than an all-reduce of the whole buffer.
    Both move (N-1)/N of the buffer per rank; the sum is one pass over memory. The received chunks take one
    buffer the size of the input until the sum (gloo's own call copies its input too). Ops other than SUM
    and AVG go to gloo's call; a rank outside `group` takes no part, as in torch's collectives.
    """
    if dist.get_rank(group) < 0:
        return None
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        return dist.reduce_scatter_tensor(output, input_tensor, op=op, group=group, async_op=async_op)
    handle = AllToAllReduce(output, input_tensor, group, op, async_op)
    if not async_op:
        handle.wait()
        return None
    return handle


def host_reduce_scatter(model: nn.Module, backend: str, background: bool) -> HostReduceScatter | None:
    """Install HostReduceScatter on every FSDP2 unit of `model` (a stage list of a pipeline too) on gloo,
    in the background where the layout allows it (`background`: kinds.reduces_in_background); else None."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if backend != "gloo" or not units:
        return None
    comm = HostReduceScatter(list(model.parameters()), background)
    for unit in units:
        unit.set_custom_reduce_scatter(comm)
    return comm
