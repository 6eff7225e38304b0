"""`meshfit plan --explain` for Mixture-of-Experts models: what expert parallelism buys, what its all-to-alls
cost inside a node and across nodes, and what uneven routing would add (planner/timing/experts.py)."""

from __future__ import annotations

import dataclasses

from meshfit.layout.precision import COMPUTE_BYTES
from meshfit.planner.memory.estimate import estimate_memory
from meshfit.planner.memory.moe_activations import MEASURED_IMBALANCE, MEASURED_IMBALANCE_NOTE
from meshfit.planner.search import Candidate, Plan, backend
from meshfit.planner.timing.estimate import step_time
from meshfit.planner.timing.experts import all_to_all, ep_stride
from meshfit.util.units import fmt_bytes, fmt_duration


def expert_lines(plan: Plan, usable: float) -> list[str]:
    """The Mixture-of-Experts paragraph (no lines for a dense model)."""
    model = plan.model
    if not model.moe:
        return []
    # The fastest fitting layout with ep > 1, else the closest one (a single --layout: that one).
    chosen = next((c for c in plan.candidates if c.layout.ep > 1), None)
    lines = ["", f"Mixture of Experts ({model.moe_experts} experts, top {model.moe_top_k}, "
                 f"{model.moe_layers} MoE blocks): expert parallelism (ep) splits each block's experts over ep of "
                 "the dp_shard × cp ranks; their states stay sharded over the rest (edp = dp_shard·cp/ep)."]
    if chosen is None:
        lines.append("  no layout with ep > 1 was evaluated (ep must divide dp_shard × cp and the expert count).")
        return lines
    lines += _all_to_all_lines(plan, chosen)
    lines += _imbalance_lines(plan, chosen, usable)
    return lines


def _all_to_all_lines(plan: Plan, chosen: Candidate) -> list[str]:
    layout, cluster, model = chosen.layout, plan.cluster, plan.model
    cbytes = COMPUTE_BYTES[plan.workload.precision]
    tokens = layout.micro_batch * plan.workload.seq_len // layout.cp
    call = all_to_all(model, layout, cluster, tokens, cbytes, plan.workload.moe_imbalance)
    per_node = cluster.gpus_per_node // ep_stride(layout)
    d = fmt_duration
    where = "inside one node" if call.in_node else f"across nodes ({per_node} of its ranks per node)"
    lines = [f"  {layout.describe()}: each MoE block sends {fmt_bytes(call.bytes_per_rank)} per rank and micro-batch "
             f"(tokens × top_k rows of dim) in each of 2 all-to-alls forward and 2 backward; its ep group of "
             f"{layout.ep} sits {where}: {d(call.seconds)} a call, {d(chosen.time.ep_comm_s)} a step "
             f"({chosen.time.ep_comm_s / chosen.time.total_s:.0%} of it)."]
    gpu = cluster.gpu
    lines.append(f"  Why ep inside a node: the same call takes {d(call.in_node_seconds)} over the intra-node links "
                 f"({gpu.intra_node_bytes_per_s / 1e9:.0f} GB/s per GPU) against {d(call.across_seconds)} through "
                 f"one NIC per GPU ({gpu.inter_node_bytes_per_s / 1e9:.0f} GB/s), "
                 f"{call.across_seconds / call.in_node_seconds:.1f}× longer, and an all-to-all, unlike FSDP's "
                 "rings, has no ring to spread over the node's NICs; the all-to-alls cannot overlap the experts "
                 "that wait for them. ep ≤ "
                 f"{per_node} keeps the group in a node here.")
    return lines


def _imbalance_lines(plan: Plan, chosen: Candidate, usable: float) -> list[str]:
    factor = plan.workload.moe_imbalance
    lines = [f"  Routing: planned with --moe-imbalance {factor:g} (1: balanced, as the dry run routes and published "
             "benchmarks force it)."]
    if MEASURED_IMBALANCE <= 1.0:
        return lines
    worst = dataclasses.replace(plan.workload, moe_imbalance=MEASURED_IMBALANCE)
    memory = estimate_memory(plan.model, chosen.layout, worst, backend(plan.cluster))
    time = step_time(plan.model, chosen.layout, worst, plan.cluster)
    fits = "fits" if memory.total <= usable else "does not fit"
    lines.append(f"  At a measured worst case, {MEASURED_IMBALANCE:.2f} ({MEASURED_IMBALANCE_NOTE}), the most-loaded "
                 f"rank would need {fmt_bytes(memory.total)} ({fits} in {fmt_bytes(usable)}) and the step "
                 f"{fmt_duration(time.total_s)} instead of {fmt_bytes(chosen.memory.total)} and "
                 f"{fmt_duration(chosen.time.total_s)}.")
    return lines
