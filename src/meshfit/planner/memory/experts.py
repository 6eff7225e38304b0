"""What expert parallelism (parallel.ep) changes in one rank's memory, for the estimate (estimate.py).

The ep ranks are borrowed from the dp_shard × cp ranks (parallel/expert_parallel.py): every rank holds
E/ep of each Mixture-of-Experts block's routed experts. What is kept of them:

* **States**: the routed expert shards are FSDP-sharded at the dense part's ZeRO stage over the
  ``edp = dp_shard·cp/ep`` ranks that hold the same experts, and replicated over dp_replicate (HSDP-style;
  parallel/data_parallel.py's ExpertSharding): weights, gradients and optimizer states of
  ``routed / (ep · edp)`` parameters per rank, the same bytes as the dense part's ``/ (dp_shard·cp)``.
* **Gathered copies**: each block's experts are an FSDP unit of their own; FSDP gathers a block's E/ep local
  experts at a time, so a block's units are those of a block with E/ep experts.
* **Padding**: where E/ep does not split evenly over edp, FSDP splits each expert's rows (dim 1) when they
  split evenly (layout/expert_sharding.py), an even share; else the expert dimension in padded chunks
  (``experts_per_rank``, ``gathered_experts``).

The router gate, norms, shared experts and dense blocks are dense parameters (sharded over dp_shard·cp).
"""

from __future__ import annotations

import math
from dataclasses import replace

from meshfit.layout.expert_sharding import expert_shard_dim
from meshfit.layout.layout import Layout
from meshfit.models.config import ModelConfig, moe_mlp_params
from meshfit.planner.memory.shares import Share


def routed_params(model: ModelConfig) -> int:
    """One Mixture-of-Experts block's routed experts (w1, w2, w3 of every expert)."""
    return 3 * model.dim * model.moe_hidden * model.moe_experts if model.moe else 0


def edp(layout: Layout) -> int:
    """Ranks that hold the same experts within a dp_shard × cp group: dp_shard·cp / ep."""
    return layout.shard // layout.ep


def expert_shard_ranks(layout: Layout) -> int:
    """Ranks a routed expert shard's states are split over (ZeRO stages 1-3), beyond the ep split."""
    return edp(layout) if layout.zero_stage >= 1 else 1


def shard_dim(model: ModelConfig, layout: Layout) -> int:
    """The dimension FSDP splits a rank's E/ep experts on over the edp ranks (layout/expert_sharding.py): 0,
    or 1 (an expert's F or D rows) where the experts do not split evenly and the rows do."""
    local = model.moe_experts // layout.ep
    return expert_shard_dim(local, expert_shard_ranks(layout), (model.moe_hidden, model.dim))


def experts_per_rank(model: ModelConfig, layout: Layout) -> float:
    """Experts' worth of weights the most-loaded rank keeps of its E/ep. Split on dim 1, the even share
    E/ep / edp. Split on dim 0, FSDP takes rows of the expert dimension in chunks of ⌈rows / ranks⌉, so with
    fewer local experts than edp ranks (and rows that do not split evenly either) the first ranks keep a whole
    expert each and the others none."""
    local = model.moe_experts // layout.ep
    ranks = expert_shard_ranks(layout)
    return local / ranks if shard_dim(model, layout) == 1 else math.ceil(local / ranks)


def gathered_experts(model: ModelConfig, layout: Layout) -> int:
    """Experts one all-gather of a block's local experts brings in: E/ep split on dim 1; split on dim 0 FSDP
    gathers every rank's chunk padded to ⌈rows / ranks⌉, so ⌈E/ep / edp⌉ · edp experts (E/ep when even)."""
    local = model.moe_experts // layout.ep
    if shard_dim(model, layout) == 1:
        return local
    return math.ceil(local / expert_shard_ranks(layout)) * expert_shard_ranks(layout)


def local_experts_model(model: ModelConfig, ep: int) -> ModelConfig:
    """The model as one rank's blocks hold it: E/ep routed experts per block (for unit and block sizes;
    the router keeps its E outputs, a difference of (E − E/ep)·dim parameters per block)."""
    if ep == 1 or not model.moe:
        return model
    local = model.moe_experts // ep
    return replace(model, moe_experts=local, moe_top_k=min(model.moe_top_k, local))


def local_routed(model: ModelConfig, layout: Layout, share: Share) -> float:
    """Routed expert parameters of this rank's blocks: E/ep experts of each Mixture-of-Experts block."""
    moe_blocks = model.moe_layers * share.layers / model.n_layers
    return moe_blocks * routed_params(model) / layout.ep


def _whole_on_tp_ranks(model: ModelConfig, layout: Layout, share: Share) -> Share:
    """Under tensor parallelism the MoE MLP (router, E/ep routed and the shared experts) is whole on every
    tp rank (parallel/moe_parts.py): the share, built with every block weight split tp ways, gets back the
    (1 − 1/tp) it took from them."""
    if layout.tp == 1 or not model.moe:
        return share
    moe_mlp = moe_mlp_params(local_experts_model(model, layout.ep)) * (1 - 1 / layout.tp)
    moe_blocks = model.moe_layers * share.layers / model.n_layers
    per_block = moe_mlp * model.moe_layers / model.n_layers  # the mean block's
    return replace(share, params=share.params + moe_blocks * moe_mlp, block_params=share.block_params + per_block,
                   unit_params=share.unit_params + per_block if share.unit_params >= share.block_params
                   else share.unit_params)


def ep_share(model: ModelConfig, layout: Layout, share: Share) -> Share:
    """``share`` (built from ``local_experts_model``) with ``params`` the count whose ``1 / (dp_shard·cp)``
    is what this rank keeps of weights, gradients and optimizer states: the dense part's share plus its
    chunk of the local experts (``experts_per_rank``), and ``unit_params`` the largest FSDP unit: a block's
    experts are a unit of their own, gathered as ``gathered_experts`` says."""
    share = _whole_on_tp_ranks(model, layout, share)
    if layout.ep == 1 or not model.moe:
        return share
    local = model.moe_experts // layout.ep
    mine = local_routed(model, layout, share) * experts_per_rank(model, layout) / local
    surplus = mine * layout.shard - local_routed(model, layout, share)
    per_block = routed_params(model) / model.moe_experts  # one expert
    experts_unit = per_block * max(local, gathered_experts(model, layout))
    moe_share = model.moe_layers / model.n_layers
    rest = share.block_params - moe_share * per_block * local  # the block without its experts (mean)
    unit = max(min(share.unit_params, rest), experts_unit)
    grad_unit = max(min(share.unit_params, rest), per_block * local)
    return replace(share, params=share.params + surplus, unit_params=unit, expert_surplus=surplus,
                   grad_unit_params=grad_unit)
