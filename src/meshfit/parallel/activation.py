"""Activation checkpointing: keep only each wrapped block's input and recompute the rest in backward."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def checkpointed_blocks(n_layers: int, mode: str, every: int) -> list[int]:
    """Indices of the transformer blocks to checkpoint: all ("full"), every k-th ("selective"), none."""
    if mode == "full":
        return list(range(n_layers))
    if mode == "selective":
        return [i for i in range(n_layers) if i % every == every - 1] if every > 1 else list(range(n_layers))
    return []


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> None:
    """Wrap the chosen blocks of `model.layers` in place (before sharding, so FSDP units stay per block).

    The wrapper keeps the blocks' parameter names under `_checkpoint_wrapped_module.`, which weight
    initialization and checkpoints map back to the plain names.
    """
    names = list(model.layers.keys())
    for index in checkpointed_blocks(len(names), mode, every):
        name = names[index]
        # Non-reentrant checkpointing, with the RNG state preserved so dropout recomputes identically.
        model.layers[name] = checkpoint_wrapper(model.layers[name])
