"""Terms of the memory estimate (planner/memory/estimate.py) that follow how torch's FSDP2 and pipelining run.

The root reduction (`root_reduce_phase`): the end of backward, when the root unit reduces its gradients.

A pipeline rank's micro-batches in flight (`stage_acts`), the split backward of zbv, interleaved-zb and
dualpipev included.

A pipeline rank whose stages are sharded at ZeRO-3 (`pipelined_stage3_phases`): torch's stage defers FSDP's
gradient reduction to a stage's last backward, so a stage's gradients accumulate unsharded (in the reduce
dtype) from its first backward to its last, and its units stay gathered after a backward until a forward
of the stage re-shards them. The phases walk the rank's order of forwards and backwards (memory.rank_actions)
and keep the heaviest moment of each kind; measured with the dry run's timeline (Llama-3 8B, PP 4 × FSDP 16,
1F1B, 4 and 8 micro-batches; `small`, PP 2 × FSDP 2, 1F1B, GPipe and interleaved 1F1B, mixed precision
and fp32), the peak is one of:

* the end of a backward: every unit of the stage gathered, every gradient accumulated, the last unit's
  (on the first stage the embedding's) compute-dtype gradient next to its reduce-dtype accumulator, and
  the micro-batch just finished gone from the micro-batches in flight;
* the start of a backward: the units re-sharded by the forwards in between (the root and the unit in
  backward gathered), the accumulated gradients and the unit's new one, every micro-batch in flight;
* on the loss's stage, the loss's and the head's backward;
* a stage's last backward, which reduces its gradients unit by unit.

An interleaved rank's stages start and finish their backwards at different times: at m = p the last
stage's backwards all run before the first stage's, so the rank never holds both stages' accumulators
(Llama-3 8B, PP 4 interleaved × FSDP 16: the dry run's 18.3 GiB, where treating the rank as one stage
planned 23.9).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from meshfit.layout.recompute import rerun_blocks
from meshfit.layout.schedules import SPLIT_BACKWARD
from meshfit.planner.memory.activations import layout_activations
from meshfit.planner.memory.formulas import rank_actions, split_backward_states

if TYPE_CHECKING:
    from meshfit.layout.layout import Layout, Workload
    from meshfit.models.config import ModelConfig
    from meshfit.planner.memory.shares import Share

Parts = tuple[float, float, float, float, float]
# zbv's split backward, in one block's full (un-recomputed) activations, from the dry run's timeline of
# `small` (dim 256), PP 2 zbv, seq 2048, 1/2/4 blocks per stage, 2–8 micro-batches. Between its input- and
# weight-gradient steps a micro-batch keeps SPLIT_HELD = (fixed, per block kept whole, per recomputed
# block), by compute mode: a kept block its saved tensors and its weights' output gradients (fp32 1.64,
# 1.72–1.75 with one block per stage; mixed precision under ZeRO-1 2: 1.84), a recomputed one what the
# input-gradient step re-ran and did not consume (0.70–0.81 in fp32 and under mixed precision; Llama-3 8B,
# 5 blocks per stage, mixed: 0.77).
SPLIT_HELD = {"fp32": (0.08, 1.64, 0.75), "bf16": (0.08, 1.84, 0.75)}
# Under recompute the weight-gradient step re-runs the recomputed blocks again, about once per weight group
# (planner/timing/estimate.py SPLIT_RERUNS), and holds what it re-ran to the step's end: WEIGHT_STEP = (fixed, per
# block under full recompute, per block under selective) above the micro-batch's held state, from the
# same timelines: fp32 (middle stages) 1.35 + 5.5 per block (1/2/4 blocks per stage), 4.56 per recomputed
# block under selective (1 of 2 or 3, 2 of 4); mixed precision under ZeRO-1 2 (the loss stage) 1.4 + 6.9
# (full), 6.2 (selective, 2 of 4). Llama-3 8B, PP 4 zbv × ZeRO-1 2, seq 4096, 5 blocks per stage, measured
# 35.4 blocks where this plans 35.9. Keyed by compute mode: 16-bit compute counts as mixed precision does
# (bf16 storage unmeasured).
WEIGHT_STEP = {"fp32": (1.35, 5.5, 4.56), "bf16": (1.4, 6.9, 6.2)}


def _per_stage(share: Share, layout: Layout) -> tuple[float, float]:
    """(blocks, blocks re-run whole in backward) of one of the rank's stages, on average over them."""
    return share.layers / share.stages, share.rerun(layout.activation_checkpointing) / share.stages


