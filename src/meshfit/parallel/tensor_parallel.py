"""Tensor parallelism (Megatron-style) as data: a plan maps module paths to DTensor parallel styles.

Attention q/k/v (with their biases) and MLP up/gate are split by output columns, attention output and MLP
down by input rows, so each block needs one reduction in forward and one in backward; per-head q/k norms
stay whole on every rank, and so does a Mixture-of-Experts MLP (router and experts: expert parallelism
splits the experts). The token embedding is split by vocabulary rows and the output head by vocabulary columns. With sequence parallelism the norms, dropout and
the residual stream between the split regions hold 1/t of the sequence; with loss parallelism the
cross-entropy runs on vocabulary-sharded logits that are never gathered.
"""

from __future__ import annotations

import math

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshfit.models import ModelConfig


def _block_plan(family: str, sp: bool, qk_norm: bool = False, moe: bool = False) -> dict[str, ParallelStyle]:
    residual = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
    }
    if not moe:  # a Mixture-of-Experts MLP stays whole (tp_plan)
        plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=residual)})
        if family == "llama":
            plan["feed_forward.w3"] = ColwiseParallel()
    if qk_norm:
        # Each rank normalises its own query and key heads ([b, s, heads, head_dim], heads split: Shard(2))
        # with the whole per-head weight (replicated), whose gradient is summed over the heads of every rank.
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sp:
        # The attention also takes the RoPE tables (plain tensors, left as they are).
        extra = (None, None) if family == "llama" else ()
        plan.update({
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), *extra),
                                            desired_input_layouts=(Replicate(), *extra)),
        })
        # A Mixture-of-Experts block routes the slice of the sequence this rank holds, as plain tensors; its
        # plain output joins the residual stream's slice (parallel/moe_parts.py sums its gradients over tp).
        plan["feed_forward"] = (PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                                   use_local_output=True) if moe else
                                PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)))
    return plan


def tp_plan(cfg: ModelConfig, *, sp: bool, loss_parallel: bool, layers: list[str] | None = None,
            first: bool = True, last: bool = True) -> dict[str, ParallelStyle]:
    """The plan for `cfg`'s model: module path (relative to the model) -> parallel style.

    A pipeline stage passes its own block names (`layers`) and whether it holds the embedding (`first`)
    and the head (`last`), so the plan names only modules the stage has.
    """
    residual = Shard(1) if sp else Replicate()
    layers = [str(i) for i in range(cfg.n_layers)] if layers is None else layers
    plan: dict[str, ParallelStyle] = {}
    if last:
        plan["output"] = ColwiseParallel(input_layouts=residual,
                                         output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                         use_local_output=not loss_parallel)
        if sp:
            plan["norm"] = SequenceParallel()
    if first and cfg.family == "llama":
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    elif first:
        # Learned positions are added to the full token embeddings; the sequence split starts at block 0.
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sp:
            plan[f"layers.{layers[0]}"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                             desired_input_layouts=(Shard(1),),
                                                             use_local_output=True)
    for name in layers:
        # A Mixture-of-Experts block stays whole on every tp rank: without sequence parallelism the residual
        # stream reaches it as the same plain tensor on each (the attention's row-parallel output is
        # replicated), so its router, experts and their gradients are the same on each, as the norms' are.
        # With sequence parallelism each rank routes its slice.
        block = _block_plan(cfg.family, sp, cfg.qk_norm, moe=cfg.is_moe_layer(int(name)))
        plan.update({f"layers.{name}.{path}": style for path, style in block.items()})
    return plan


def apply_tensor_parallel(model: nn.Module, cfg: ModelConfig, mesh: DeviceMesh, *, sp: bool,
                          loss_parallel: bool) -> None:
    """Shard `model` (on meta, before data-parallel wrapping) over the 1-D `tp` mesh, in place."""
    plan = tp_plan(cfg, sp=sp, loss_parallel=loss_parallel, layers=list(model.layers.keys()),
                   first=model.tok_embeddings is not None, last=model.output is not None)
    parallelize_module(model, mesh, plan)
    if cfg.tie_embeddings:
        # Both the embedding and the head are split by vocabulary rows (Shard(0)): tie them again.
        model.output.weight = model.tok_embeddings.weight


def gathered_input_regions(block: nn.Module, family: str,
                           moe: bool = False) -> list[tuple[nn.Module, list[nn.Module]]]:
    """Under sequence parallelism: each module of ``block`` whose input is all-gathered along the
    sequence, with the column-parallel projections that read the gathered input (a Mixture-of-Experts
    block, `moe`, reads its slice: only the attention's is gathered)."""
    plan = _block_plan(family, sp=True, moe=moe)
    return [(block.get_submodule(region), [block.get_submodule(name) for name, style in plan.items()
                                           if name.startswith(f"{region}.") and isinstance(style, ColwiseParallel)])
            for region in (("attention",) if moe else ("attention", "feed_forward"))]


def tp_degree_error(cfg: ModelConfig, tp: int, seq_len: int, sp: bool,
                    seq_field: str = "train.seq_len") -> str | None:
    """None if `tp` splits every sharded dimension evenly; else what it fails and the degrees that work.

    tp must divide the attention heads, the key/value heads, the MLP hidden size and, with sequence
    parallelism, the sequence length (`seq_field`: what the length is called); the vocabulary is padded instead (see models.config.pad_vocab_for_tp).
    """
    sizes = {"model.n_heads": cfg.n_heads, "model.n_kv_heads": cfg.n_kv_heads,
             "model.ffn_hidden": cfg.ffn_hidden}
    if sp:
        sizes[seq_field] = seq_len
    failing = [f"{field}={size}" for field, size in sizes.items() if size % tp]
    if not failing:
        return None
    common = math.gcd(*sizes.values())
    valid = [d for d in range(1, common + 1) if common % d == 0]
    shown = ", ".join(f"{f.split('.', 1)[1]} {v}" for f, v in sizes.items())
    return (f"parallel.tp={tp} must divide {', '.join(failing)}; tensor-parallel degrees that divide every "
            f"split size ({shown}): {', '.join(map(str, valid))}")
