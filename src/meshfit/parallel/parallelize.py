"""parallelize(): the one place that turns a plain single-device model into the configured layout.

The model is built on the meta device and knows nothing of the layout. The order is fixed:
materialize and initialize (identical full weights in every layout), then wrap for data parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from meshfit.models import ModelConfig, init_weights
from meshfit.parallel.data_parallel import apply_ddp
from meshfit.parallel.dims import Meshes, ParallelDims


def parallelize(model: nn.Module, dims: ParallelDims, meshes: Meshes, model_cfg: ModelConfig, *,
                device: torch.device, seed: int) -> nn.Module:
    """Materialize `model` (built on meta) on `device`, initialize it, and apply the layout."""
    model.to_empty(device=device)
    init_weights(model, seed, model_cfg)
    if dims.dp_replicate > 1:
        model = apply_ddp(model, meshes)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside any data-parallel wrapper."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