def _block_acts(model: ModelConfig, layout: Layout, workload: Workload, mode: str) -> float:
    """One block's full activations (the unit the split-backward constants count in)."""
    plain = replace(layout, activation_checkpointing="none")
    return layout_activations(model, plain, workload, 1, mode)[0]


def _split_held(layers: float, recomputed: float, block: float, mode: str) -> float:
    fixed, kept, rerun = SPLIT_HELD[mode]
    return (fixed + kept * (layers - recomputed) + rerun * recomputed) * block


def stage_acts(model: ModelConfig, layout: Layout, workload: Workload, mode: str, share: Share, rank: int,
               micro: int, per_stage: float, in_flight: int) -> float:
    """Saved activations of a pipeline rank's micro-batches in flight, each through one of its stages
    (``per_stage`` bytes under the layout's recompute). Under a split backward (zbv, interleaved-zb,
    dualpipev) a micro-batch between its input- and weight-gradient steps keeps part of its autograd graph
    (SPLIT_HELD)."""
    if layout.schedule not in SPLIT_BACKWARD:
        return in_flight * per_stage
    split = _split_held(*_per_stage(share, layout), _block_acts(model, layout, workload, mode), mode)
    return max(k * per_stage + j * split for k, j in _split_states(layout, rank, micro))


def _split_states(layout: Layout, rank: int, micro: int) -> tuple[tuple[int, int], ...]:
    """(waiting, split) micro-batch counts of the rank's heaviest states (memory.split_backward_states)."""
    return split_backward_states(layout.pp, rank, micro, layout.schedule, layout.virtual_stages)


def weight_step_acts(model: ModelConfig, layout: Layout, workload: Workload, mode: str, share: Share,
                     rank: int, micro: int, per_stage: float) -> float:
    """Under a split backward with blocks recomputed whole: the saved activations at the heaviest weight step
    (0 otherwise), WEIGHT_STEP above the split micro-batches and those waiting for their backward."""
    stage_layers, recomputed = _per_stage(share, layout)
    if layout.schedule not in SPLIT_BACKWARD or not recomputed:
        return 0.0
    block = _block_acts(model, layout, workload, mode)
    fixed, full, selective = WEIGHT_STEP[mode]
    per_block = full if layout.activation_checkpointing == "full" else selective
    # The heaviest of its stages' steps, next to split micro-batches of either stage (their average).
    step = (fixed + per_block * max(rerun_blocks((layers,), layout.activation_checkpointing)
                                    for layers in share.stage_layers)) * block
    split = _split_held(stage_layers, recomputed, block, mode)
    return max((k * per_stage + j * split + step for k, j in _split_states(layout, rank, micro) if j >= 1),
               default=0.0)


@dataclass(frozen=True)
class RootReduce:
    """What the root reduction's terms depend on (parameters counted on one pipeline rank's share)."""

    zero_stage: int
    tp: int
    shard: int  # ranks the states are sharded over (dp_shard × cp)
    micro: int  # micro-batches per step
    root_params: float
    share_params: float
    c_bytes: int  # compute dtype
    r_bytes: int  # reduce dtype


