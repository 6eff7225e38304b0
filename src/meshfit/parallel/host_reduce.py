"""On CPU ranks, FSDP2's gradient reduce-scatters run in gloo's threads while the backward goes on.

FSDP2 reduce-scatters each unit's gradients as soon as the unit's backward is done. On an accelerator the
collective runs on its own stream; on the host it is a blocking call, so every unit's backward waits for its
reduce-scatter, and the ranks meet once per unit: each meeting also absorbs how far the ranks have drifted
apart since the last one. DDP's bucketed all-reduce, by contrast, runs in the background and meets once.

`HostReduceScatter` is FSDP2's public custom reduce-scatter hook (`set_custom_reduce_scatter`) issuing the
collective asynchronously. A unit's reduced gradient is not read until the collective is done:

- the next unit's reduce-scatter waits for the previous one before it allocates its own input, so at most
  one collective is in flight, and its input is freed before the next one exists, as with the blocking call;
- `finish()`, after the backward, waits for the last one before anything (clipping, the optimizer, the
  next micro-batch) reads a gradient;
- FSDP2 adds a micro-batch's reduced shard into the gradient already there right after the collective is
  issued, which would read it too early. So before a micro-batch that reduces into existing gradients,
  `begin()` takes those gradients aside; each new shard, once its collective is done, is added into them
  (in the same order and dtype as FSDP2 would), and `finish()` puts the sums back.

It applies only where FSDP2 reads nothing else of the reduced shard before it is set as the gradient
(kinds.reduces_in_background says where; meshfit sets no FSDP2 divide factor and no all-reduce hook, and a
collective that FSDP2 would follow by a division blocks), and not while a post-accumulate hook reads it:
the bf16 GradientStash of ZeRO-2 turns it off for its micro-batches.

Memory: with earlier micro-batches' gradients, a unit's reduced shard waits next to them until the next
unit's reduce-scatter starts (one unit's shard more than the blocking call holds during a block's backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


class HostReduceScatter:
    """FSDP2's reduce-scatter, issued asynchronously on gloo; see the module docstring.

    It has the two methods of FSDP2's ReduceScatter interface, which torch does not export publicly.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.enabled = True  # off: the blocking call (a micro-batch whose shards a hook reads at once)
        self.pending: list[tuple[dist.Work, list[nn.Parameter]]] = []
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
        # FSDP2 never asks for async_op (it returns nothing it could wait on); whether the call blocks is
        # decided here. Any other op than AVG (a sum, or a pre-scaled sum) is followed by a division of the
        # output inside FSDP2, which must see the reduced values: those calls block.
        background = self.enabled and op == dist.ReduceOp.AVG
        work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                          async_op=background)
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
        self.enabled = enabled
        if not enabled:
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
        (the step is not taken), without waiting for collectives that peers may never join."""
        for p, grad in self.aside.items():
            p.grad = grad
        self.aside.clear()
        self.pending.clear()

    @torch.no_grad()
    def _settle(self) -> None:
        for work, params in self.pending:
            work.wait()
            for p in params:
                if p in self.aside:
                    _local(self.aside[p]).add_(_local(p.grad))
                    p.grad = None
        self.pending.clear()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def host_reduce_scatter(model: nn.Module, background: bool) -> HostReduceScatter | None:
    """Install HostReduceScatter on every FSDP2 unit of `model` where the layout reduces in the background
    (`background`: kinds.reduces_in_background), else None."""
    if not background or not isinstance(model, FSDPModule):
        return None
    comm = HostReduceScatter(list(model.parameters()))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(comm)
    return comm
