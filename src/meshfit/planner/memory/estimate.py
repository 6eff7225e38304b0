"""Per-rank peak memory of one layout, by component, for the most-loaded rank.

The estimate follows what meshfit's torch building blocks keep, phase by phase, in a steady training step
(step ≥ 2: optimizer states exist, gradients were freed by the previous step), and reports the components
at the phase with the largest total:

* ``loss``: the forward of the last micro-batch is done — every block's saved activations, the logits and
  the loss's softmax, gradients accumulated from earlier micro-batches, FSDP's gathered units.
* ``backward end``: every gradient exists (DDP's are views into its communication buckets).
* ``optimizer``: gradients and states (the fused AdamW step keeps no temporaries worth counting).

Components (bytes), as the memory tracker folds them: ``params`` (resident weights plus gathered copies),
``grads`` (plus reduce-scatter buffers), ``optim``, ``activations`` (saved tensors, logits, temporaries) and
``buffers`` (module buffers: the RoPE tables). Allocator headroom is not a tensor: the planner
adds it when it compares the total with a device (see :func:`usable_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshfit.hardware.catalog import GPU
from meshfit.layout.data_parallel_kind import data_parallel_kind, reduces_in_background, stashes_gradients
from meshfit.layout.layout import Layout, Workload
from meshfit.layout.precision import STORAGE_BYTES, state_bytes
from meshfit.models.config import ModelConfig, pad_vocab_for_tp
from meshfit.planner.memory.activations import document_mask_bytes, embedding_bytes, head_bytes, layout_activations
from meshfit.planner.memory.experts import ep_share, local_experts_model
from meshfit.planner.memory.formulas import pipeline_in_flight_microbatches
from meshfit.planner.memory.phase_terms import (
    RootReduce,
    Stage3Terms,
    boundary_tensors,
    interleaved_peak,
    pipe_stages,
    pipelined_stage3_phases,
    root_reduce_phase,
    stage_acts,
    weight_step_acts,
)
from meshfit.planner.memory.shares import Share, layout_shares

COMPONENTS = ("params", "grads", "optim", "activations", "buffers")
# Temporaries of a block's backward, in h-wide values per token (compute dtype), measured with the dry
# run's timeline: Llama blocks 6 (`small` and `tiny`, seq 128-2048, fp32 and mixed, with and without
# recompute); GPT blocks (biases, LayerNorm, GELU) 14 (a hidden-16,384 GPT under ZeRO-3 units).
BACKWARD_TEMPS = {"llama": 6, "gpt": 14}


def usable_bytes(gpu: GPU) -> float:
    """The bytes of ``gpu``'s memory tensors can use: the CUDA context, NCCL buffers and the caching
    allocator's fragmentation take the rest (GPU.allocator_headroom; none for CPU ranks' budgets)."""
    return gpu.memory_bytes * (1 - gpu.allocator_headroom)


@dataclass(frozen=True)
class MemoryEstimate:
    params: float
    grads: float
    optim: float
    activations: float
    buffers: float
    phase: str  # the phase of the peak
    pp_rank: int = 0  # pipeline rank of the most-loaded stage
    # Weights, gradients and optimizer states this rank holds between steps (see at_rest_dict).
    rest: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # The most activation bytes at any phase (what Korthikanti et al. count, with logits and temporaries).
    # It can exceed `activations`, taken where the total peaks: under SP a pipeline's first stage peaks at
    # a backward's end, its units all gathered and one micro-batch fewer in flight than at its start.
    activation_peak: float = 0.0
    total: float = field(init=False)

    def __post_init__(self) -> None:
        # Computed once: ranking compares totals of thousands of estimates.
        object.__setattr__(self, "total", self.params + self.grads + self.optim + self.activations + self.buffers)

    def as_dict(self) -> dict[str, int]:
        out = {name: int(round(getattr(self, name))) for name in COMPONENTS}
        out["total"] = sum(out.values())
        return out

    def at_rest_dict(self) -> dict[str, int]:
        """Bytes held between steps: stages 1-3 keep fp32 (master) weights and states sharded and free
        their gradients after the step; DDP keeps a full replica and its gradient buckets; with offload
        the device holds none of them."""
        out = {name: int(round(value)) for name, value in zip(("params", "grads", "optim"), self.rest, strict=True)}
        out["total"] = sum(out.values())
        return out


def _kind(layout: Layout, workload: Workload) -> str:
    # Context-parallel ranks hold the same weights: they join the data-parallel replicas or shards.
    return data_parallel_kind(layout.zero_stage, layout.dp * layout.cp, layout.tp, workload.precision != "fp32")


def _mode(workload: Workload) -> str:
    # Mixed precision computes on FSDP2's 16-bit weight copies whatever the layout (layout/data_parallel_kind.py).
    return "fp32" if workload.precision == "fp32" else "bf16"


def _reduce_bytes(workload: Workload, layout: Layout, c_bytes: int) -> int:
    """Bytes per element of FSDP's unsharded gradients accumulated without a reduction.

    Mixed precision reduces in fp32 at stages 2 and 3 (so unsynchronised gradients are kept in fp32) unless
    `reduce_dtype` is "compute", and in the 16-bit compute dtype at stage 1 (see parallel/data_parallel.py).
    """
    if workload.precision == "mixed" and layout.zero_stage != 1 and layout.reduce_dtype == "fp32":
        return 4
    return c_bytes


@dataclass(frozen=True)
class _States:
    """Bytes of weights, gradients and optimizer states one rank keeps (most-loaded rank of its share)."""

    params: float  # resident weights: fp32 master weights (sharded at stages 1-3)
    grads: float  # gradients once reduced (sharded at stages 1-3)
    optim: float
    at_rest_grads: float  # gradients kept between steps: DDP's, which are views into its lifelong buckets


def _states(layout: Layout, workload: Workload, n: float) -> _States:
    w_bytes, g_bytes, o_bytes = state_bytes(workload.precision, workload.optimizer)
    if layout.offload:
        return _States(0.0, 0.0, 0.0, 0.0)
    share = layout.shard if layout.zero_stage >= 1 else 1
    grads = n * g_bytes / share
    ddp = _kind(layout, workload) == "ddp"
    return _States(n * w_bytes / share, grads, n * o_bytes / share, grads if ddp else 0.0)


def _rank_estimate(model: ModelConfig, layout: Layout, workload: Workload, share: Share, rank: int,
                   backend: str = "nccl") -> MemoryEstimate:
    phases = _phases(model, layout, workload, share, rank, backend)
    totals = {name: sum(parts) for name, parts in phases.items()}
    phase = max(totals, key=totals.__getitem__)
    st = _states(layout, workload, share.params)
    return MemoryEstimate(*phases[phase], phase=phase, pp_rank=rank, rest=(st.params, st.at_rest_grads, st.optim),
                          activation_peak=max(parts[3] for parts in phases.values()))


def _embedding_grad(model: ModelConfig, layout: Layout, c_bytes: int, r_bytes: int) -> tuple[float, float, float]:
    """A pipelined first stage's embedding gradient under tensor parallelism, which torch makes
    full-vocabulary (Stage3Terms' embedding_grad, embedding_copy, embedding_accumulator, in bytes).

    ZeRO-3: full-vocabulary fp32 at a backward's end, and a reduce-dtype copy of the local gradient kept
    between backwards (Llama-3 8B and `small`, PP 2 × FSDP 2 × TP 2 + SP). Replicas of 16-bit weight copies
    (stage 0): it accumulates full-vocabulary in fp32, in place of the local accumulator, from the first
    backward to the step's end, and each backward makes it in the compute dtype first (the dry run's
    timeline, GPT-3 175B shapes, PP 8 × TP 8 with and without SP, 1F1B, mixed precision: 2.34 GiB held,
    1.17 GiB more at a backward's end)."""
    if layout.tp == 1:
        return 0.0, 0.0, 0.0
    full = model.padded_vocab * model.dim
    if layout.zero_stage == 3:
        return full * 4, full / layout.tp * r_bytes, 0.0
    return full * c_bytes, 0.0, full * 4 - full / layout.tp * r_bytes


def _phases(model: ModelConfig, layout: Layout, workload: Workload, share: Share, rank: int,
            backend: str = "nccl") -> dict[str, tuple[float, float, float, float, float]]:
    """(params, grads, optim, activations, buffers) of one rank at each phase of a steady step."""
    mode = _mode(workload)
    kind = _kind(layout, workload)
    c_bytes = 4 if mode == "fp32" else 2
    stage, ds = layout.zero_stage, layout.shard  # FSDP shards over dp_shard × cp
    n = share.params
    # FSDP2 keeps gathered compute copies: sharding over dp_shard × cp ranks, or replicas of TP weights.
    fsdp = (stage >= 1 and ds > 1) or kind == "replicas"
    keep = stage in (1, 2)  # gathered weights kept from forward to the last micro-batch's backward
    st = _states(layout, workload, n)
    params, optim, grads_full = st.params, st.optim, st.grads
    # RoPE's cos/sin tables (fp32, max_seq_len × head_dim each) live in every Llama stage module.
    buckets = 2 * model.max_seq_len * model.head_size * 4 * share.stages if model.family == "llama" else 0.0
    tokens = workload.seq_len // layout.cp * layout.micro_batch  # this rank's part of each sequence
    act_mb, recompute = layout_activations(model, layout, workload, share.layers, mode,
                                           share.rerun(layout.activation_checkpointing))
    # One micro-batch's saved tensors on this rank: its blocks' and, on the first stage, the embedding's.
    saved_mb = act_mb + (embedding_bytes(model, seq=workload.seq_len, batch=layout.micro_batch,
                                         dropout=workload.dropout, cp=layout.cp) if share.first else 0.0)
    # A document mask: one per micro-batch and stage, kept for backward by every block's attention.
    saved_mb += document_mask_bytes(model, workload, layout, mode, backend) * share.stages
    block_temps = BACKWARD_TEMPS[model.family] * tokens * model.dim * c_bytes / (layout.tp if layout.sp else 1)
    local = workload.global_batch // layout.dp
    micro = max(1, local // layout.micro_batch)
    # GPipe runs every forward, loss included, before any backward; the other schedules start a
    # micro-batch's backward right after its loss.
    held = micro if (layout.pp > 1 and layout.schedule == "gpipe") else 1
    head = head_bytes(model, layout, mode, tokens, held) if share.last else 0.0
    head_saved = head_bytes(model, layout, mode, tokens, held, transient=False) if share.last else 0.0
    # Stage 1 and stage-0 replicas accumulate full, unreduced gradients until the last micro-batch (in the
    # reduce dtype).
    unsharded = n - share.expert_surplus  # the dense part and the rank's E/ep experts
    accumulated = unsharded * _reduce_bytes(workload, layout, c_bytes) if (fsdp and stage <= 1 and micro > 1) else 0.0
    # ZeRO-2 under mixed precision: earlier micro-batches' gradient shards wait in bf16 (GradientStash) until
    # the last micro-batch's backward has made its fp32 ones, and are added into them after it.
    g_store = STORAGE_BYTES[workload.precision]
    stash = (grads_full * c_bytes / g_store
             if stashes_gradients(stage, workload.precision == "mixed", micro, layout.pp > 1) else 0.0)
    in_flight, grad_share = 1, 1.0  # grad_share: of the stages' accumulators, those alive at the peak
    if layout.pp > 1:
        per_stage = saved_mb / share.stages
        in_flight = pipeline_in_flight_microbatches(layout.schedule, layout.pp, rank, micro,
                                                    layout.virtual_stages)
        boundary = tokens * model.dim * (4 if mode == "fp32" else 2) / (layout.tp if layout.sp else 1)
        # 1F1B-style schedules reach their most in-flight micro-batches at the first backward and again in
        # their steady state, after which the stage's gradients exist. A rank that holds every micro-batch
        # of the step at once (GPipe; the others with no more micro-batches than their warm-up) has that
        # peak only before its first backward, when no gradient exists yet. An interleaved rank's stages
        # start their backwards at different times: the heaviest backward start of its order counts the
        # micro-batches then in flight and the gradients of the stages that have run a backward.
        grads_loss = 0.0 if in_flight >= micro * share.stages else grads_full
        if layout.schedule == "interleaved-1f1b" and not (fsdp and stage == 3):
            # The gradients that appear at a stage's first backward: FSDP's unsharded accumulators; without
            # FSDP, what is not held all step (DDP's buckets are).
            appear = (n * _reduce_bytes(workload, layout, c_bytes) if fsdp
                      else grads_full - st.at_rest_grads)
            in_flight, appeared = interleaved_peak(layout.pp, rank, micro, layout.virtual_stages, per_stage,
                                                   appear)
            grad_share = appeared / appear if appear else 1.0
            grads_loss = appeared if fsdp else st.at_rest_grads + appeared
        saved = stage_acts(model, layout, workload, mode, share, rank, micro, per_stage, in_flight)
        acts = saved + head + boundary * boundary_tensors(share.stages, share.last, in_flight)
    else:
        acts = saved_mb + head
        grads_loss = stash or accumulated or (grads_full if micro > 1 else 0.0)
        if micro > 1 and layout.tp > 1 and share.last and (kind == "none" or accumulated):
            # Accumulating DTensor gradients is out of place: the head's new weight gradient exists next to
            # the accumulated one (plain tensors accumulate in place).
            g_bytes = c_bytes if accumulated else STORAGE_BYTES[workload.precision]
            grads_loss += model.padded_vocab * model.dim / layout.tp * g_bytes
    grads_loss = max(grads_loss, st.at_rest_grads)
    gathered = gathered_loss = unit_grads = working = 0.0
    with_grads: float | None = None  # gathered while a unit's gradients exist, when it differs
    if fsdp:
        # The root unit stays gathered through forward and backward. Stage 3 holds the current block and
        # the prefetched next one; stages 1 and 2 keep every block from its forward to its backward. In
        # backward a block's unsharded gradients exist until reduce-scattered.
        # Replicas of tensor-parallel weights hold one gathered copy of a block at a time (measured). Stage
        # 3 gathers unit by unit: a block, or its parts when it is split (parallel/fsdp_units.py).
        unit = share.unit_params
        live = min(1 if kind == "replicas" else 2, share.layers)
        gathered = (share.root_params + (share.layers * share.block_params if keep else live * unit)) * c_bytes
        # At the loss stage 3 holds the root and at most one unit (the last one is re-sharded after its
        # forward; backward gathers it again).
        gathered_loss = (share.root_params + (share.layers * share.block_params if keep else unit)) * c_bytes
        grad_unit = share.grad_unit_params or unit  # a padded all-gather's unit has unpadded gradients
        unit_grads = grad_unit * c_bytes
        r_bytes = _reduce_bytes(workload, layout, c_bytes)
        whole_rerun = layout.activation_checkpointing == "op" or share.rerun(layout.activation_checkpointing) > 0
        if unit < share.block_params and not keep and whole_rerun:
            # A recomputed block runs its forward again inside backward, and FSDP2 does not re-shard units
            # gathered then (their backward follows): the whole block is gathered until its last unit's
            # gradients exist, which FSDP2 re-shards before reducing them (measured with the dry run).
            gathered = (share.root_params + share.block_params) * c_bytes
            with_grads = gathered - unit * c_bytes
        if mode == "bf16":
            # Measured with 16-bit compute: either the last block's backward starts (gradient temporaries
            # of BACKWARD_TEMPS h-wide values, no gradients yet) or its 16-bit gradients exist next to their
            # fp32 copy for the reduce-scatter; the larger of the two is the peak. Reduced in the compute
            # dtype there is no copy.
            unit_grads = grad_unit * (r_bytes + c_bytes if r_bytes != c_bytes else c_bytes)
            working = block_temps
        if accumulated:
            # New gradients are added into the accumulated ones: compute-dtype temporaries, the largest
            # being the head's weight gradient; accumulated in a wider reduce dtype (stage 0 under mixed
            # precision), a block's new gradients and their upcast copy (measured with torch's tracker).
            unit_grads = 0.0
            head_weight = model.padded_vocab * model.dim / layout.tp if share.last else share.block_params
            upcast = share.unit_params * (c_bytes + r_bytes) if r_bytes != c_bytes else 0.0
            working = max(working, head_weight * c_bytes, upcast)
        if layout.pp > 1:
            # torch's PipelineStage defers FSDP's gradient reduce-scatter and re-sharding to the end of the
            # step: after the first backward every unit stays gathered and gradients accumulate unsharded.
            gathered = gathered_loss = (share.root_params + (share.layers + 1) * share.block_params) * c_bytes
            grads_loss = n * _reduce_bytes(workload, layout, c_bytes) * grad_share
            unit_grads = working = 0.0
    # On gloo a reduce-scatter receives its input's size in chunks (parallel/host_reduce.py): one unit's
    # gradients in the reduce dtype; a cast input has freed the 16-bit ones (2 × 4 bytes per parameter where
    # NCCL holds 2 + 4). In the background (not in the micro-batches ZeRO-2's stash takes) a later
    # micro-batch's block shard waits next to the earlier gradients. Measured with the tracker.
    background = reduces_in_background(stage, ds, layout.dp_replicate > 1, workload.precision == "mixed",
                                       layout.pp > 1, backend, layout.reduce_dtype)
    r_bytes = _reduce_bytes(workload, layout, c_bytes)
    # (Offloaded, the waiting shard is in host memory: real 2-rank `small` ZeRO-3 + offload on gloo.)
    pending = (share.unit_params * r_bytes / ds
               if background and stage >= 2 and micro > 1 and not stash and share.layers > 1
               and not layout.offload else 0.0)
    gloo_copy = (share.unit_params * (r_bytes - c_bytes if r_bytes != c_bytes else r_bytes)
                 if backend == "gloo" and fsdp and stage >= 1 and layout.pp == 1 else 0.0)
    # In the blocks' backward the trainer's reference keeps the logits (compute dtype) alive until backward
    # returns; the loss's log-softmax output and the logits' gradients are gone, and FSDP's root unit holds
    # the head's unsharded weight gradient until it reduces at the end of backward (measured with the dry
    # run's timeline, `small` at seq 1024, fp32 and mixed precision, with and without recompute). GPipe adds
    # the saved tensors of micro-batches whose loss has not run backward yet.
    vocab = model.padded_vocab / layout.tp if layout.loss_parallel else model.padded_vocab
    head_grad = model.padded_vocab * model.dim / layout.tp * c_bytes
    logits_held = tokens * vocab * c_bytes if share.last and layout.pp == 1 else 0.0
    if layout.pp == 1:
        last_loss = logits_held + (head_grad if fsdp and not accumulated else 0.0)
    else:
        last_loss = tokens * vocab * (c_bytes + 8) + head_saved * (held - 1) / held
    block_acts = acts - head + (last_loss if share.last else 0.0)
    # Stage 3: the all-gather buffer of the next block, and without mixed precision the root's all-gather
    # output next to its unsharded parameters at the end of the forward (measured).
    spare = share.unit_params * c_bytes if fsdp and not keep and gathered else 0.0
    root_copy = share.root_params * c_bytes if spare and c_bytes == 4 else 0.0
    # fp32 without recompute: a block's backward peaks either with its temporaries, before its gradients
    # exist (long sequences), or once its gradients exist (short ones): the larger of the two.
    fp32_temps = (block_temps if fsdp and mode == "fp32" and layout.activation_checkpointing == "none"
                  and layout.pp == 1 else 0.0)
    fp32_temps = fp32_temps if fp32_temps > unit_grads else 0.0
    phases = {
        # Stage 3 (and stage-0 replicas) re-shard the root too once the model's forward returns, before
        # the loss runs (measured with torch's tracker): only stages 1 and 2 hold gathered weights here.
        "loss": (params + (gathered_loss if keep else 0.0), grads_loss, optim, acts, buckets),
        # The end of the forward: the loss has only its saved tensors (plus the fp32 copy of 16-bit
        # logits, counted in the loss phase); stage 3 has re-sharded the last block.
        "forward end": (params + gathered_loss - spare + root_copy, grads_loss, optim, acts - (head - head_saved),
                        buckets),
        "backward": (params + gathered,
                     # With every other block checkpointed the recompute of the last block comes before
                     # any block gradient (measured); with all blocks checkpointed they overlap.
                     grads_loss + (0.0 if layout.activation_checkpointing == "selective" or working
                                   or with_grads is not None or fp32_temps else unit_grads),
                     optim, block_acts + recompute + working + fp32_temps, buckets),
        # ... and once its gradients exist, most of the last block's activations are freed.
        "block gradients": (params + (gathered if with_grads is None else with_grads),
                            grads_loss + unit_grads + pending, optim,
                            block_acts + recompute - act_mb / max(1, share.layers) + gloo_copy, buckets),
        "backward end": (params + (share.root_params * c_bytes if fsdp else 0), grads_full + stash, optim, 0.0,
                         buckets),
        # The fused AdamW step updates tensor by tensor in place: no temporaries worth counting.
        "optimizer": (params, grads_full, optim, 0.0, buckets),
    }
    if background and share.layers > 1:
        # A block's reduce-scatter runs on through the next block's backward: its input and chunks (temps,
        # folded into activations as the tracker does). Measured, the peak comes before the next block's
        # gradients exist; at stage 1 (last micro-batch) the input replaced the block's gradients, its
        # shard is new and its activations are gone (2-rank `small`: +1.4 to +3.4% over real peaks).
        reducing = share.unit_params * r_bytes * (2 if stage >= 2 else 1 + 1 / ds)
        gone = act_mb / share.layers if stage == 1 else 0.0
        phases["reduce in flight"] = (params + gathered, grads_loss + pending, optim,
                                      block_acts + recompute + working - gone + reducing, buckets)
    if fsdp and layout.pp > 1 and not keep:
        for name in ("loss", "forward end", "backward", "block gradients"):
            del phases[name]
        stages, moments = pipe_stages(share, layout.schedule, layout.pp, rank, micro, in_flight)
        phases.update(pipelined_stage3_phases(Stage3Terms(
            params, optim, buckets, c_bytes, r_bytes, st.grads / n, ds,
            share.block_params, share.unit_params,
            # A recomputed split block is gathered whole by its re-run forward (see `with_grads` above).
            share.block_params if with_grads is not None else share.unit_params, per_stage,
            boundary * boundary_tensors(share.stages, share.last, 1),
            head_saved / held, head - head_saved, held, tokens * vocab * c_bytes, tokens * vocab * 4,
            recompute + working, block_temps, *_embedding_grad(model, layout, c_bytes, r_bytes)), stages, moments))
    step = weight_step_acts(model, layout, workload, mode, share, rank, micro, saved_mb / share.stages) \
        if layout.pp > 1 else 0.0
    if step:
        # The split backward's weight-gradient step under recompute (phase_terms.WEIGHT_STEP): it follows a
        # backward, so the stage's gradients exist even where every micro-batch is in flight at once.
        phases["weight step"] = (params + (gathered_loss if keep else 0.0), max(grads_loss, grads_full), optim,
                                 step + boundary * boundary_tensors(share.stages, share.last, in_flight), buckets)
    if st.at_rest_grads and (micro > 1):
        # DDP re-orders its buckets once, at the forward of a launch's second step: with gradient
        # accumulation the old buckets (kept by the gradients' views) and the new ones coexist there.
        phases["bucket rebuild"] = (params, 2 * st.at_rest_grads, optim, 0.0, buckets)
    if fsdp and layout.pp == 1 and share.last and not accumulated:
        # The head's backward: its weight gradient (compute dtype, unsharded) next to every saved tensor;
        # stage 3 has not gathered the last block again yet. Of the loss, the logits and one fp32 gradient
        # of them are alive (the dry run's timeline, `small` at seq 1024, fp32 and mixed precision).
        at_head = acts - head + tokens * vocab * (c_bytes + 4) + head_saved * (held - 1) / held
        held_params = params + (gathered_loss if keep else share.root_params * c_bytes)
        phases["head backward"] = (held_params, grads_loss, optim, at_head + head_grad, buckets)
    if fsdp and layout.pp == 1:
        r_bytes = _reduce_bytes(workload, layout, c_bytes)
        phases["root reduce"] = root_reduce_phase(
            RootReduce(layout.zero_stage, layout.tp, layout.shard, micro, share.root_params, share.params,
                       c_bytes, r_bytes),
            # Stage 3 re-shards the root before reducing; stages 1/2 keep every unit gathered when later
            # micro-batches reused them.
            params + (gathered if keep and micro > 1 else 0.0), st.params, st.grads, accumulated, optim,
            buckets, stash, logits_held)
    return phases


def estimate_memory(model: ModelConfig, layout: Layout, workload: Workload, backend: str = "nccl"
                    ) -> MemoryEstimate:
    """Peak tensor memory of the most-loaded rank of ``layout`` (see the module notes for the phases);
    ``backend`` "gloo" for CPU ranks (reduce-scatters through received chunks, some in the background)."""
    model = pad_vocab_for_tp(model, layout.tp)  # as training builds it
    # Expert parallelism: blocks of E/ep routed experts, whose states are kept as planner/memory/experts.py says.
    shares = tuple(ep_share(model, layout, share)
                   for share in layout_shares(local_experts_model(model, layout.ep), layout, workload))
    # In-flight micro-batches fall with the pipeline rank, so the most-loaded rank is the first, the last
    # (head, logits) or the one with the most blocks; the others need not be evaluated.
    ranks = {0, len(shares) - 1, max(range(len(shares)), key=lambda r: shares[r].layers)}
    estimates = [_rank_estimate(model, layout, workload, shares[rank], rank, backend) for rank in sorted(ranks)]
    return max(estimates, key=lambda e: e.total)
