"""What expert parallelism (parallel.ep) changes in one rank's memory, for the estimate (estimate.py).

The ep ranks are borrowed from the dp_shard × cp ranks (parallel/expert_parallel.py): every rank holds
E/ep of each Mixture-of-Experts block's routed experts. What is kept of them:

* **States**: the routed expert shards are FSDP-sharded at the dense part's ZeRO stage over the
  ``edp = dp_shard·cp/ep`` ranks that hold the same experts, and replicated over dp_replicate (HSDP-style;
  parallel/data_parallel.py's ExpertSharding): weights, gradients and optimizer states of
  ``routed / (ep · edp)`` parameters per rank, the same bytes as the dense part's ``/ (dp_shard·cp)``.
* **Gathered copies**: each block's experts are an FSDP unit of their own; FSDP gathers a block's E/ep local
  experts at a time, so a block's units are those of a block with E/ep experts.

The router gate, norms, shared experts and dense blocks are dense parameters (sharded over dp_shard·cp).
"""

from __future__ import annotations

from dataclasses import replace

from meshfit.layout.layout import Layout
from meshfit.models.config import ModelConfig
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


def ep_share(model: ModelConfig, layout: Layout, share: Share) -> Share:
    """``share`` (built from ``local_experts_model``) with ``params`` the count whose ``1 / (dp_shard·cp)``
    is what this rank keeps of weights, gradients and optimizer states: the dense part's share plus
    routed / (ep · expert_shard_ranks)."""
    if layout.ep == 1 or not model.moe:
        return share
    extra = local_routed(model, layout, share) * (layout.shard / expert_shard_ranks(layout) - 1)
    return replace(share, params=share.params + extra)
