"""Activation recompute (policies in layout/recompute.py), applied to a model's blocks in place."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshfit.layout.recompute import checkpointed_blocks
from meshfit.models.layers import RMSNorm

# Ops whose outputs the "op" policy keeps: matmuls, attention kernels and reductions (recomputing those
# would communicate again). Everything else is recomputed, sequence-parallel all-gathers included: their
# full-size outputs are gathered again in backward rather than kept (as Megatron-LM does).
_KEEP = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    # Expert parallelism's token exchange (parallel/expert_parallel.py): kept, not sent again in backward.
    # The exchange of the per-expert counts before it (an in-place c10d op, a few integers) runs again.
    torch.ops._c10d_functional.all_to_all_single.default,
}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def keeps_block_graph(block: nn.Module) -> bool:
    """Whether ``block`` keeps its own saved tensors (it is not checkpointed whole)."""
    return not isinstance(block, CheckpointWrapper)


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> None:
    """Wrap the chosen blocks of `model.layers` (or their attention cores) in place, before sharding, so
    FSDP units stay per block.

    The wrapper keeps the parameter names under `_checkpoint_wrapped_module.`, which weight initialization
    and checkpoints map back to the plain names. Checkpointing is non-reentrant and preserves the RNG
    state, so dropout recomputes identically.
    """
    if mode == "attention":
        for block in model.layers.values():
            block.attention.core = checkpoint_wrapper(block.attention.core)
        return
    context = {}
    if mode == "op":
        context["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
    names = list(model.layers.keys())
    for index in checkpointed_blocks(len(names), mode, every):
        block = model.layers[names[index]]
        for module in block.modules():
            if isinstance(module, RMSNorm):
                module.recompute_alone = False
        model.layers[names[index]] = checkpoint_wrapper(block, **context)
