"""Data parallelism over the dp_replicate × dp_shard mesh: DDP, ZeRO-1/2/3 (FSDP2), HSDP, offload, bf16.

What each stage keeps resident on a rank (as torch's building blocks behave):

  stage 0  DDP                         full weights, full grads (+ DDP's equally large buckets), full states
  stage 1  DDP + ZeroRedundancyOpt.    full weights, full grads (+ buckets), 1/N of the optimizer states
  stage 2  FSDP2, reshard_after_fwd=F  1/N weights at rest; a block's full weights gathered in forward stay
                                       until its backward; grads reduce-scattered to 1/N; 1/N states
  stage 3  FSDP2, reshard_after_fwd=T  1/N weights; each block gathered just in time in forward and again in
                                       backward, freed right after; 1/N grads; 1/N states

N is dp_shard; with dp_replicate > 1 the sharded state is replicated across dp_replicate groups (HSDP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from meshfit.parallel.dims import Meshes, ParallelDims


def apply_ddp(model: nn.Module, meshes: Meshes) -> nn.Module:
    """Wrap a materialized model in DDP over the whole data-parallel group (stages 0 and 1).

    DDP keeps flat communication buckets as large as all gradients for the life of the run (allocated at
    the first forward); the memory tracker reports them under `other`. gradient_as_bucket_view stays off:
    with it gradients alias the buckets, and torch's tracker can no longer tell gradients apart.
    """
    device = next(model.parameters()).device
    device_ids = None if device.type == "cpu" else [device]
    return DistributedDataParallel(model, process_group=meshes.dp.get_group(), device_ids=device_ids)


def fsdp_mesh(dims: ParallelDims, meshes: Meshes) -> DeviceMesh:
    """1-D mesh over dp_shard (FSDP), or the 2-D (dp_replicate, dp_shard) mesh (HSDP)."""
    if dims.dp_replicate > 1:
        return meshes.world["dp_replicate", "dp_shard"]
    return meshes.world["dp_shard"]


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, stage: int, mixed_precision: bool, offload: bool) -> None:
    """fully_shard each transformer block, then the root (embeddings, final norm, head), on meta.

    Stage 3 frees a block's gathered weights after its forward and re-gathers them for backward; stage 2
    keeps them until backward. Mixed precision computes with bf16 copies of the weights and reduces
    gradients in fp32 into fp32 master weights.
    """
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    # Pinned host memory needs an accelerator; on a CPU-only build plain memory is the host memory.
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, reshard_after_forward=stage == 3, mp_policy=mp, offload_policy=policy)
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def zero1_group(meshes: Meshes) -> dist.ProcessGroup:
    """The process group across which ZeRO-1 shards optimizer states: the dp_shard ranks."""
    return meshes.world["dp_shard"].get_group()
