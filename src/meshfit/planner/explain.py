"""`meshfit plan --explain`: which techniques a model and cluster need, in plain language with numbers."""

from __future__ import annotations

import dataclasses

from meshfit.hardware.catalog import device_noun, is_cpu
from meshfit.layout.layout import Layout
from meshfit.layout.precision import state_bytes
from meshfit.models.config import num_params
from meshfit.planner.explain_experts import expert_lines
from meshfit.planner.explain_footprint import footprint_lines
from meshfit.planner.memory.estimate import MemoryEstimate, estimate_memory, usable_bytes
from meshfit.planner.search import Candidate, Plan
from meshfit.util.units import fmt_bytes, fmt_count, fmt_duration


def _parts(m: MemoryEstimate) -> str:
    d = m.as_dict()
    return (f"weights {fmt_bytes(d['params'])} + gradients {fmt_bytes(d['grads'])} + optimizer states "
            f"{fmt_bytes(d['optim'])} + activations {fmt_bytes(d['activations'])} + buffers "
            f"{fmt_bytes(d['buffers'])} = {fmt_bytes(d['total'])}")


def _verdict(m: MemoryEstimate, usable: float) -> str:
    return "fits" if m.total <= usable else f"does not fit ({fmt_bytes(m.total - usable)} too much)"


def _best(plan: Plan, test) -> Candidate | None:
    return next((c for c in plan.candidates if c.fits and test(c.layout)), None)


def _fastest_any(plan: Plan, test) -> Candidate | None:
    found = [c for c in plan.candidates if test(c.layout)]
    return max(found, key=lambda c: c.time.tokens_per_s) if found else None


def _line(c: Candidate | None, usable: float) -> str:
    if c is None:
        return "no layout of this kind can run here"
    t = c.time
    return (f"{c.layout.describe()}: {fmt_bytes(c.memory.total)} per rank ({_verdict(c.memory, usable)}), "
            f"{fmt_duration(t.total_s)}/step, {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.0%}")


def _states_section(plan: Plan, usable: float) -> list[str]:
    wl, n = plan.workload, num_params(plan.model)
    w, g, k = state_bytes(wl.precision, wl.optimizer)
    world, ranks = plan.cluster.world_size, device_noun(plan.cluster.gpu)
    # DDP with b sequences per rank and forward, without accumulation: b = 1 here, 2 and 4 below.
    ddp, *bigger = [estimate_memory(plan.model, Layout(dp_replicate=world, micro_batch=b),
                                    dataclasses.replace(wl, global_batch=world * b)) for b in (1, 2, 4)]
    lines = [
        f"Model: {plan.model_name}, {fmt_count(n)} parameters. Precision {wl.precision} with {wl.optimizer}: "
        f"{w} B weights + {g} B gradients + {k} B optimizer states = {w + g + k} B per parameter, i.e. "
        f"{fmt_bytes(n * (w + g + k))} of model states for one full replica. {_memory_words(plan, usable)}",
        "",
        f"Why plain DDP does not work: every one of the {world} {ranks} holds that full replica, so adding "
        f"{ranks} adds no memory per model. With one sequence of {wl.seq_len} tokens per forward, one rank's peak "
        f"(at the {ddp.phase} phase) is {_parts(ddp)} — it {_verdict(ddp, usable)}."
        + (" Model states alone exceed the device." if n * (w + g + k) > usable else ""),
    ]
    # Once micro-batches 2 and 4 peak at the loss, their difference is activations alone.
    per_seq = (bigger[1].total - bigger[0].total) / 2
    grows = (f"each extra sequence per forward adds {fmt_bytes(per_seq)} of activations and nothing is shared"
             if per_seq > 0 else f"the peak stays at the {bigger[1].phase} phase, where the activations are gone, "
             "so more sequences do not raise it here; they do not lower it either")
    heading = "Why a bigger local batch makes it worse" if per_seq > 0 else "Why a bigger local batch does not help"
    lines += ["", f"{heading}: {grows}: micro-batch 2 needs "
              f"{fmt_bytes(bigger[0].total)}, micro-batch 4 {fmt_bytes(bigger[1].total)} per rank. Larger "
              "batches buy throughput only once the model states are sharded or split."]
    return lines