def root_reduce_phase(r: RootReduce, params: float, st_params: float, st_grads: float, accumulated: float,
                      optim: float, buckets: float, stash: float, logits: float) -> Parts:
    """The end of backward, when the root unit (embeddings, head) reduces its gradients: its unsharded
    gradients and their copy in the reduce dtype (or, without a cast, the reduced shard) coexist with every
    block's sharded gradients and the last micro-batch's logits (measured with torch's tracker). With
    ZeRO-2's stash there are two such moments: a micro-batch before the last (every unit still gathered,
    the blocks' shards already stashed) and the last (every unit re-sharded, the blocks' fp32 shards next
    to the stash). ``st_params``/``st_grads``: the rank's resident weights and reduced gradients."""
    blocks_sharded = st_grads * (1 - r.root_params / r.share_params)
    root = r.root_params * r.c_bytes
    cast = r.root_params * r.r_bytes if r.r_bytes != r.c_bytes else 0.0
    # Over a single shard FSDP reduces in place: the copy is the output. A copy in a wider reduce dtype is
    # made while the compute-dtype gradients live; they are freed before the reduced shard is allocated.
    output = r.root_params * r.r_bytes / r.shard if r.shard > 1 else 0.0
    if stash:
        earlier = (params, stash + root, optim, (cast or output) + logits, buckets)
        last = (st_params, blocks_sharded + stash + root, optim, (cast or output) + logits, buckets)
        return max(earlier, last, key=sum)
    # Stage 3 over several micro-batches adds each one's reduced shards into the earlier ones: every shard
    # exists by the last root reduction.
    sharded = st_grads if (r.zero_stage == 3 and r.micro > 1) else blocks_sharded
    if r.zero_stage == 3 and r.tp > 1 and not accumulated:
        # Tensor-parallel (DTensor) units, measured with the dry run's timeline (`small`, vocabulary 8192,
        # FSDP 4 × TP 2 + SP, mixed precision, 2 micro-batches): the root stays gathered, the blocks' new
        # reduced shards wait next to the accumulated ones, and the reduce-scatter's input is the 16-bit
        # gradients plus a reduce-dtype chunk per rank, with no full-size cast.
        new = blocks_sharded if r.micro > 1 else 0.0
        return (params + root, sharded + new + root + output, optim, output + logits, buckets)
    return (params, accumulated or sharded + root, optim, (cast or output) + logits, buckets)


@dataclass(frozen=True)
class PipeStage:
    """One of a pipeline rank's stages, in parameters (after tensor parallelism, before sharding)."""

    params: float  # every parameter, root included
    root: float  # embedding, or final norm and head
    layers: float
    loss: bool  # runs the loss
    embedding: bool  # holds the embedding


@dataclass(frozen=True)
class Stage3Terms:
    """What a pipelined ZeRO-3 rank's phases add to its resident states, besides its stages."""

    params: float  # resident (sharded) weights, bytes
    optim: float
    buckets: float
    c_bytes: int
    r_bytes: int  # bytes of an accumulated (unreduced) gradient element
    reduced: float  # bytes per parameter of a reduced gradient shard
    shard: int  # ranks the gradients are reduced over
    block: float  # parameters of one block
    unit: float  # of the largest FSDP unit
    in_backward: float  # gathered at a time in backward: a unit, or a whole block when a split one is recomputed
    per_stage: float  # saved activations of one micro-batch through one stage
    boundary: float  # stage-boundary tensors per micro-batch in flight (boundary_tensors)
    loss_saved: float  # one micro-batch's saved tensors of the final norm and the loss
    loss_transient: float  # the loss's largest transient (its backward's fp32 gradients)
    held: int  # micro-batches whose loss waits for its backward at most (GPipe: all)
    logits: float  # the logits, alive through the stage's backward
    logit_grad: float  # one fp32 gradient of them, alive in the head's backward
    backward_extra: float  # recompute and the last block's working set in a backward
    temps: float  # a block's backward temporaries
    embedding_grad: float = 0.0  # the embedding's gradient when larger than its 16-bit copy
    embedding_copy: float = 0.0  # a copy of its local gradient kept between backwards
    embedding_accumulator: float = 0.0  # its accumulator's bytes beyond the local gradient's size


