"""Per-rank peak memory of one layout, by component, for the most-loaded rank.

The estimate follows what meshfit's torch building blocks keep, phase by phase, in a steady training step
(step ≥ 2: optimizer states exist, gradients were freed by the previous step), and reports the components
at the phase with the largest total:

* ``loss``: the forward of the last micro-batch is done — every block's saved activations, the logits and
  the loss's softmax, gradients accumulated from earlier micro-batches, FSDP's gathered units.
* ``backward end``: every gradient exists (and for DDP its equally large communication buckets).
* ``optimizer``: gradients, states and the optimizer's temporaries.

Components (bytes), as the memory tracker folds them: ``params`` (resident weights plus gathered copies),
``grads`` (plus reduce-scatter buffers), ``optim``, ``activations`` (saved tensors, logits, temporaries)
and ``buffers`` (DDP buckets, module buffers). Allocator headroom is not a tensor: the planner adds it when
it compares the total with a device (see :func:`usable_bytes`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import lru_cache

from meshfit.models.config import ModelConfig
from meshfit.planner.activations import (
    block_activation_bytes,
    block_weight_params,
    checkpointed_block_bytes,
)
from meshfit.planner.layout import Layout, Workload
from meshfit.parallel.split import balanced_split, head_flops, layer_flops
from meshfit.planner.memory import pipeline_in_flight_microbatches

# (weight, gradient, {optimizer: state}) bytes per parameter as meshfit keeps them. Mixed precision keeps
# fp32 master weights, fp32 gradients (reduced in fp32) and fp32 states; bf16 copies exist only for compute.
_STATE = {
    "fp32": (4, 4, {"adamw": 8, "sgd": 4}),
    "mixed": (4, 4, {"adamw": 8, "sgd": 4}),
    "bf16": (2, 2, {"adamw": 4, "sgd": 2}),
}
COMPONENTS = ("params", "grads", "optim", "activations", "buffers")
# Fraction of a device's memory the planner lets tensors use: the CUDA context, NCCL buffers and the caching
# allocator's fragmentation take the rest (a few GiB on an 80 GiB part).
ALLOCATOR_HEADROOM = 0.08


def usable_bytes(device_bytes: int) -> float:
    return device_bytes * (1 - ALLOCATOR_HEADROOM)


@dataclass(frozen=True)
class MemoryEstimate:
    params: float
    grads: float
    optim: float
    activations: float
    buffers: float
    phase: str  # the phase of the peak
    pp_rank: int = 0  # pipeline rank of the most-loaded stage
    total: float = field(init=False)

    def __post_init__(self) -> None:
        # Computed once: ranking compares totals of thousands of estimates.
        object.__setattr__(self, "total", self.params + self.grads + self.optim + self.activations + self.buffers)

    def as_dict(self) -> dict[str, int]:
        out = {name: int(round(getattr(self, name))) for name in COMPONENTS}
        out["total"] = sum(out.values())
        return out


@dataclass(frozen=True)
class _Share:
    """One pipeline rank's slice of the model (after tensor parallelism, before data-parallel sharding)."""

    params: float  # every parameter this rank holds
    block_params: float  # one transformer block's parameters (an FSDP unit)
    root_params: float  # embeddings, final norm and head (the root FSDP unit)
    layers: int  # transformer blocks on this rank
    stages: int  # stages on this rank (virtual pipeline stages)
    first: bool  # holds the embedding
    last: bool  # holds the final norm, the head and the loss
    largest: float  # largest single parameter (per-parameter optimizer temporaries)


def _block_params(model: ModelConfig, tp: int) -> float:
    norms = 2 * model.dim if model.family == "llama" else 4 * model.dim
    biases = 0 if model.family == "llama" else (3 * model.dim + model.ffn_hidden) / tp + 2 * model.dim
    return block_weight_params(model) / tp + norms + biases


@lru_cache(maxsize=4096)
def _shares(model: ModelConfig, seq: int, tp: int, pp: int, virtual: int, v_shape: bool) -> tuple[_Share, ...]:
    n_stages = pp * virtual
    counts = balanced_split(model.n_layers, n_stages, layer_flops(model, seq), head_flops(model)) \
        if n_stages > 1 else [model.n_layers]
    embed = model.vocab_size * model.dim / tp + (model.max_seq_len * model.dim if model.family == "gpt" else 0)
    head = 0 if (model.tie_embeddings and n_stages == 1) else model.vocab_size * model.dim / tp
    final_norm = model.dim if model.family == "llama" else 2 * model.dim
    block = _block_params(model, tp)
    shares = []
    for rank in range(pp):
        ids = [rank, 2 * pp - 1 - rank] if v_shape else [rank + k * pp for k in range(virtual)]
        layers = sum(counts[i] for i in ids)
        first, last = 0 in ids, n_stages - 1 in ids
        root = (embed if first else 0) + ((head + final_norm) if last else 0)
        largest = max(embed if first else 0, head if last else 0, model.ffn_hidden * model.dim / tp)
        shares.append(_Share(layers * block + root, block, root, layers, len(ids), first, last, largest))
    return tuple(shares)


