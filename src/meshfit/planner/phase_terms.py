"""Terms of the memory estimate (planner/estimate.py) that follow how torch's FSDP2 and pipelining run.

The root reduction (`root_reduce_phase`): the end of backward, when the root unit reduces its gradients.

A pipeline rank's micro-batches in flight (`stage_acts`), zbv's split backward included.

A pipeline rank whose stages are sharded at ZeRO-3 (`pipelined_stage3_phases`): torch's stage defers FSDP's
gradient reduction to the step's last backward, so gradients accumulate unsharded (in the reduce dtype)
from the first backward on, and units stay gathered after their backward until the next forward
re-shards them. The dry run's timeline (Llama-3 8B, PP 4 × FSDP 16, 1F1B, seq 2048,
mixed precision, 4 and 8 micro-batches per step, first stage) shows two peaks of nearly the same height:

* the end of a backward: every unit of the stage gathered, every gradient accumulated, the last unit's
  (on the first stage the embedding's) compute-dtype gradient next to its reduce-dtype accumulator, and
  the micro-batch just finished gone from the micro-batches in flight;
* the start of a later backward: the units re-sharded by the forwards in between (the root and the
  unit in backward gathered), every gradient accumulated and the unit's new one, and every micro-batch in
  flight (one fewer when the step has no forward left between the first and second backward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshfit.planner.activations import layout_activations
from meshfit.planner.memory import split_backward_states

if TYPE_CHECKING:
    from meshfit.models.config import ModelConfig
    from meshfit.planner.layout import Layout, Workload

Parts = tuple[float, float, float, float, float]
# A zbv micro-batch between its input- and weight-gradient steps, in full (un-recomputed) activations of
# its blocks: its saved tensors and the gradients of its weights' outputs (≈ 0.9 more); recomputed, one
# block's worth more (RECOMPUTED_EXTRA). Fitted on dry runs of `small`: PP 2 zbv, fp32, without recompute
# (dim 256, seq 256: +0.1%; seq 2048: +1.7%) and with full recompute, one block per stage (dim 256, seq 256,
# and seq 2048 with 4 micro-batches: 2.55 and 2.56 blocks each); Llama-3 8B, PP 4 zbv × ZeRO-1 2, seq 4096,
# full recompute, 4 blocks per stage, is the check (docs/planner.md).
SPLIT_WEIGHT = 1.9
RECOMPUTED_EXTRA = 0.65


def stage_acts(model: ModelConfig, layout: Layout, workload: Workload, mode: str, stage_layers: float,
               rank: int, micro: int, per_stage: float, in_flight: int) -> float:
    """Saved activations of a pipeline rank's micro-batches in flight, each through one of its stages
    (``stage_layers`` blocks, ``per_stage`` bytes under the layout's recompute). Under zbv a micro-batch
    between its input- and weight-gradient steps keeps its whole autograd graph (recomputed tensors
    included) and the gradients of the weights' outputs: SPLIT_WEIGHT × its blocks' full activations, and
    with recompute RECOMPUTED_EXTRA × one block's."""
    if layout.schedule != "zbv":
        return in_flight * per_stage
    plain = replace(layout, activation_checkpointing="none")
    block = layout_activations(model, plain, workload, 1, mode)[0]
    extra = RECOMPUTED_EXTRA * block if layout.activation_checkpointing != "none" else 0.0
    split = block * stage_layers * SPLIT_WEIGHT + extra
    return max(k * per_stage + j * split for k, j in split_backward_states(layout.pp, rank, micro))


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


def pipelined_stage3_phases(params: float, optim: float, buckets: float, grads: float, c_bytes: int,
                            root: float, unit: float, layers: int, block: float, first: bool, *,
                            per_stage: float, acts: float, last: float, later: bool, forward_acts: float,
                            embedding_grad: float = 0.0, temps: float = 0.0, in_backward: float | None = None
                            ) -> dict[str, Parts]:
    """(params, grads, optim, activations, buffers) at the two peaks above, as "backward" (its start) and
    "block gradients" (the stage's backward end). ``acts``: the in-flight micro-batches' saved tensors and
    stage-boundary tensors; ``last``: what the running backward adds (the loss's remains, recompute,
    temporaries); ``later``: a forward runs between the first and second backward; ``forward_acts``: what a
    forward's end holds (the root and the unit just run are gathered then); ``embedding_grad``: the first
    stage's embedding gradient when it is larger than the last unit's 16-bit one; ``in_backward``: what a
    backward gathers at a time (a whole block when a split block is recomputed; by default one unit)."""
    # Under 16-bit compute every unit stays gathered; in fp32 the timeline shows units re-sharded after
    # their backward as well (`small`, PP 2 × FSDP 2 × TP 2 + SP, 8 ranks: the root and one unit at the end).
    everything = (root + (layers * block if c_bytes == 2 else unit)) * c_bytes
    transient = max((root if first and root else unit) * c_bytes, embedding_grad)
    start_acts = acts if later else max(0.0, acts - per_stage)
    return {
        "forward end": (params + (root + unit) * c_bytes, grads, optim, forward_acts, buckets),
        # The first unit's backward: it alone is gathered (the root too), its new gradient waits to be added
        # to the accumulated one, with the block's backward temporaries (``temps``).
        "backward": (params + (root + (unit if in_backward is None else in_backward)) * c_bytes,
                     grads + unit * c_bytes, optim, start_acts + last + temps, buckets),
        "block gradients": (params + everything, grads + transient, optim, max(0.0, acts - per_stage), buckets),
    }


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
