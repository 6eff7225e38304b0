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

from dataclasses import dataclass
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

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optim + self.activations + self.buffers

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


def _mode(workload: Workload, layout: Layout) -> str:
    if workload.precision == "fp32":
        return "fp32"
    if workload.precision == "mixed" and layout.zero_stage <= 1:
        return "autocast"
    return "bf16"


def _head_bytes(model: ModelConfig, layout: Layout, mode: str, tokens: int) -> float:
    """The last stage around the loss: final norm, logits, their fp32 copy, log-softmax and its gradient."""
    vocab = model.vocab_size / layout.tp if layout.loss_parallel else model.vocab_size
    p = 4 if mode == "fp32" else 2
    norm = tokens * model.dim * (12 if mode != "bf16" else 8) / (layout.tp if layout.sp else 1)
    # At the start of backward: the logits (compute dtype), the log-softmax output (fp32), the gradients of
    # the log-probabilities and of the fp32 logits, and (16-bit) that gradient cast back to the logits' dtype.
    per_logit = p + 4 + 4 + 4 + (2 if p == 2 else 0)
    return norm + tokens * vocab * per_logit


def _activations(model: ModelConfig, layout: Layout, workload: Workload, share: _Share, mode: str) -> float:
    """Saved activations of one micro-batch through ``share``'s layers (all its stages)."""
    kw = dict(mode=mode, seq=workload.seq_len, batch=layout.micro_batch, tp=layout.tp, sp=layout.sp)
    full = block_activation_bytes(model, attention=workload.attention, dropout=workload.dropout, **kw)
    if layout.activation_checkpointing == "none":
        return share.layers * full
    kept = checkpointed_block_bytes(model, **kw)
    if layout.activation_checkpointing == "full":
        checkpointed = share.layers
    else:  # every 2nd block, as parallel.ac_every's default
        checkpointed = share.layers // 2
    # In backward one checkpointed block at a time is recomputed in full.
    return checkpointed * kept + (share.layers - checkpointed) * full + full


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
    optim = 0.0 if off else n * k_bytes / (ds if stage >= 1 else 1)
    grads_full = 0.0 if off else n * g_bytes / (ds if fsdp else 1)
    buckets = n * g_bytes if (stage <= 1 and layout.dp > 1) else 0.0
    # RoPE's cos/sin tables (fp32, max_seq_len × head_dim each) live in every Llama stage module.
    buckets += 2 * model.max_seq_len * model.head_dim * 4 * share.stages if model.family == "llama" else 0.0
    tokens = workload.seq_len * layout.micro_batch
    act_mb = _activations(model, layout, workload, share, mode)
    head = _head_bytes(model, layout, mode, tokens) if share.last else 0.0
    local = workload.global_batch // layout.dp
    micro = max(1, local // layout.micro_batch)
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
        if share.last:
            # The schedule keeps every micro-batch's logits to return them at the end of the step.
            vocab = model.vocab_size / layout.tp if layout.loss_parallel else model.vocab_size
            acts += micro * tokens * vocab * (4 if mode == "fp32" else 2)
        # 1F1B-style schedules reach their most in-flight micro-batches at the first backward, after which
        # the stage's gradients exist; GPipe runs every forward before any backward.
        grads_loss = 0.0 if layout.schedule == "gpipe" else grads_full
    else:
        acts = act_mb + head
        grads_loss = grads_full if micro > 1 else 0.0
    gathered, unit_grads = 0.0, 0.0
    if fsdp and ds > 1:
        # The root unit stays gathered through forward and backward. Stage 3 holds the current block and
        # the prefetched next one; stage 2 keeps every block from its forward to its backward, plus one
        # all-gather buffer. In backward a block's unsharded gradients exist until reduce-scattered.
        blocks = share.layers + 1 if stage == 2 else min(2, share.layers)
        gathered = (share.root_params + blocks * share.block_params) * c_bytes
        # mixed precision: the bf16 gradient is cast to fp32 for the reduce-scatter (reduce_dtype)
        unit_grads = share.block_params * (4 if workload.precision == "mixed" else c_bytes)
    block_acts = acts - head
    phases = {
        "loss": (params + gathered, grads_loss, optim, acts, buckets),
        "backward": (params + gathered, grads_loss + unit_grads, optim, block_acts, buckets),
        "backward end": (params + (share.root_params * c_bytes if fsdp and ds > 1 else 0), grads_full, optim,
                         0.0, buckets),
    }
    # Optimizer temporaries: torch's foreach AdamW (GPU default) holds one list as large as the rank's
    # parameters in the state dtype (the square roots of the second moments); the per-parameter path (CPU)
    # one parameter's worth.
    temp = (n / (ds if stage >= 1 else 1) if foreach else share.largest) * k_bytes / (2 if workload.optimizer == "adamw" else 1)
    phases["optimizer"] = (params, grads_full, optim, temp if not off else 0.0, buckets)
    phase = max(phases, key=lambda k: sum(phases[k]))
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
