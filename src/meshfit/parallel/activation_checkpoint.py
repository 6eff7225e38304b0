"""Activation recompute (policies in layout/recompute.py), applied to a model's blocks in place."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, _CachedTorchDispatchMode, create_selective_checkpoint_contexts

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


# Profiler annotations (record_function) compute nothing. FSDP's hooks of a unit nested inside a block (the
# expert shards under expert parallelism, parallel/data_parallel.py) open more of them in the recompute than
# in the forward, and torch 2.13's selective checkpointing refuses any operator the forward did not record
# ("... invocation index 2 encountered during backward but not found in storage"); they run as they come.
# (A change proposed to torch, pytorch/pytorch#196862, has selective checkpointing ignore them itself.)
_ANNOTATIONS = {torch.ops.profiler._record_function_enter_new.default,
                torch.ops.profiler._record_function_exit._RecordFunction}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


class _Recompute(_CachedTorchDispatchMode):
    """The recompute side of selective checkpointing, letting profiler annotations through."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _ANNOTATIONS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _op_level_contexts() -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """torch's selective checkpointing contexts for the "op" policy (the forward's, the recompute's)."""
    forward, recompute = create_selective_checkpoint_contexts(_keep_matmuls)
    return forward, _Recompute(None, recompute.storage)


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
        context["context_fn"] = _op_level_contexts
    names = list(model.layers.keys())
    for index in checkpointed_blocks(len(names), mode, every):
        block = model.layers[names[index]]
        for module in block.modules():
            if isinstance(module, RMSNorm):
                module.recompute_alone = False
        model.layers[names[index]] = checkpoint_wrapper(block, **context)