def _param_sizes(model: ModelConfig, tp: int, share: _Share) -> tuple[list[float], list[float]]:
    """Element counts of the share's matrices and of its vectors (the optimizer's two parameter groups)."""
    d, hd, f = model.dim, model.head_dim, model.ffn_hidden
    if model.family == "llama":
        mats = [model.n_heads * hd * d, model.n_kv_heads * hd * d, model.n_kv_heads * hd * d,
                d * model.n_heads * hd, f * d, d * f, f * d]
        vecs = [d, d]  # the two RMSNorm gains, replicated across tensor-parallel ranks
    else:
        mats = [d * d] * 4 + [f * d, d * f]
        # column-parallel biases (q, k, v, MLP up) are split; row-parallel ones and the norms are not
        vecs = [d / tp] * 3 + [f / tp] + [d] * 2 + [d] * 4
    matrices = [m / tp for m in mats] * share.layers
    vectors = vecs * share.layers
    if share.first:
        matrices.append(model.vocab_size * d / tp)
        if model.family == "gpt":
            matrices.append(model.max_seq_len * d)
    if share.last:
        if not (model.tie_embeddings and share.first):
            matrices.append(model.vocab_size * d / tp)
        vectors += [d] if model.family == "llama" else [d, d]
    return matrices, vectors


@lru_cache(maxsize=4096)
def _zero1_most_loaded(model: ModelConfig, tp: int, share: _Share, ranks: int) -> float:
    """Elements whose optimizer states the most-loaded rank keeps under ZeroRedundancyOptimizer.

    It assigns whole parameters, largest first, each to the rank holding the fewest elements so far, one
    parameter group (matrices, then vectors) after the other: the rank that gets the embedding can hold
    far more than an even share.
    """
    sizes = [0.0] * ranks
    heap = [(0.0, r) for r in range(ranks)]
    for group in _param_sizes(model, tp, share):
        for numel in sorted(group, reverse=True):
            load, rank = heapq.heappop(heap)
            sizes[rank] = load + numel
            heapq.heappush(heap, (sizes[rank], rank))
    return max(sizes)


def _mode(workload: Workload, layout: Layout) -> str:
    if workload.precision == "fp32":
        return "fp32"
    if workload.precision == "mixed" and layout.zero_stage <= 1:
        return "autocast"
    return "bf16"


def _head_bytes(model: ModelConfig, layout: Layout, mode: str, tokens: int, held: int = 1,
                transient: bool = True) -> float:
    """The last stage around the loss for ``held`` micro-batches whose forward is done and backward not.

    Each keeps the final norm's saved tensors, its logits (compute dtype) and the log-softmax output
    (fp32); on top comes the largest transient of the loss: two fp32 gradients (fp32) or the fp32 copy of
    16-bit logits.
    """
    vocab = model.vocab_size / layout.tp if layout.loss_parallel else model.vocab_size
    p = 4 if mode == "fp32" else 2
    norm = tokens * model.dim * (12 if mode != "bf16" else 8) / (layout.tp if layout.sp else 1)
    saved = norm + tokens * vocab * (p + 4)
    # Measured: in fp32 the gradients of the log-probabilities and of the logits coexist; with 16-bit
    # logits the peak comes in the forward, while the fp32 copy of the logits feeds the log-softmax.
    # torch's loss-parallel cross-entropy keeps one more fp32 tensor of the local logits' size.
    extra = 4 if layout.loss_parallel else 0
    return held * saved + (tokens * vocab * ((8 if p == 4 else 4) + extra) if transient else 0.0)


def _activations(model: ModelConfig, layout: Layout, workload: Workload, share: _Share, mode: str
                 ) -> tuple[float, float]:
    """(saved activations of one micro-batch through ``share``'s layers, what backward adds on top).

    With checkpointing, backward re-runs one checkpointed block at a time in full; while that block's
    gradients are computed its recomputed activations and the gradient temporaries (together about 1.45
    blocks' activations, as measured with torch's tracker) are alive.
    """
    kw = dict(mode=mode, seq=workload.seq_len, batch=layout.micro_batch, tp=layout.tp, sp=layout.sp)
    full = block_activation_bytes(model, attention=workload.attention, dropout=workload.dropout, **kw)
    if layout.activation_checkpointing == "none":
        return share.layers * full, 0.0
    kept = checkpointed_block_bytes(model, **kw)
    if layout.activation_checkpointing == "full":
        checkpointed = share.layers
    else:  # every 2nd block, as parallel.ac_every's default
        checkpointed = share.layers // 2
    return checkpointed * kept + (share.layers - checkpointed) * full, full * 1.45


