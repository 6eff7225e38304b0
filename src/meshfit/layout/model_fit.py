"""What a model asks of a workload and a layout, in one place for plan, verify, plan files and train: a
position for every token of a sequence, and for pipeline stages enough layers and untied embeddings.

Messages name the config's fields (train.seq_len, parallel.pp, pipeline.virtual_stages); a caller that
speaks in flags or plan-file fields renames them, as it does for `layout_error`.
"""

from __future__ import annotations

from meshfit.models.config import ModelConfig


def seq_len_error(seq_len: int, model: ModelConfig, seq_field: str, raise_with: str) -> str | None:
    """None when the model has a position for every token of a sequence and computes its attention as the
    original model did; else the refusal.

    `seq_field` is where the length was set (--seq-len, train.seq_len, workload.seq_len) and `raise_with`
    how to give the model more positions from there (--dims max_seq_len=…, model.max_seq_len=…). A model
    trained with a sliding attention window (Mistral) attends to the whole sequence here, which is the
    same function only for sequences no longer than the window.
    """
    given = f"{seq_field} {seq_len}" if seq_field.startswith("--") else f"{seq_field}={seq_len}"
    if seq_len > model.max_seq_len:
        return (f"{given} exceeds the model's max_seq_len={model.max_seq_len} (the positions it has); use "
                f"{seq_field} ≤ {model.max_seq_len} (or {raise_with})")
    if model.sliding_window is not None and seq_len > model.sliding_window:
        return (f"{given} exceeds the model's sliding_window={model.sliding_window}: meshfit attends to the whole "
                f"sequence, which is the original model's attention only up to its window; use {seq_field} ≤ "
                f"{model.sliding_window}")
    return None


def pipeline_model_error(model: ModelConfig, pp: int, virtual_stages: int) -> str | None:
    """None when `pp` pipeline ranks of `virtual_stages` stages each can split this model; else why not."""
    if pp == 1:
        return None
    if model.tie_embeddings:
        return (f"parallel.pp={pp} needs untied embeddings (the embedding and the head sit on different stages), "
                "but the model ties them: set model.tie_embeddings=false, or use pp=1")
    stages = pp * virtual_stages
    if stages > model.n_layers:
        return (f"parallel.pp × pipeline.virtual_stages = {pp} × {virtual_stages} = {stages} stages, but the model "
                f"has {model.n_layers} layers; every stage needs at least one layer")
    return None


def moe_layout_error(model: ModelConfig, tp: int, pp: int, cp: int) -> str | None:
    """None when the layout runs this model's blocks as they are; else why not. Mixture-of-Experts blocks run
    under data, expert, context, tensor and pipeline parallelism (attention split, the MoE block whole on
    every tp rank: with sequence parallelism each routes its slice; the auxiliary loss trains in its block,
    on any stage). q/k norms over the whole projections (OLMoE) need the projections whole, which tensor
    parallelism splits. Every `pp` runs (kept in the signature: plan, verify and train ask with the whole
    layout)."""
    if tp > 1 and model.qk_norm and model.qk_norm_scope == "projection":
        return (f"parallel.tp={tp}: the model's q/k norms normalise the whole projections "
                "(model.qk_norm_scope=projection), which tensor parallelism splits; use parallel.tp=1")
    return None


def expert_parallel_error(model: ModelConfig, ep: int, shard: int, offload: bool) -> str | None:
    """None when `ep` expert-parallel ranks can hold this model's routed experts; else why not.

    The ep ranks are borrowed from the `shard` ranks (dp_shard × cp: each group of ep consecutive ones
    splits the experts; the groups replicate them), so ep divides them (layout/rules.py) and the expert
    count. The dense parts stay under FSDP (ZeRO-1/2/3); the expert shards are FSDP-sharded over the other
    ranks that hold the same experts, which is implemented next to FSDP only: DDP (zero_stage=0) and
    offload are refused."""
    if ep == 1:
        return None
    if not model.moe:
        return f"parallel.ep={ep} splits Mixture-of-Experts experts, but the model has none (model.moe_experts is unset)"
    if shard % ep:
        return (f"parallel.ep={ep} must divide parallel.dp_shard × parallel.cp = {shard} (expert parallelism "
                "borrows its ranks from the data-parallel shard and context-parallel ranks)")
    if model.moe_experts % ep:
        return f"parallel.ep={ep} must divide model.moe_experts={model.moe_experts} (each rank holds as many experts)"
    if offload:
        return f"parallel.ep={ep} does not support parallel.offload=true (the expert shards stay on the device)"
    return None
