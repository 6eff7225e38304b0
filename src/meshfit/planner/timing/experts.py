"""Step-time terms of Mixture-of-Experts blocks under expert parallelism (parallel.ep).

* Expert GEMMs: a rank computes its E/ep experts, each over the copies every ep rank routed to it: under
  balanced routing tokens·top_k·ep/E copies per expert (tokens: the rank's micro-batch), so the rank's
  routed copies are tokens·top_k, as without ep, in ep times fewer and larger GEMMs. The most-loaded rank
  receives ``imbalance`` times the balanced share (Workload.moe_imbalance).
* All-to-all (parallel/expert_parallel.py): per MoE block and micro-batch, two in forward (the copies to
  their experts, the outputs back) and two in backward (their gradients), again for a forward re-run
  under recompute, each of tokens·top_k rows of dim in the compute dtype per rank, of which (ep−1)/ep
  leave the rank. Not overlapped: the experts wait for their copies, the combine for the outputs.
* FSDP of the experts: a rank gathers and reduces its E/ep experts over their edp ranks, so data
  parallelism moves (1 − 1/ep) fewer of the routed experts' bytes per rank (``fsdp_saved_params``).
* Placement: the ep ranks are the inner part of the dp_shard × cp ranks (ep inner), ``tp`` ranks apart
  (comms.py's rank order), so an ep group of ep·tp ≤ gpus_per_node ranks sits in one node and exchanges
  over its intra-node links; beyond, each rank's copies for other nodes leave through its own NIC (an
  all-to-all has no ring to spread them over the node's NICs), about an order of magnitude slower per GPU
  on the catalog's parts: why EP inside a node is preferred (torchtitan and Megatron place it there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshfit.planner.memory.moe_activations import rank_imbalance
from meshfit.planner.timing.comms import ALPHA_INTER_S, ALPHA_INTRA_S, COLLECTIVE_BW_EFFICIENCY

if TYPE_CHECKING:
    from meshfit.hardware.catalog import Cluster
    from meshfit.layout.layout import Layout
    from meshfit.models.config import ModelConfig

# All-to-alls per MoE block and micro-batch: dispatch and combine in forward, their gradients in backward.
FORWARD_ALL_TO_ALLS = 2
BACKWARD_ALL_TO_ALLS = 2


@dataclass(frozen=True)
class AllToAll:
    """One all-to-all of the plan at hand, for the step time and for `--explain`."""

    bytes_per_rank: float  # the buffer each rank sends (tokens·top_k rows of dim), its own part included
    in_node: bool  # the ep group sits in one node
    seconds: float  # one call on this placement
    in_node_seconds: float  # the same call were the group inside a node
    across_seconds: float  # the same call were every peer on another node


def ep_stride(layout: Layout) -> int:
    """Ranks between consecutive members of an ep group (comms.py's rank order: tp innermost)."""
    return layout.tp


def all_to_all(model: ModelConfig, layout: Layout, cluster: Cluster, mb_tokens: int, cbytes: int,
               imbalance: float = 1.0) -> AllToAll:
    """One dispatch all-to-all of a micro-batch of ``mb_tokens`` tokens per rank over the ep ranks (the
    most-loaded rank receives ``imbalance`` times its balanced share)."""
    ep, gpu = layout.ep, cluster.gpu
    sent = mb_tokens * model.moe_top_k * model.dim * cbytes
    moved = sent * rank_imbalance(model, ep, imbalance) * (ep - 1) / ep  # crossing links, most-loaded rank
    per_node = max(1, cluster.gpus_per_node // ep_stride(layout))
    intra = gpu.intra_node_bytes_per_s * COLLECTIVE_BW_EFFICIENCY
    nic = gpu.inter_node_bytes_per_s * COLLECTIVE_BW_EFFICIENCY
    in_node_s = moved / intra + ALPHA_INTRA_S * (ep - 1)
    across_s = moved / nic + ALPHA_INTER_S * (ep - 1)
    in_node = ep <= per_node
    if in_node:
        seconds = in_node_s
    else:
        # Peers in the rank's own node over the intra-node links, the others through its NIC, at once.
        outside = (ep - per_node) / (ep - 1)
        seconds = max(moved * (1 - outside) / intra, moved * outside / nic) + ALPHA_INTER_S * (ep - 1)
    return AllToAll(sent, in_node, seconds, in_node_s, across_s)


def ep_comm(model: ModelConfig, layout: Layout, cluster: Cluster, mb_tokens: int, cbytes: int, moe_blocks: float,
            rerun: float, imbalance: float = 1.0) -> float:
    """All-to-all seconds of one micro-batch on the most-loaded rank: ``moe_blocks`` MoE blocks, ``rerun`` of
    them with their forward re-run in backward (recompute)."""
    if layout.ep == 1 or not model.moe:
        return 0.0
    call = all_to_all(model, layout, cluster, mb_tokens, cbytes, imbalance).seconds
    return call * (moe_blocks * (FORWARD_ALL_TO_ALLS + BACKWARD_ALL_TO_ALLS) + rerun * FORWARD_ALL_TO_ALLS)


def expert_gemms(model: ModelConfig, mb_tokens: int, ep: int, imbalance: float) -> tuple[int, float]:
    """(experts on the rank, routed copies each of them computes per micro-batch) under balanced routing
    scaled by ``imbalance`` (the most-loaded rank's)."""
    local = model.moe_experts // ep
    return local, mb_tokens * model.moe_top_k * ep / model.moe_experts * rank_imbalance(model, ep, imbalance)


def fsdp_saved_params(model: ModelConfig, layout: Layout) -> float:
    """Parameters FSDP's gathers and reductions no longer move per rank under expert parallelism: a rank
    gathers its E/ep experts (over edp ranks) rather than all E (over dp_shard·cp), so (1 − 1/ep) of the
    routed experts' bytes, to a ring-factor difference."""
    if layout.ep == 1 or not model.moe:
        return 0.0
    from meshfit.planner.memory.experts import routed_params

    return model.moe_layers * routed_params(model) * (1 - 1 / layout.ep)