@dataclass(frozen=True)
class Moment:
    """A forward's end ("F") or a backward's start ("B") on one of a pipeline rank's stages."""

    kind: str
    stage: int
    in_flight: int  # micro-batches (each through one stage) whose backward has not run
    losses: int  # ... of them on this stage (the loss waits for the backward of each)
    accumulating: tuple[int, ...]  # stages between their first and last backward
    reduced: tuple[int, ...]  # stages past their last backward
    kept: tuple[int, ...]  # other stages whose units are still gathered by a backward
    own_kept: bool  # ... and this stage's
    last: bool  # a backward that is its stage's last


@lru_cache(maxsize=4096)
def rank_moments(pp: int, rank: int, microbatches: int, virtual: int, warmup: int | None = None,
                 loss_stage: int | None = None) -> tuple[Moment, ...]:
    """The distinct moments of the rank's order of forwards and backwards (memory.rank_actions, same
    arguments), counting losses on ``loss_stage`` only. The steady state repeats, so it is walked only as
    far as its states can differ: two of its forward-backward pairs (one stage), three rounds of
    micro-batches (interleaved); `tests/test_planner_memory.py` checks that against the whole order."""
    if virtual == 1:
        w = microbatches if warmup is None else min(microbatches, warmup)
        return walk_moments(rank_actions(pp, rank, min(microbatches, w + 2), 1, w), loss_stage)
    return walk_moments(rank_actions(pp, rank, microbatches, virtual, rounds=3), loss_stage)


def interleaved_peak(pp: int, rank: int, micro: int, virtual: int, per_stage: float, grads: float
                     ) -> tuple[int, float]:
    """(micro-batches in flight, gradient bytes) at the heaviest backward start of an interleaved rank whose
    gradients exist from each stage's first backward on (``grads``: all its stages'), by the rank's order."""
    def weight(m: Moment) -> tuple[int, float]:
        return m.in_flight, grads * len(m.accumulating + m.reduced) / virtual

    starts = [weight(m) for m in rank_moments(pp, rank, micro, virtual) if m.kind == "B"]
    return max(starts, key=lambda w: w[0] * per_stage + w[1])


def walk_moments(order: tuple[tuple[str, int], ...], loss_stage: int | None = None) -> tuple[Moment, ...]:
    """The moments of ``order``. Of moments that differ only in their counts of micro-batches in flight,
    those with fewer of both are dropped: they hold less."""
    n = 1 + max(c for _, c in order)
    total = [sum(1 for kind, c in order if kind == "B" and c == k) for k in range(n)]
    forwards, done, kept = [0] * n, [0] * n, [False] * n
    seen: dict[tuple, list[tuple[int, int]]] = {}
    for kind, c in order:
        if kind == "F":
            forwards[c] += 1
            kept[c] = False
        key = (kind, c, tuple(k for k in range(n) if 0 < done[k] < total[k]),
               tuple(k for k in range(n) if done[k] == total[k]), tuple(k for k in range(n) if kept[k] and k != c),
               kept[c], kind == "B" and done[c] == total[c] - 1)
        counts = (sum(forwards) - sum(done), forwards[c] - done[c] if c == loss_stage else 0)
        front = seen.setdefault(key, [])
        if not any(a >= counts[0] and b >= counts[1] for a, b in front):
            front[:] = [(a, b) for a, b in front if a > counts[0] or b > counts[1]] + [counts]
        if kind == "B":
            done[c] += 1
            kept[c] = done[c] < total[c]
    return tuple(Moment(kind, c, a, b, *rest) for (kind, c, *rest), front in seen.items() for a, b in front)


