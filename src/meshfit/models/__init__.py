"""Single-device model definitions; parallelism is applied to them afterwards.

Typical use builds on the meta device (no memory), applies parallelism,
then materializes and initializes::

    model = build_model(cfg)              # meta
    ...                                   # TP / FSDP / pipeline split
    model.to_empty(device="cuda")
    init_weights(model, seed, cfg)
"""

from __future__ import annotations

import torch
from torch import nn

from meshfit.models.config import ModelConfig, flops_per_token, num_params
from meshfit.models.gpt import GPT
from meshfit.models.init import init_weights
from meshfit.models.llama import Llama
from meshfit.models.presets import PRESETS, get_preset

__all__ = [
    "GPT",
    "PRESETS",
    "Llama",
    "ModelConfig",
    "build_model",
    "flops_per_token",
    "get_preset",
    "init_weights",
    "num_params",
]

_FAMILIES: dict[str, type[nn.Module]] = {"llama": Llama, "gpt": GPT}


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> nn.Module:
    """Validate ``cfg`` and construct its model with every tensor on ``device``.

    Parameters carry torch's default initialization (nothing, on meta);
    call :func:`init_weights` for the reproducible one.
    """
    cfg.validate()
    with torch.device(device):
        return _FAMILIES[cfg.family](cfg)