def _memory_words(plan: Plan, usable: float) -> str:
    gpu = plan.cluster.gpu
    if is_cpu(gpu):
        return (f"Each CPU rank has a budget of {fmt_bytes(gpu.memory_bytes)} (--gpu-memory, as train.memory_budget) "
                "for its tracked tensors, all of it usable.")
    return (f"Each {gpu.name} has {fmt_bytes(gpu.memory_bytes)}, of which the planner lets tensors use "
            f"{fmt_bytes(usable)} (the rest goes to the CUDA context, communication buffers and allocator "
            "fragmentation).")


def _technique_section(plan: Plan, usable: float) -> list[str]:
    wl, world = plan.workload, plan.cluster.world_size
    zero = {s: estimate_memory(plan.model, Layout(dp_shard=world, zero_stage=s, micro_batch=1), wl) for s in (1, 2, 3)}
    zero3_ac = estimate_memory(plan.model, Layout(dp_shard=world, zero_stage=3, micro_batch=1,
                                                  activation_checkpointing="full"), wl)
    ddp_optim = estimate_memory(plan.model, Layout(dp_replicate=world, micro_batch=1), wl).optim
    lines = ["", f"What each technique buys and costs (per rank, {world} ranks, micro-batch 1):"]
    lines.append(
        f"- ZeRO-1 shards the fp32 master weights and optimizer states evenly over the data-parallel ranks "
        f"({fmt_bytes(zero[1].optim)} of states per rank instead of {fmt_bytes(ddp_optim)}); each step gathers "
        f"the weights once in the compute dtype and keeps them, and full gradients, until the last "
        f"micro-batch's backward: total {fmt_bytes(zero[1].total)}, {_verdict(zero[1], usable)}. Traffic as "
        "DDP's all-reduce: one all-gather of weights and one reduce-scatter of gradients per step.")
    lines.append(
        f"- ZeRO-2 also reduce-scatters gradients after every micro-batch, keeping 1/{world} of them: "
        f"{fmt_bytes(zero[2].total)}, {_verdict(zero[2], usable)} (with one micro-batch it is ZeRO-1).")
    lines.append(
        f"- ZeRO-3 / FSDP also shards weights, gathering one block at a time: {fmt_bytes(zero[3].total)}, "
        f"{_verdict(zero[3], usable)}; the weights are gathered again in backward (1.5× DDP's traffic). "
        f"What remains is activations ({fmt_bytes(zero[3].activations)}); full activation checkpointing "
        f"keeps only block inputs ({fmt_bytes(zero3_ac.total)} in all, {_verdict(zero3_ac, usable)}) for "
        "about one more forward pass of compute (~33%).")
    tp = (_best(plan, lambda lay: lay.tp > 1 and lay.pp == 1 and lay.cp == 1)
          or _fastest_any(plan, lambda lay: lay.tp > 1 and lay.cp == 1))
    if tp:
        lines.append(
            f"- Tensor parallelism splits every matmul within a node (tp ≤ {plan.cluster.gpus_per_node}): weights, "
            f"gradients, states and (with sequence parallelism) activations shrink by t. It costs collectives "
            f"in every layer's forward and backward ({_tp_cost(tp)}), "
            "which only fast intra-node links make affordable.")
    lines += _megatron_lines(plan, usable)
    pp = _best(plan, lambda lay: lay.pp > 1) or _fastest_any(plan, lambda lay: lay.pp > 1)
    if pp:
        lines.append(
            f"- Pipeline parallelism splits the layers into stages across ranks (and nodes): model states ÷ p "
            f"and only point-to-point traffic between stages, but the first stage holds up to p micro-batches "
            f"of activations and the pipeline idles at its ends (bubble {fmt_duration(pp.time.bubble_s)}/step for "
            f"{pp.layout.describe()}); more micro-batches, interleaving or zero-bubble schedules shrink it "
            "(zero-bubble ones with ZeRO-1/2, or in fp32 without replicas).")
    return lines