def _rank_estimate(model: ModelConfig, layout: Layout, workload: Workload, share: _Share, rank: int,
                   foreach: bool) -> MemoryEstimate:
    w_bytes, g_bytes, states = _STATE[workload.precision]
    k_bytes = states[workload.optimizer]
    mode = _mode(workload, layout)
    c_bytes = 4 if mode == "fp32" else 2
    stage, ds = layout.zero_stage, layout.dp_shard
    n = share.params
    fsdp = stage >= 2
    off = layout.offload
    params = 0.0 if off else n * w_bytes / (ds if fsdp else 1)
    if off:
        optim = 0.0
    elif stage == 1 and ds > 1:
        optim = _zero1_most_loaded(model, layout.tp, share, ds) * k_bytes
    else:
        optim = n * k_bytes / (ds if stage >= 1 else 1)
    grads_full = 0.0 if off else n * g_bytes / (ds if fsdp else 1)
    buckets = n * g_bytes if (stage <= 1 and layout.dp > 1) else 0.0
    # RoPE's cos/sin tables (fp32, max_seq_len × head_dim each) live in every Llama stage module.
    buckets += 2 * model.max_seq_len * model.head_dim * 4 * share.stages if model.family == "llama" else 0.0
    tokens = workload.seq_len * layout.micro_batch
    act_mb, recompute = _activations(model, layout, workload, share, mode)
    local = workload.global_batch // layout.dp
    micro = max(1, local // layout.micro_batch)
    # GPipe runs every forward, loss included, before any backward; the other schedules start a
    # micro-batch's backward right after its loss.
    held = micro if (layout.pp > 1 and layout.schedule == "gpipe") else 1
    head = _head_bytes(model, layout, mode, tokens, held) if share.last else 0.0
    head_saved = _head_bytes(model, layout, mode, tokens, held, transient=False) if share.last else 0.0
    if layout.pp > 1:
        per_stage = act_mb / share.stages
        in_flight = pipeline_in_flight_microbatches(layout.schedule, layout.pp, rank, micro,
                                                    layout.virtual_stages)
        boundary = tokens * model.dim * (4 if mode == "fp32" else 2) / (layout.tp if layout.sp else 1)
        # Stage boundaries: every micro-batch's output (forward) and input gradient (backward) is sent, and
        # the schedule waits for its sends at the end of the step, so all of them stay alive until then.
        # torch's PipelineStage also allocates receive buffers for every micro-batch.
        edges = 2 * share.stages - (1 if share.first else 0) - (1 if share.last else 0)
        acts = in_flight * per_stage + head + edges * micro * boundary
        buckets += edges * micro * boundary
        # 1F1B-style schedules reach their most in-flight micro-batches at the first backward, after which
        # the stage's gradients exist; GPipe runs every forward before any backward.
        grads_loss = 0.0 if layout.schedule == "gpipe" else grads_full
    else:
        acts = act_mb + head
        grads_loss = grads_full if micro > 1 else 0.0
        if micro > 1 and layout.tp > 1 and not fsdp and share.last:
            # Accumulating DTensor gradients is out of place: the head's new weight gradient exists next to
            # the accumulated one (plain tensors accumulate in place).
            grads_loss += model.vocab_size * model.dim / layout.tp * g_bytes
    gathered = gathered_loss = unit_grads = working = 0.0
    if fsdp and ds > 1:
        # The root unit stays gathered through forward and backward. Stage 3 holds the current block and
        # the prefetched next one; stage 2 keeps every block from its forward to its backward, plus one
        # all-gather buffer. In backward a block's unsharded gradients exist until reduce-scattered.
        blocks = share.layers + 1 if stage == 2 else min(2, share.layers)
        gathered = (share.root_params + blocks * share.block_params) * c_bytes
        # At the loss stage 3 holds the root and at most one block (the last one is re-sharded after its
        # forward; backward gathers it again).
        gathered_loss = (share.root_params + (blocks if stage == 2 else 1) * share.block_params) * c_bytes
        unit_grads = share.block_params * c_bytes
        if mode == "bf16":
            # Measured with 16-bit compute: either the last block's backward starts (gradient temporaries
            # about the size of its h-wide activations, no gradients yet) or its gradients exist, cast to
            # fp32 for the reduce-scatter; the larger of the two is the peak.
            unit_grads = share.block_params * 4
            working = tokens * model.dim * 28 / (layout.tp if layout.sp else 1)
        if layout.pp > 1:
            # torch's PipelineStage defers FSDP's gradient reduce-scatter and re-sharding to the end of the
            # step: after the first backward every unit stays gathered and gradients accumulate unsharded.
            gathered = gathered_loss = (share.root_params + (share.layers + 1) * share.block_params) * c_bytes
            # FSDP2 accumulates unsynchronised gradients in the reduce dtype (fp32 under mixed precision)
            grads_loss = n * (4 if workload.precision == "mixed" else c_bytes)
            unit_grads = working = 0.0
    # In the first blocks' backward the logits, the log-softmax output and one fp32 gradient of the logits
    # are still alive (measured), next to the saved tensors of micro-batches whose loss has not run
    # backward yet; the final norm's and the loss's other temporaries are gone.
    vocab = model.vocab_size / layout.tp if layout.loss_parallel else model.vocab_size
    last_loss = tokens * vocab * (c_bytes + 8) + head_saved * (held - 1) / held
    block_acts = acts - head + (last_loss if share.last else 0.0)
    phases = {
        "loss": (params + gathered_loss, grads_loss, optim, acts, buckets),
        # The end of the forward: without mixed precision FSDP holds the root's all-gather output next to
        # its unsharded parameters, while the loss has only its saved tensors (plus the fp32 copy of
        # 16-bit logits, counted in the loss phase).
        # (Stage 3 has re-sharded the last block; stage 2's spare all-gather buffer is free again.)
        "forward end": (params + gathered_loss - (share.block_params * c_bytes if fsdp and ds > 1 else 0.0)
                        + (share.root_params * c_bytes if fsdp and ds > 1 and c_bytes == 4 else 0.0),
                        grads_loss, optim, acts - (head - head_saved), buckets),
        # Stage 2's extra all-gather buffer is gone once backward runs.
        "backward": (params + gathered - (share.block_params * c_bytes if stage == 2 and ds > 1 else 0.0),
                     # With every other block checkpointed the recompute of the last block comes before
                     # any block gradient (measured); with all blocks checkpointed they overlap.
                     grads_loss + (0.0 if layout.activation_checkpointing == "selective" or working else unit_grads),
                     optim, block_acts + recompute + working, buckets),
        # ... and once its gradients exist, most of the last block's activations are freed.
        "block gradients": (params + gathered, grads_loss + unit_grads, optim,
                            block_acts + recompute - act_mb / max(1, share.layers), buckets),
        "backward end": (params + (share.root_params * c_bytes if fsdp and ds > 1 else 0), grads_full, optim,
                         0.0, buckets),
    }
    # Optimizer temporaries: torch's foreach AdamW (GPU default) holds one list as large as the rank's
    # parameters in the state dtype (the square roots of the second moments); the per-parameter path (CPU)
    # one parameter's worth.
    temp = (n / (ds if stage >= 1 else 1) if foreach else share.largest) * k_bytes / (2 if workload.optimizer == "adamw" else 1)
    phases["optimizer"] = (params, grads_full, optim, temp if not off else 0.0, buckets)
    totals = {name: sum(parts) for name, parts in phases.items()}
    phase = max(totals, key=totals.__getitem__)
    return MemoryEstimate(*phases[phase], phase=phase, pp_rank=rank)


def estimate_memory(model: ModelConfig, layout: Layout, workload: Workload, *, foreach: bool = True
                    ) -> MemoryEstimate:
    """Peak tensor memory of the most-loaded rank of ``layout`` (see the module notes for the phases).

    ``foreach``: torch's multi-tensor optimizer path, the default on GPU (False for CPU runs).
    """
    v_shape = layout.schedule in ("zbv", "dualpipev") and layout.pp > 1
    virtual = layout.virtual_stages if layout.pp > 1 else 1
    shares = _shares(model, workload.seq_len, layout.tp, layout.pp, virtual, v_shape)
    # In-flight micro-batches fall with the pipeline rank, so the most-loaded rank is the first, the last
    # (head, logits) or the one with the most blocks; the others need not be evaluated.
    ranks = {0, len(shares) - 1, max(range(len(shares)), key=lambda r: shares[r].layers)}
    estimates = [_rank_estimate(model, layout, workload, shares[rank], rank, foreach) for rank in sorted(ranks)]
    return max(estimates, key=lambda e: e.total)
