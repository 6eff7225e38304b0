"""Mixture-of-Experts blocks on ranks that each hold a part of every sequence.

Context parallelism gives each cp rank two chunks of every sequence; sequence parallelism gives each tp
rank a slice of the sequence between the tensor-parallel regions, and a MoE block (whole on every tp rank,
parallel/tensor_parallel.py) routes the slice it holds. Routing is per token, so the block computes the
same thing on a part as on the whole, except for what it sums over the tokens:

* The auxiliary loss (not linear in the tokens): `SequenceParts` gives the block the whole sequences'
  expert fractions and mean probabilities (one all-reduce over the ranks holding the parts), so the loss is
  one process's on every part. Its gradient flows through this part's mean probabilities only, shaped for
  how the layout reduces gradients: cp ranks' gradients are averaged (FSDP over dp × cp), tp ranks' are
  summed (below), so each part carries the whole loss's gradient times cp / (cp · tp).
* The router's, shared experts' and routed experts' gradients hold this slice's tokens only under sequence
  parallelism: `sum_moe_grads` sums them over tp after the step's last backward (the cp ranks' join the
  data-parallel average as every dense gradient does).
* Tokens per expert (models/moe_stats.py): the trainer sums them over every rank holding a part.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshfit.models.moe import MoE


class SequenceParts:
    """The whole sequences' expert fractions and mean probabilities from one part's (every part holds as
    many tokens): the mean over the 1-D `mesh` of the ranks holding the parts, of which `summed` (tp under
    sequence parallelism) have their gradients summed rather than averaged."""

    def __init__(self, mesh: DeviceMesh, summed: int) -> None:
        self.parts = mesh.size()
        self.summed = summed
        self._group = mesh.get_group()

    def __call__(self, fraction: torch.Tensor, mean_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        whole = torch.stack([fraction, mean_probs]).detach()
        dist.all_reduce(whole, group=self._group)
        whole = whole / self.parts
        share = mean_probs / self.summed
        # The value is the whole sequences'; the gradient reaches this part's probabilities only.
        return whole[0], share + (whole[1] - share.detach())


def tp_routes_slices(tp: int, sp: bool) -> bool:
    """Whether each tp rank's MoE blocks route their own slice of the sequence (sequence parallelism)."""
    return tp > 1 and sp


def parts_mesh(world: DeviceMesh, cp: int, tp: int, sp: bool) -> DeviceMesh | None:
    """The ranks holding the parts of the same sequences: cp, × tp under sequence parallelism; None when
    every rank holds whole sequences."""
    split_tp = tp_routes_slices(tp, sp)
    if cp > 1 and split_tp:
        return world["cp", "tp"]._flatten("cp_tp")
    if cp > 1:
        return world["cp"]
    return world["tp"] if split_tp else None


def apply_sequence_parts(model: nn.Module, mesh: DeviceMesh, summed: int) -> None:
    """Give every MoE block of `model` the whole sequences' routing statistics over `mesh` (in place)."""
    parts = SequenceParts(mesh, summed)
    for module in model.modules():
        if isinstance(module, MoE):
            module.sequence_parts = parts


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def sum_moe_grads(model: nn.Module, tp: DeviceMesh) -> None:
    """Under sequence parallelism, after the step's last backward: sum every MoE block's gradients (router,
    shared and routed experts: whole, or FSDP or ep shards that every tp rank holds alike) over `tp`, each
    in place. One all-reduce per gradient, all in flight at once: packing them into one buffer would add a
    copy of every MoE gradient at the step's peak (27.7 GiB per rank for Qwen3-30B-A3B at dp_shard 4 × tp 2
    × ep 4, measured by the dry run)."""
    grads = [_local(p.grad) for m in model.modules() if isinstance(m, MoE) for p in m.parameters()
             if p.grad is not None]
    group = tp.get_group()
    works = [dist.all_reduce(g, group=group, async_op=True) for g in grads]
    for work in works:
        work.wait()
