"""Data parallelism over the `dp` mesh: DDP replicas (every rank keeps full weights, grads and states)."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshfit.parallel.dims import Meshes


def apply_ddp(model: nn.Module, meshes: Meshes) -> nn.Module:
    """Wrap a materialized model in DDP over the data-parallel group.

    gradient_as_bucket_view=True makes `.grad` views into DDP's communication buckets, so gradients exist
    once (not once in `.grad` and once in a bucket) and the memory tracker sees the buckets as gradients.
    """
    device_ids = None if next(model.parameters()).device.type == "cpu" else [next(model.parameters()).device]
    return DistributedDataParallel(
        model, process_group=meshes.dp.get_group(), device_ids=device_ids, gradient_as_bucket_view=True
    )