def pipelined_stage3_phases(t: Stage3Terms, stages: tuple[PipeStage, ...], moments: tuple[Moment, ...]
                            ) -> dict[str, Parts]:
    """(params, grads, optim, activations, buffers) at each forward's end ("forward end", and "loss" on the
    loss's stage), each backward's start ("backward") and end ("block gradients"), the heaviest of each,
    over the rank's ``moments`` on its ``stages``. A stage accumulates its gradients unsharded from its
    first backward to its last, which reduces them to a shard; between two of its backwards its units stay
    gathered unless a forward of it re-sharded them."""
    best: dict[str, tuple[float, float, float]] = {}  # (params, grads, activations): optim, buffers are constant
    # Under 16-bit compute every unit stays gathered; in fp32 the timeline shows units re-sharded after
    # their backward as well (`small`, PP 2 × FSDP 2 × TP 2 + SP, 8 ranks: the root and one unit at the end).
    gathered_all = [(s.root + (s.layers * t.block if t.c_bytes == 2 else t.unit)) * t.c_bytes for s in stages]
    # Accumulating stages hold their gradients unsharded; finished ones hold their reduced shard.
    accumulator = [s.params * t.r_bytes + (t.embedding_accumulator if s.embedding else 0.0) for s in stages]
    shard = [s.params * t.reduced for s in stages]

    def acts_of(in_flight: int) -> float:
        # Saved and boundary tensors with ``in_flight`` micro-batches (each through one stage).
        return in_flight * (t.per_stage + t.boundary)

    def note(name: str, params: float, grads: float, acts: float) -> None:
        if name not in best or params + grads + acts > sum(best[name]):
            best[name] = (params, grads, acts)

    for m in moments:
        c, s = m.stage, stages[m.stage]
        # (map, not a generator: the search evaluates this for every pipelined ZeRO-3 layout)
        others = sum(map(gathered_all.__getitem__, m.kept))
        grads = sum(map(accumulator.__getitem__, m.accumulating)) + sum(map(shard.__getitem__, m.reduced))
        losses = min(t.held, m.losses) * t.loss_saved if s.loss else 0.0
        if m.kind == "F":
            acts = acts_of(m.in_flight) + losses
            note("forward end", t.params + others + (s.root + t.unit) * t.c_bytes, grads, acts)
            if s.loss:
                # Stage 3 re-shards the root once the forward returns, before the loss runs.
                note("loss", t.params + others, grads, acts + t.loss_transient)
            continue
        own = gathered_all[c] if m.own_kept else 0.0
        with_own = grads if c in m.accumulating else grads + accumulator[c]
        acts = acts_of(m.in_flight)
        waiting = losses - t.loss_saved if s.loss else 0.0
        head_grad = s.root * t.c_bytes if s.loss else 0.0
        if s.loss:
            # The loss's backward: its fp32 gradients next to everything accumulated. Then the head's
            # backward: the head gathered, its 16-bit weight gradient, the logits and one fp32 gradient of
            # them; then the blocks' backward, where the logits and the head's gradient (not yet added to
            # its accumulator) are still alive (the dry run's timeline, `small`, vocabulary 8192, PP 2
            # interleaved × FSDP 2 and GPipe × FSDP 2, mixed precision).
            note("loss backward", t.params + others + own, grads, acts + losses + t.loss_transient)
            note("head backward", t.params + others + (own or head_grad), grads + head_grad,
                 acts + waiting + t.logits + t.logit_grad)
        # A backward's start: its first unit gathered (all of them when its last action was a backward),
        # its new gradient next to the accumulated ones, with the block's backward temporaries.
        # In fp32 the peak comes as the units are gathered, before their new gradient exists: the
        # all-gather's output sits next to the unsharded weights it fills. Under TP the first stage keeps a
        # reduce-dtype copy of its local embedding gradient from its first backward on (the dry run's
        # timeline: the demo's PP 2 × FSDP 2 × TP 2 + SP in fp32; Llama-3 8B in mixed precision).
        # (On the loss's stage the head was gathered for its own backward before.)
        gathering = (t.in_backward + (0.0 if s.loss else s.root)) * t.c_bytes
        new = gathering if t.c_bytes == 4 and not own else t.unit * t.c_bytes
        embedding = t.embedding_copy if s.embedding and c in m.accumulating else 0.0
        own = own or (s.root + t.in_backward) * t.c_bytes
        note("backward", t.params + others + own, grads + head_grad + new + embedding,
             acts + (waiting + t.logits if s.loss else 0.0) + t.backward_extra + t.temps)
        # Its end: every unit gathered, every gradient accumulated, the last unit's (on the first stage the
        # embedding's) compute-dtype gradient next to its accumulator, the micro-batch's tensors gone.
        transient = max((s.root if s.embedding else t.unit) * t.c_bytes, t.embedding_grad if s.embedding else 0.0)
        note("block gradients", t.params + others + gathered_all[c], with_own + transient,
             max(0.0, acts - t.per_stage))
        if m.last:
            # The stage's last backward reduces its gradients unit by unit: the largest unit's input copy
            # in the reduce dtype and its reduced shard next to every accumulator, the root re-sharded
            # (the dry run's timeline, `small`, PP 2 interleaved × FSDP 2, mixed precision, first stage).
            largest = max(s.root, t.unit) * t.r_bytes
            note("stage reduce", t.params + others + gathered_all[c] - s.root * t.c_bytes, with_own,
                 acts_of(m.in_flight - 1) + largest * (1 + 1 / t.shard))
    return {name: (p, g, t.optim, a, t.buckets) for name, (p, g, a) in best.items()}


