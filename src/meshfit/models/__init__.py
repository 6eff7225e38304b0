"""Single-device model definitions; parallelism is applied to them afterwards.

Typical use builds on the meta device (no memory), applies parallelism,
then materializes and initializes::

    model = build_model(cfg)              # meta
    ...                                   # TP / FSDP / pipeline split
    model.to_empty(device="cuda")
    init_weights(model, seed, cfg)

Configs and presets import without torch (the planner and the CLI's start-up need only them); the
modules, ``build_model`` and ``init_weights`` load torch when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from meshfit.models.config import ModelConfig, flops_per_token, num_params
from meshfit.models.presets import PRESETS, get_preset

if TYPE_CHECKING:  # what type checkers and editors see; at run time these load on first use
    from meshfit.models.build import build_model
    from meshfit.models.gpt import GPT
    from meshfit.models.init import init_weights
    from meshfit.models.llama import Llama

# Names that need torch, and the module each lives in.
_LAZY = {"GPT": "gpt", "Llama": "llama", "build_model": "build", "init_weights": "init"}

__all__ = ["GPT", "PRESETS", "Llama", "ModelConfig", "build_model", "flops_per_token", "get_preset", "init_weights",
           "num_params"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"meshfit.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'meshfit.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
