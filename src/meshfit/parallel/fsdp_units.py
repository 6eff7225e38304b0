"""FSDP units: the modules whose parameters are gathered, freed and reduced together.

One unit per transformer block is torchtitan's choice, and it bounds the working set of ZeRO-3 by about two
blocks' weights (the one computing and the prefetched next one) plus one block's unreduced gradients. A
block of a very wide model is too large for that (hidden 16,384: 3.2 billion parameters per GPT block), so
a block with more than ``parallel.max_unit_params`` parameters is sharded as smaller units: its attention
and its MLP, and within a part that is still too large, each projection. A single projection is never
split: it is the smallest unit. Norms stay in the block's own unit. DeepSpeed bounds the same working set
with ``stage3_max_live_parameters`` (1e9 elements by default), the default here too.

The planner reads the units of a block built on the meta device (`unit_sizes`), so plan and run split alike.
"""

from __future__ import annotations

from torch import nn

from meshfit.layout.data_parallel_kind import DEFAULT_MAX_UNIT_PARAMS  # noqa: F401 (the limit's home, importable without torch)


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _holds_matmul(module: nn.Module) -> bool:
    return any(isinstance(m, (nn.Linear, nn.Embedding)) for m in module.modules())


def sub_units(block: nn.Module, max_params: int | None) -> list[nn.Module]:
    """The submodules of `block` to shard as units of their own, inner ones first (the order
    `fully_shard` needs), so that no unit holds more than `max_params` parameters where the block's
    structure allows; empty when the block fits in one unit (or `max_params` is None)."""
    if max_params is None or _size(block) <= max_params:
        return []
    units: list[nn.Module] = []
    for child in block.children():
        if not _holds_matmul(child):
            continue  # norms and the like: gathered with the block's own unit
        if _size(child) > max_params and any(_holds_matmul(c) for c in child.children()):
            units += sub_units(child, max_params)
        else:
            units.append(child)
    return units


def unit_sizes(block: nn.Module, max_params: int | None) -> list[int]:
    """Parameters per unit of `block` (a meta-device block will do): its sub-units', then what the block's
    own unit keeps (its norms, or everything when it is not split)."""
    subs = [_size(u) for u in sub_units(block, max_params)]
    return [*subs, _size(block) - sum(subs)]
