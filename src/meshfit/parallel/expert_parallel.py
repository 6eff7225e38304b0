"""Expert parallelism: each MoE block's routed experts split over the `ep` ranks of the expert mesh.

The ep ranks are borrowed from the data-parallel shard ranks (torchtitan's "dp2ep"): every rank still
reads its own tokens; after routing, each rank sends the copies of its tokens to the rank holding their
expert and gets the outputs back (two all-to-alls per block in forward, two in backward). The experts'
parameters keep their global shape as DTensors `Shard(0)` over `ep`, so checkpoints reshard across ep.

Data parallelism of the expert shards: each rank's shard is FSDP-sharded (the layout's ZeRO stage) over the
ranks that hold the same experts, `edp` = dp_shard × cp / ep (with dp_replicate, HSDP), one FSDP unit per
block's experts (parallel/data_parallel.py), so ZeRO-3 gathers a layer's E/ep local experts, not all E. Where
E/ep does not split evenly over edp, FSDP splits each expert's rows instead of the expert dimension
(layout/expert_sharding.py), so no rank keeps or gathers padded experts.
Gradients: the backward all-to-all brings every ep rank's contribution to an expert's gradient to the rank
that holds it; FSDP's reduction over edp then gives the sum over every data-parallel rank, which is divided
by the full data-parallel size (FSDP's gradient divide factor), as the dense gradients are averaged.
Dividing by the edp count alone would leave expert gradients ep times too large (DeepSpeed-MoE's bug #5618).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from meshfit.models.moe import GroupedExperts, LocalDispatcher, MoE, Routed


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of rows with uneven (and zero) splits; its backward is the reverse all-to-all."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(rows, out_splits, in_splits, group))


class AllToAllDispatcher(LocalDispatcher):
    """Sorts the routed copies by expert as the local dispatcher does, then exchanges them within the ep
    group: rank r holds experts [r·E/ep, (r+1)·E/ep). Dropped copies (past capacity) stay home."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ranks = dist.get_world_size(group)

    def dispatch(self, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor, experts: int,
                 capacity_factor: float | None, balanced: bool = False) -> Routed:
        routed = super().dispatch(x, chosen, gates, experts, capacity_factor, balanced)
        local = experts // self.ranks
        sent, got = self._split_sizes(routed, local)  # per expert: what I send, what each rank sends me
        send = [sum(sent[r * local:(r + 1) * local]) for r in range(self.ranks)]
        recv = [sum(got[r * local:(r + 1) * local]) for r in range(self.ranks)]
        kept = sum(send)
        rows = _exchange(routed.tokens[:kept], recv, send, self.group)
        # Rank-major (each sender's block sorted by my experts) -> expert-major for the expert kernel.
        received = torch.tensor(got, device=x.device).view(self.ranks, local)
        expert_of = torch.arange(local, device=x.device).repeat(self.ranks).repeat_interleave(
            received.reshape(-1), output_size=sum(recv))
        order = expert_of.argsort(stable=True)
        routed.back = (order, send, recv, routed.tokens.shape[0])
        routed.tokens, routed.counts = rows[order], received.sum(0)
        return routed

    def _split_sizes(self, routed: Routed, local: int) -> tuple[list[int], list[int]]:
        """(copies I send to each expert, copies each ep rank sends to each of my experts, rank-major).

        Known on the host under balanced routing: every rank routes its equal share of tokens the same way,
        so each sends me what I would send myself (a dry run's fake tensors have no counts to read).
        Otherwise the counts are exchanged with one all-to-all and read back (a host sync)."""
        if routed.sizes is not None:
            me = dist.get_rank(self.group)
            return routed.sizes, routed.sizes[me * local:(me + 1) * local] * self.ranks
        received = torch.empty_like(routed.counts)
        dist.all_to_all_single(received, routed.counts, group=self.group)
        return routed.counts.tolist(), received.tolist()

    def combine(self, out: torch.Tensor, routed: Routed, tokens: int) -> torch.Tensor:
        order, send, recv, sorted_rows = routed.back
        rank_major = out.index_select(0, order.argsort())
        home = _exchange(rank_major, send, recv, self.group)
        padded = torch.cat([home, home.new_zeros(sorted_rows - home.shape[0], home.shape[-1])])
        return super().combine(padded, routed, tokens)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[GroupedExperts]:
    """On meta: shard every MoE block's routed experts over mesh["ep"] and give the block the all-to-all
    dispatcher. Returns the expert modules (FSDP shards them over the edp ranks: parallel/data_parallel.py)."""
    ep_mesh = mesh["ep"]
    dispatcher = AllToAllDispatcher(ep_mesh.get_group())
    modules = []
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.dispatcher = dispatcher
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            setattr(moe.experts, name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)))
        modules.append(moe.experts)
    return modules
