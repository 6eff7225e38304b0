"""Data parallelism over the `dp` mesh: DDP replicas (every rank keeps full weights, grads and states)."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshfit.parallel.dims import Meshes


def apply_ddp(model: nn.Module, meshes: Meshes) -> nn.Module:
    """Wrap a materialized model in DDP over the data-parallel group.

    DDP keeps flat communication buckets as large as all gradients for the life of the run (allocated at
    the first forward); the memory tracker reports them under `other`. gradient_as_bucket_view stays off:
    with it gradients alias the buckets, and torch's tracker can no longer tell gradients apart.
    """
    device_ids = None if next(model.parameters()).device.type == "cpu" else [next(model.parameters()).device]
    return DistributedDataParallel(
        model, process_group=meshes.dp.get_group(), device_ids=device_ids
    )
