"""parallelize(): the one place that turns a plain single-device model into the configured layout.

The model is built on the meta device and knows nothing of the layout. The order is fixed:
tensor parallelism (DTensor) -> context parallelism (attention across the cp ranks) -> activation
checkpointing (and, under sequence parallelism, re-gathering in backward) -> torch.compile of each block
(train.compile) -> data-parallel sharding (FSDP2, still on meta) -> materialize and initialize (identical
full weights in every layout) -> DDP for the replicated stage 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshfit.config import ParallelSection
from meshfit.layout.data_parallel_kind import data_parallel_kind
from meshfit.models import ModelConfig, init_weights
from meshfit.models.init import WeightSource
from meshfit.parallel.activation_checkpoint import apply_activation_checkpointing, keeps_block_graph
from meshfit.parallel.compile import apply_compile
from meshfit.parallel.context_parallel import apply_context_parallel
from meshfit.parallel.data_parallel import ExpertSharding, apply_ddp, apply_fsdp, expert_fsdp_mesh, fsdp_mesh
from meshfit.parallel.dims import Meshes, ParallelDims
from meshfit.parallel.expert_parallel import apply_expert_parallel
from meshfit.parallel.moe_parts import apply_sequence_parts, parts_mesh, tp_routes_slices
from meshfit.parallel.sp_regather import regather_in_backward
from meshfit.parallel.tensor_parallel import apply_tensor_parallel, gathered_input_regions


def apply_model_parallel(model: nn.Module, model_cfg: ModelConfig, tp_mesh: DeviceMesh | None,
                         parallel: ParallelSection, compile_blocks: bool = False,
                         cp_mesh: DeviceMesh | None = None, seq_len: int = 0) -> None:
    """The layout's steps inside the model, on meta: tensor (and sequence) parallelism over `tp_mesh`
    (None: no tensor parallelism), context parallelism over `cp_mesh` for `seq_len`-long sequences (None:
    none), then activation checkpointing, then torch.compile of each block."""
    if tp_mesh is not None:
        apply_tensor_parallel(model, model_cfg, tp_mesh, sp=parallel.sp, loss_parallel=parallel.loss_parallel)
    if cp_mesh is not None:
        apply_context_parallel(model, cp_mesh, seq_len)
    if parallel.activation_checkpointing != "none":
        apply_activation_checkpointing(model, parallel.activation_checkpointing, parallel.ac_every)
    if tp_mesh is not None and parallel.sp:
        # Blocks that keep their graph keep only the sequence shard of their gathered inputs; checkpointed
        # blocks keep nothing of them anyway. Compiled blocks keep them: the re-gathering works through
        # saved-tensor hooks, which torch.compile cannot trace (op-level recompute gathers them again).
        for name, block in model.layers.items():
            if keeps_block_graph(block) and not compile_blocks:
                moe = model_cfg.is_moe_layer(int(name))
                for region, projections in gathered_input_regions(block, model_cfg.family, moe):
                    regather_in_backward(region, projections)
        if model.output is not None:  # the head (never compiled) gathers the final norm's output itself
            regather_in_backward(model.output, [model.output])
    if compile_blocks:  # after the recompute wrappers, so recompute is traced into each block's graph
        apply_compile(model, parallel.max_unit_params)


def _buffers_on(model: nn.Module, device: torch.device) -> None:
    """With offload the sharded parameters live in host memory and FSDP gathers them to the device for
    compute; the buffers (RoPE tables) are not FSDP's and meet the activations on the device, so they are
    allocated there (init_weights then computes them in place)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty_like(buffer, device=device)


def parallelize(model: nn.Module, dims: ParallelDims, meshes: Meshes, model_cfg: ModelConfig, *,
                parallel: ParallelSection, zero_stage: int, mixed_precision: bool,
                device: torch.device, seed: int, weights: WeightSource | None = None,
                materialize: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                compile_blocks: bool = False, seq_len: int = 0) -> nn.Module:
    """Apply the layout to `model` (built on meta), materialize it on `device` and initialize it.

    `weights`: starting weights (model.init_from), each rank reading its own blocks, instead of the seeded
    initialization.
    `materialize` is entered around the steps that allocate (materialization, initialization, DDP): a
    dry run passes a FakeTensorMode there, while the layout itself is applied on meta outside it.
    `seq_len`: the training sequence length (context parallelism places each rank's positions in it).
    """
    tp_mesh = meshes.world["tp"] if dims.tp > 1 else None
    cp_mesh = meshes.world["cp"] if dims.cp > 1 else None
    apply_model_parallel(model, model_cfg, tp_mesh, parallel, compile_blocks, cp_mesh, seq_len)
    if model_cfg.moe and (parts := parts_mesh(meshes.world, dims.cp, dims.tp, parallel.sp)) is not None:
        # Ranks holding parts of the same sequences: MoE blocks compute the whole sequences' auxiliary loss.
        apply_sequence_parts(model, parts, summed=dims.tp if tp_routes_slices(dims.tp, parallel.sp) else 1)
    # Expert shards are DTensors over the expert mesh's ep ranks, FSDP-sharded over its edp ranks.
    experts = None
    if meshes.experts is not None:
        experts = ExpertSharding(apply_expert_parallel(model, meshes.experts), expert_fsdp_mesh(dims, meshes),
                                 divide_factor=dims.dp * dims.cp)
    kind = data_parallel_kind(zero_stage, dims.dp * dims.cp, dims.tp, mixed_precision)
    # zero_stage ≥ 1 on one data-parallel rank also takes FSDP (with offload, host-resident shards).
    if kind in ("fsdp", "replicas"):
        apply_fsdp(model, fsdp_mesh(dims, meshes), stage=zero_stage, mixed_precision=mixed_precision,
                   offload=parallel.offload, reduce_dtype=parallel.reduce_dtype,
                   max_unit_params=parallel.max_unit_params, experts=experts)
    with materialize():
        model.to_empty(device="cpu" if parallel.offload else device)
        if parallel.offload:
            _buffers_on(model, device)
        init_weights(model, seed, model_cfg, weights)
        if kind == "ddp":
            model = apply_ddp(model, meshes)
    return model

