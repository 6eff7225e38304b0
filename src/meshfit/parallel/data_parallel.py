"""Data parallelism over the dp_replicate × dp_shard mesh: DDP, ZeRO-1/2/3 (FSDP2), HSDP, offload, bf16.

Context-parallel ranks hold the same weights and see other parts of the same sequences: they join the
gradient averaging, and FSDP shards over dp_shard × cp (N below).

What each stage keeps on a rank (N = dp_shard), all sharded state split evenly element by element:

  stage 0  DDP                          full weights, full gradients (views into DDP's buckets), full states
  stage 1  FSDP2, reshard_after_fwd=F   weights, fp32 master weights and optimizer states 1/N between steps;
           + no gradient sync and no    every block is gathered once per step (16-bit under mixed precision)
           re-shard until the last      and kept until the last micro-batch's backward; gradients stay full
           micro-batch                  (16-bit) and unsynchronised until then, reduce-scattered once
  stage 2  FSDP2, reshard_after_fwd=F   as stage 1, but gradients are reduce-scattered to 1/N after every
           + no re-shard until the      micro-batch's backward (fp32 shards under mixed precision, which wait
           last micro-batch             in bf16 between micro-batches: GradientStash)
  stage 3  FSDP2, reshard_after_fwd=T   each block gathered just in time in forward and again in backward,
                                        freed right after; gradients reduce-scattered every micro-batch

With dp_replicate > 1 the sharded state is replicated across dp_replicate groups (HSDP).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from meshfit.layout.data_parallel_kind import stashes_gradients
from meshfit.layout.expert_sharding import expert_shard_dim
from meshfit.models.moe import GroupedExperts
from meshfit.parallel.dims import Meshes, ParallelDims
from meshfit.parallel.fsdp_units import sub_units

# torch 2.13 deprecates broadcast_buffers for forward_sync_buffers (which still syncs buffers once, at
# construction, with the parameters); earlier versions know only broadcast_buffers.
_NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                           if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                           else {"broadcast_buffers": False})


def apply_ddp(model: nn.Module, meshes: Meshes) -> nn.Module:
    """Wrap a materialized model in DDP over the whole data-parallel group (stage 0).

    gradient_as_bucket_view: gradients are views into DDP's flat communication buckets, so the buckets
    are the gradients rather than a second copy of them. No buffer sync before each forward: meshfit's
    models hold only constant buffers (RoPE tables), built the same way on every rank, so rank 0's need
    not be sent again before every forward (one collective per micro-batch).
    """
    device = next(model.parameters()).device
    device_ids = None if device.type == "cpu" else [device]
    # Nor at construction: under context parallelism each rank's RoPE table holds its own positions.
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, [name for name, _ in model.named_buffers()])
    return DistributedDataParallel(model, process_group=meshes.dp_cp.get_group(), device_ids=device_ids,
                                   gradient_as_bucket_view=True, **_NO_FORWARD_BUFFER_SYNC)


def fsdp_mesh(dims: ParallelDims, meshes: Meshes) -> DeviceMesh:
    """1-D mesh over dp_shard (× cp) (FSDP), or the 2-D (dp_replicate, dp_shard (× cp)) mesh (HSDP; with
    dp_shard × cp = 1, replicas)."""
    if dims.dp_replicate > 1:
        return meshes.world["dp_replicate", "dp_shard_cp" if dims.cp > 1 else "dp_shard"]
    return meshes.shard


def expert_fsdp_mesh(dims: ParallelDims, meshes: Meshes) -> DeviceMesh:
    """What FSDP shards the expert-parallel shards over: the expert mesh's edp ranks (dp_shard × cp / ep), or
    (dp_replicate, edp) as HSDP."""
    assert meshes.experts is not None
    return meshes.experts["dp_replicate", "edp"] if dims.dp_replicate > 1 else meshes.experts["edp"]


def precision_policy(stage: int, mixed_precision: bool, reduce_dtype: str = "fp32") -> MixedPrecisionPolicy:
    """bf16 compute copies of the weights; gradients reduced into fp32 shards, except at stage 1.

    Stage 1 accumulates full gradients across micro-batches before any reduction: they stay 16-bit (the
    ZeRO paper's 2 bytes per parameter) and are reduced in bf16; stages 2 and 3 reduce every micro-batch
    in fp32, or with ``reduce_dtype="compute"`` in bf16 as DeepSpeed does by default (no fp32 copy of a
    unit's gradients before its reduce-scatter, half the bytes on the wire; the sum is rounded to bf16).
    """
    if not mixed_precision:
        return MixedPrecisionPolicy()
    low = stage == 1 or reduce_dtype == "compute"
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16 if low else torch.float32)


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
    """Expert parallelism's routed experts under FSDP: each block's expert module (its ep shard, a DTensor over
    the expert mesh's ep dimension) is a unit of its own, sharded over the expert data-parallel `mesh`
    (edp, or (dp_replicate, edp) as HSDP), with its gradients divided by `divide_factor`. FSDP splits the
    dimension layout/expert_sharding.py names: an expert's rows (dim 1) where the local experts do not split
    evenly over edp, so no rank keeps padding."""

    modules: list[nn.Module]
    mesh: DeviceMesh
    # The full data-parallel size (dp × cp): the backward all-to-all has already summed the ep ranks'
    # contributions, so dividing by the edp ranks alone would leave expert gradients ep times too large.
    divide_factor: int


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, stage: int, mixed_precision: bool, offload: bool,
               reduce_dtype: str = "fp32", max_unit_params: int | None = None,
               experts: ExpertSharding | None = None) -> None:
    """fully_shard each transformer block (as smaller units when it holds more than `max_unit_params`
    parameters: parallel/fsdp_units.py), then the root (embeddings, final norm, head), on meta.
    `experts`: expert-parallel shards, sharded over their own mesh first (ExpertSharding)."""
    # Pinned host memory needs an accelerator; on a CPU-only build plain memory is the host memory.
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    # Stage 0 (replicas of tensor-parallel weights): the gathered compute copies are freed after each
    # block, as at stage 3; the "shards" are whole.
    mp_policy = precision_policy(stage, mixed_precision, reduce_dtype)
    kwargs = dict(reshard_after_forward=stage in (0, 3), offload_policy=policy)
    # Blocks take 16-bit hidden states from the embedding or the block before; casting their other inputs
    # would make a 16-bit copy of Llama's fp32 RoPE tables in every block (and rotate in 16 bits).
    block_policy = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    expert_units = set(experts.modules) if experts is not None else set()
    # Routed experts that stay in their block's units (no expert parallelism) split by the same rule.
    in_blocks = _expert_placements([m for m in model.modules() if isinstance(m, GroupedExperts)
                                    and m not in expert_units], mesh)
    for block in model.layers.values():
        for unit in (m for m in block.modules() if m in expert_units):
            fully_shard(unit, mesh=experts.mesh, mp_policy=block_policy,
                        shard_placement_fn=_expert_placements([unit], experts.mesh), **kwargs)
            unit.set_gradient_divide_factor(experts.divide_factor)
            # gloo has no pre-multiplied sum: sum, then divide. (Where the shard dimension has one rank, FSDP
            # divides without a reduce-scatter, and would divide a second time after HSDP's all-reduce if
            # forced to sum: torch 2.13; HSDP with dp_shard = ep had its expert gradients divided twice.)
            if experts.mesh.device_type == "cpu" and experts.mesh.size(experts.mesh.ndim - 1) > 1:
                unit.set_force_sum_reduction_for_comms(True)
        for unit in sub_units(block, max_unit_params):
            if unit not in expert_units:
                fully_shard(unit, mesh=mesh, mp_policy=block_policy, shard_placement_fn=in_blocks, **kwargs)
        fully_shard(block, mesh=mesh, mp_policy=block_policy, shard_placement_fn=in_blocks, **kwargs)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, **kwargs)
    if mesh.device_type == "cpu":
        _prefetch_on_host(model)
    # Tensor-parallel logits come back as a view of the local shard; the loss reads them out of place, so
    # FSDP's warning about in-place ops on a returned view does not apply.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def _expert_placements(modules: list[nn.Module], mesh: DeviceMesh) -> Callable[[nn.Parameter], Shard | None]:
    """FSDP's placement for each parameter of the routed experts `modules` (w1/w2/w3: `local` experts each,
    an ep shard's or all of a block's), over the last dimension of `mesh` (HSDP replicates over the first):
    the dimension layout/expert_sharding.py gives; None (FSDP's default, dim 0) for every other parameter."""
    ranks = mesh.size(mesh.ndim - 1)
    chosen: dict[int, Shard] = {}
    for experts in modules:
        params = list(experts.parameters(recurse=False))
        dim = expert_shard_dim(_local(params[0]).size(0), ranks, [p.size(1) for p in params])
        chosen.update((id(p), Shard(dim)) for p in params)
    return lambda param: chosen.get(id(param))


def _prefetch_on_host(model: FSDPModule) -> None:
    """On CPU ranks, gather the next block while this one computes.

    FSDP2 overlaps its all-gathers with compute through CUDA streams; on the host there are none, so each
    block's all-gather would block the rank until it is done. Issued asynchronously, gloo moves the next
    block's shards in its own threads while the current block computes: the next block is gathered when
    the current one starts its forward (explicit prefetch) and, as FSDP2 does by default, its backward.
    At most two blocks are gathered at once, as in the backward with CUDA streams. Measured on 2 CPU ranks
    (`small`, global batch 16 × 128, alternating it step by step within one run): ZeRO-3 steps 0.90× the
    time without it, ZeRO-1 0.96–0.99×, ZeRO-2 0.97–0.99×.
    """
    blocks = list(model.layers.values())
    model._set_unshard_async_op(True)
    model.set_modules_to_forward_prefetch(blocks[:1])
    for block, after in zip(blocks, blocks[1:], strict=False):
        block.set_modules_to_forward_prefetch([after])


def set_micro_batch(model: nn.Module, stage: int, last: bool) -> None:
    """Before a micro-batch's forward: what FSDP does after its backward (stages 1-3).

    Stages 1 and 2 keep the gathered weights until the last micro-batch (one all-gather per step, as
    DeepSpeed keeps its 16-bit weights); stage 1 and stage-0 replicas also skip the gradient reduction
    until then.
    """
    if not isinstance(model, FSDPModule) or stage == 3:
        return
    if stage != 0:
        model.set_reshard_after_backward(last)
    if stage <= 1:
        # Stage-0 replicas reduce once per step, as DDP does under no_sync.
        model.set_requires_gradient_sync(last)


class GradientStash:
    """ZeRO-2 under mixed precision: between micro-batches the reduced gradient shards wait in 16 bits.

    FSDP2 keeps a gradient in its sharded parameter's dtype, fp32 here (the shards are the master weights),
    so accumulating over micro-batches would hold 4 bytes per parameter of the rank's shard where the ZeRO
    paper's stage 2 (2Ψ + 14Ψ/N) and DeepSpeed hold 2. During every micro-batch but the last, a hook that
    FSDP2 runs right after it sets a parameter's reduced shard adds the shard into a bf16 accumulator and
    drops it, so at most one unit's fp32 reduce-scatter output exists at a time and the next micro-batch's
    reduce-scatter starts fresh shards; after the last micro-batch the sums are added back, tensor by tensor.
    The sum of the earlier micro-batches is rounded to bf16 once per micro-batch (the rounding DeepSpeed's
    16-bit gradients have); the last micro-batch's stays fp32.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.acc: dict[nn.Parameter, torch.Tensor] = {}
        self.active = False  # set per micro-batch: stash during all but the last
        for p in params:
            p.register_post_accumulate_grad_hook(self._take)

    @torch.no_grad()
    def _take(self, p: nn.Parameter) -> None:
        if not self.active or p.grad is None:
            return
        grad = _local(p.grad)
        if p in self.acc:
            self.acc[p].add_(grad)  # computed in fp32, rounded into the bf16 accumulator
        else:
            self.acc[p] = grad.to(torch.bfloat16)
        p.grad = None

    def begin(self, last: bool) -> None:
        """Before a micro-batch's forward: stash its gradients unless it is the last one."""
        self.active = not last

    def stash(self) -> list[torch.Tensor]:
        """After a micro-batch that is not the last: stash what the hook has not (it takes every shard FSDP
        reduces); returns the accumulators."""
        for p in self.params:
            self._take(p)
        return list(self.acc.values())

    @torch.no_grad()
    def merge(self) -> None:
        """After the last micro-batch's backward: the stashed sums join the fp32 gradients."""
        for p, acc in self.acc.items():
            if p.grad is None:  # a parameter that took no gradient in the last micro-batch
                p.grad = _as_grad_of(p, acc.float())
            else:
                _local(p.grad).add_(acc)
        self.acc.clear()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _as_grad_of(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return local


def gradient_stash(model: nn.Module, stage: int, mixed_precision: bool, accum_steps: int) -> GradientStash | None:
    """The stash for layouts that need one: stage 2, mixed precision, more than one micro-batch."""
    if not isinstance(model, FSDPModule) or not stashes_gradients(stage, mixed_precision, accum_steps, False):
        return None
    return GradientStash(list(model.parameters()))
