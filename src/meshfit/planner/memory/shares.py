"""One pipeline rank's slice of the model (after tensor parallelism, before data-parallel sharding), as the
memory estimate (planner/memory/estimate.py) counts it: its parameters, blocks, FSDP units and root."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from meshfit.layout.data_parallel_kind import DEFAULT_MAX_UNIT_PARAMS
from meshfit.layout.layout import Layout, Workload
from meshfit.layout.recompute import rerun_blocks
from meshfit.layout.schedules import v_shaped
from meshfit.layout.stage_split import balanced_split, head_flops, layer_flops
from meshfit.models.config import ModelConfig
from meshfit.planner.memory.activations import block_weight_params


@dataclass(frozen=True)
class Share:
    """One pipeline rank's slice of the model (after tensor parallelism, before data-parallel sharding)."""

    params: float  # every parameter this rank holds
    block_params: float  # one transformer block's parameters
    unit_params: float  # the largest FSDP unit of a block (the block, or a part of it: parallel/fsdp_units.py)
    root_params: float  # embeddings, final norm and head (the root FSDP unit)
    layers: int  # transformer blocks on this rank
    stages: int  # stages on this rank (virtual pipeline stages)
    first: bool  # holds the embedding
    last: bool  # holds the final norm, the head and the loss
    stage_layers: tuple[int, ...]  # blocks of each of its stages
    # Counted in `params` beyond what the rank holds unsharded: expert parallelism's shards of E/ep experts
    # split over fewer ranks than dp_shard × cp (planner/memory/experts.py). `params - expert_surplus`
    # is what the rank computes with.
    expert_surplus: float = 0.0
    grad_unit_params: float | None = None  # the largest unit's unsharded gradients, when not unit_params

    def __post_init__(self) -> None:
        if len(self.stage_layers) != self.stages or sum(self.stage_layers) != self.layers:
            raise ValueError(f"stage_layers={self.stage_layers} must be {self.stages} counts adding up to "
                             f"{self.layers} layers")

    def rerun(self, mode: str) -> int:
        """Blocks whose whole forward runs again in backward under recompute ``mode`` (per stage, as the
        trainer checkpoints them)."""
        return rerun_blocks(self.stage_layers, mode)


def _block_params(model: ModelConfig, tp: int) -> float:
    norms = 2 * model.dim if model.family == "llama" else 4 * model.dim
    if model.qk_norm:  # q/k norms: each head's width (kept whole under TP), or the whole projections
        norms += (model.q_width + model.n_kv_heads * model.head_size if model.qk_norm_scope == "projection"
                  else 2 * model.head_size)
    biases = 0 if model.family == "llama" else (3 * model.dim + model.ffn_hidden) / tp + 2 * model.dim
    return block_weight_params(model) / tp + norms + biases


@lru_cache(maxsize=256)
def _largest_unit(model: ModelConfig, max_unit_params: int) -> int | None:
    """The largest FSDP unit of one of `model`'s blocks, in parameters before tensor parallelism, from a
    block built on the meta device and split by the trainer's own rule; None when blocks are not split."""
    if _block_params(model, 1) <= max_unit_params:
        return None
    # A one-block model on meta: no memory, no initialization (torch is imported only when a block is split).
    from meshfit.models import build_model
    from meshfit.parallel.fsdp_units import sub_units, unit_sizes

    block = build_model(replace(model, n_layers=1), "meta").layers["0"]
    return max(unit_sizes(block, max_unit_params)) if sub_units(block, max_unit_params) else None


@lru_cache(maxsize=4096)
def _shares(model: ModelConfig, seq: int, tp: int, pp: int, virtual: int, v_shape: bool,
            max_unit_params: int = DEFAULT_MAX_UNIT_PARAMS) -> tuple[Share, ...]:
    n_stages = pp * virtual
    counts = balanced_split(model.n_layers, n_stages, layer_flops(model, seq), head_flops(model)) \
        if n_stages > 1 else [model.n_layers]
    embed = model.padded_vocab * model.dim / tp + (model.max_seq_len * model.dim if model.family == "gpt" else 0)
    head = 0 if (model.tie_embeddings and n_stages == 1) else model.padded_vocab * model.dim / tp
    final_norm = model.dim if model.family == "llama" else 2 * model.dim
    block = _block_params(model, tp)
    # A split block's units are projections or attention: tensor parallelism divides them.
    largest = _largest_unit(model, max_unit_params)
    unit = block if largest is None else min(block, largest / tp)
    shares = []
    for rank in range(pp):
        ids = [rank, 2 * pp - 1 - rank] if v_shape else [rank + k * pp for k in range(virtual)]
        layers = sum(counts[i] for i in ids)
        first, last = 0 in ids, n_stages - 1 in ids
        root = (embed if first else 0) + ((head + final_norm) if last else 0)
        shares.append(Share(layers * block + root, block, unit, root, layers, len(ids), first, last,
                            tuple(counts[i] for i in ids)))
    return tuple(shares)


def layout_shares(model: ModelConfig, layout: Layout, workload: Workload) -> tuple[Share, ...]:
    v_shape = v_shaped(layout.schedule) and layout.pp > 1
    virtual = layout.virtual_stages if layout.pp > 1 else 1
    return _shares(model, workload.seq_len, layout.tp, layout.pp, virtual, v_shape, layout.max_unit_params)