def pipe_stages(share: Share, schedule: str, pp: int, rank: int, micro: int, in_flight: int
                ) -> tuple[tuple[PipeStage, ...], tuple[Moment, ...]]:
    """A pipeline rank's stages and the moments of its forwards and backwards. Interleaved 1F1B follows
    each stage; GPipe and 1F1B are one stage in the 1F1B shape, with the schedule's most micro-batches in
    flight as its warm-up (the split-backward schedules do not train with ZeRO-3: layout/schedules.py;
    called for them anyway, they are taken the same way, all their stages as one)."""
    if schedule != "interleaved-1f1b":
        whole = PipeStage(share.params, share.root_params, share.layers, share.last, share.first)
        return (whole,), rank_moments(pp, rank, micro * share.stages, 1, in_flight, 0 if share.last else None)
    v, layers = share.stages, share.layers / share.stages
    # The embedding is on the rank's first stage, the head on its last (pp ≥ 2: never both on one rank).
    roots = [share.root_params if (k == 0 and share.first) or (k == v - 1 and share.last) else 0.0 for k in range(v)]
    stages = tuple(PipeStage(layers * share.block_params + roots[k], roots[k], layers, share.last and k == v - 1,
                             share.first and k == 0) for k in range(v))
    return stages, rank_moments(pp, rank, micro, v, None, v - 1 if share.last else None)


def boundary_tensors(stages: int, last: bool, in_flight: int) -> float:
    """Stage-boundary tensors (a micro-batch's activation or its gradient between stages) a pipeline rank
    holds at its peak beyond those its blocks save: a stage's output, kept for its backward, per
    in-flight micro-batch of each of its stages that sends one.

    meshfit's stages (parallel/pipeline_memory.py) receive into buffers made for one micro-batch and
    dropped once used, and wait for each send as soon as the peer has received it, so nothing here scales
    with the step's micro-batch count; a received input is the first block's saved input, and the
    gradients in transit are alive while other tensors of the same micro-batch are already freed (measured
    with torch's tracker on 2 gloo ranks: 1f1b and interleaved-1f1b, 2 to 32 micro-batches).
    """
    senders = stages - (1 if last else 0)
    return in_flight * senders / stages
