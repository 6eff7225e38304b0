"""Construct a model from its config (imports torch: kept out of meshfit.models' eager imports)."""

from __future__ import annotations

import torch
from torch import nn

from meshfit.models.config import ModelConfig
from meshfit.models.gpt import GPT
from meshfit.models.llama import Llama

_FAMILIES: dict[str, type[nn.Module]] = {"llama": Llama, "gpt": GPT}


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> nn.Module:
    """Validate ``cfg`` and construct its model with every tensor on ``device``.

    Parameters carry torch's default initialization (nothing, on meta);
    call :func:`init_weights` for the reproducible one.
    """
    cfg.validate()
    with torch.device(device):
        return _FAMILIES[cfg.family](cfg)