def _activation_section(plan: Plan, usable: float) -> list[str]:
    """When activations, not model states, keep the fully sharded layout from fitting: what each technique
    that shrinks activations does to them (recompute, micro-batch, sequence and context parallelism)."""
    world, wl = plan.cluster.world_size, plan.workload
    sharded = estimate_memory(plan.model, Layout(dp_shard=world, zero_stage=3, micro_batch=1), wl)
    states = sharded.params + sharded.grads + sharded.optim
    if sharded.total <= usable or sharded.activations <= states:
        return []
    lines = ["", f"What does not fit here is activations, not weights: ZeRO-3 over {world} ranks leaves "
             f"{fmt_bytes(states)} of model states per rank, but one sequence of {wl.seq_len} tokens keeps "
             f"{fmt_bytes(sharded.activations)} of activations (peak at {sharded.phase}). What answers it:"]
    plain = lambda lay: lay.tp == 1 and lay.pp == 1 and lay.cp == 1  # noqa: E731
    techniques = [
        ("recompute (activation checkpointing full) keeps only each block's input",
         lambda lay: plain(lay) and lay.activation_checkpointing == "full"),
        ("sequence parallelism splits the norms' and residual stream's activations over the tensor-parallel "
         "ranks (with tp, in a node)", lambda lay: lay.sp and lay.cp == 1 and lay.pp == 1),
        ("context parallelism splits every sequence over cp ranks (each keeps seq/cp of every activation plus "
         "the gathered keys and values)", lambda lay: lay.cp > 1),
    ]
    for words, test in techniques:
        found = _best(plan, test) or _fastest_any(plan, test)
        acts = f"activations {fmt_bytes(found.memory.activations)}; " if found else ""
        lines.append(f"- {words}: {acts}{_line(found, usable)}")
    # The fully sharded layout above runs one sequence per forward already (micro-batch 1).
    lines.append("- a smaller micro-batch cannot help: one sequence per forward pass is the least there is; the "
                 "sequence's own activations must be recomputed or split.")
    return lines


def _megatron_lines(plan: Plan, usable: float) -> list[str]:
    """Megatron-LM's standard layout (TP × PP × ZeRO-1) against FSDP × TP on this cluster."""
    def zero1_tp_pp(lay: Layout) -> bool:
        return lay.tp > 1 and lay.pp > 1 and lay.zero_stage == 1 and lay.cp == 1

    def fsdp_tp(lay: Layout) -> bool:
        return lay.tp > 1 and lay.pp == 1 and lay.zero_stage == 3 and lay.cp == 1

    megatron = _best(plan, zero1_tp_pp) or _fastest_any(plan, zero1_tp_pp)
    fsdp = _best(plan, fsdp_tp) or _fastest_any(plan, fsdp_tp)
    if megatron is None or fsdp is None:
        return []
    if megatron.fits and fsdp.fits:
        winner, loser = (megatron, fsdp) if megatron.time.tokens_per_s >= fsdp.time.tokens_per_s else (fsdp, megatron)
        verdict = (f"{winner.layout.describe()} is {winner.time.tokens_per_s / loser.time.tokens_per_s:.2f}× "
                   f"faster than {loser.layout.describe()}")
    else:
        verdict = "only " + (megatron if megatron.fits else fsdp).layout.describe() + " fits" \
            if (megatron.fits or fsdp.fits) else "neither fits"
    return [
        "- Megatron's layout, ZeRO-1 × TP × PP, against FSDP × TP: "
        f"{_line(megatron, usable)} (pipeline bubble {fmt_duration(megatron.time.bubble_s)}, "
        f"DP {fmt_duration(megatron.time.dp_comm_s)}) "
        f"vs {_line(fsdp, usable)} (DP {fmt_duration(fsdp.time.dp_comm_s)}): {verdict}. ZeRO-1 gathers the weights "
        "once per step and the pipeline splits them further; FSDP gathers every block in each forward and "
        "backward but needs no pipeline bubble."]


def _recommendation(plan: Plan, usable: float) -> list[str]:
    best = plan.best
    lines = [""]
    if best is None:
        closest = plan.candidates[0] if plan.candidates else None
        lines.append("Recommendation: nothing fits this cluster. " + (
            f"The closest is {closest.layout.describe()} at {fmt_bytes(closest.memory.total)} per rank: add "
            + ("ranks, give each a larger budget" if is_cpu(plan.cluster.gpu) else "GPUs, use GPUs with more memory")
            + ", or shorten the sequence." if closest else ""))
        return lines
    t = best.time
    lines.append(f"Recommended: {best.layout.describe()}")
    lines.append(f"  memory per rank {fmt_bytes(best.memory.total)} of {fmt_bytes(usable)} usable "
                 f"({_parts(best.memory)})")
    d = fmt_duration
    lines.append(f"  step {d(t.total_s)} = compute {d(t.compute_s)} (element-wise {d(t.elementwise_s)}, recompute "
                 f"{d(t.recompute_s)}) + TP "
                 f"{d(t.tp_comm_s)} + CP {d(t.cp_comm_s)} + EP {d(t.ep_comm_s)} + DP {d(t.dp_comm_s)} + PP "
                 f"{d(t.pp_comm_s)} + bubble "
                 f"{d(t.bubble_s)} + "
                 f"offload {d(t.offload_s)} + optimizer {d(t.optimizer_s)}; {t.tokens_per_s:,.0f} tokens/s, "
                 f"MFU {t.mfu:.0%}")
    lines.append(_compile_line(plan, best))
    if plan.workload.document_mask:
        lines.append(_document_mask_line(plan, best))
    alternatives = [
        ("without CPU offload", _best(plan, lambda lay: not lay.offload)),
        ("without pipeline parallelism", _best(plan, lambda lay: lay.pp == 1)),
        ("without tensor parallelism", _best(plan, lambda lay: lay.tp == 1)),
        ("without context parallelism", _best(plan, lambda lay: lay.cp == 1)),
        ("pure data parallelism (ZeRO/FSDP only)",
         _best(plan, lambda lay: lay.tp == 1 and lay.pp == 1 and lay.cp == 1)),
    ]
    lines.append("Alternatives:")
    for label, cand in alternatives:
        lines.append(f"  best {label}: {_line(cand, usable)}")
    lines.append(f"({len(plan.fitting)} of {len(plan.candidates)} evaluated layouts fit; `meshfit plan --json` "
                 "lists them all, `meshfit verify --layout …` checks one with the real code.)")
    return lines


def _compile_line(plan: Plan, best: Candidate) -> str:
    """What train.compile buys the recommended layout in the time model: fused element-wise kernels."""
    from meshfit.planner.timing.estimate import COMPILED_ELEMENTWISE, step_time

    other = dataclasses.replace(plan.workload, compiled=not plan.workload.compiled)
    flipped = step_time(plan.model, best.layout, other, plan.cluster)
    eager, compiled = (flipped, best.time) if plan.workload.compiled else (best.time, flipped)
    head = "  compiled blocks (train.compile; `meshfit plan --compile` plans them): "
    if eager.elementwise_s == 0.0:
        return head + ("no change modelled: the calibrated rate (calibrate --model) holds the element-wise work "
                       "as measured, eagerly.")
    d = fmt_duration
    return (head + f"element-wise {d(eager.elementwise_s)} → {d(compiled.elementwise_s)}, "
            f"step {d(eager.total_s)} → {d(compiled.total_s)} ({eager.total_s / compiled.total_s:.2f}× faster). "
            f"Assumed: the blocks' fused element-wise kernels move {COMPILED_ELEMENTWISE:.0%} of the eager bytes "
            "(counted, not measured on a GPU); matmuls, attention, communication and memory unchanged.")


def _document_mask_line(plan: Plan, best: Candidate) -> str:
    """Which kernel runs the recommended layout's document mask, and what the mask holds."""
    from meshfit.models.mask_kernel import describe
    from meshfit.planner.memory.activations import document_mask_bytes, document_mask_kernel

    backend = "gloo" if is_cpu(plan.cluster.gpu) else "nccl"
    kernel = document_mask_kernel(plan.workload, best.layout, backend)
    mode = "fp32" if plan.workload.precision == "fp32" else "bf16"
    held = document_mask_bytes(plan.model, plan.workload, best.layout, mode, backend)
    return (f"  document mask (data.document_mask): {describe(kernel)}; {fmt_bytes(held)} per micro-batch and "
            "stage with RoPE's per-token angles, kept for backward (counted in activations); attention time modelled as plain causal "
            "attention (an upper bound: tiles across documents are skipped by FlexAttention only)")


def explain(plan: Plan) -> str:
    """The plain-language answer to "which techniques should we use?" for ``plan``'s model and cluster."""
    usable = usable_bytes(plan.cluster.gpu)
    return "\n".join(_states_section(plan, usable) + _technique_section(plan, usable)
                     + _activation_section(plan, usable) + _recommendation(plan, usable)
                     + expert_lines(plan, usable) + footprint_lines(plan, usable))


def _tp_cost(candidate: Candidate) -> str:
    if candidate.time.tp_comm_s == 0.0:  # a calibrated tensor-parallel rate holds its collectives
        return f"measured within the compute of {candidate.layout.describe()} by the calibration"
    return f"{fmt_duration(candidate.time.tp_comm_s)}/step for {candidate.layout.describe()}"
