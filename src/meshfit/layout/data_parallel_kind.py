"""Which torch building block keeps a layout's data-parallel state: one rule for training and planning."""

from __future__ import annotations

# none: one data-parallel rank in fp32; ddp: torch's DistributedDataParallel (stage 0 in fp32); replicas:
# FSDP2 over the replicate dimension alone (whole "shards"), for stage-0 replicas of tensor-parallel
# (DTensor) weights, which DDP cannot take, and for every stage-0 layout under mixed precision, so that
# blocks compute on 16-bit weights and keep 16-bit activations (MixedPrecisionPolicy) rather than running
# under autocast with an fp32 residual stream; fsdp: FSDP2 sharding over dp_shard (stages 1-3, HSDP).
KINDS = ("none", "ddp", "replicas", "fsdp")

# parallel.max_unit_params's default: a block with more parameters is sharded as smaller FSDP units
# (parallel/fsdp_units.py), as DeepSpeed bounds its live parameters (stage3_max_live_parameters, 1e9 elements).
DEFAULT_MAX_UNIT_PARAMS = 1_000_000_000


def data_parallel_kind(zero_stage: int, dp: int, tp: int, mixed_precision: bool) -> str:
    """The building block for ``zero_stage`` with ``dp`` data-parallel and ``tp`` tensor-parallel ranks."""
    if zero_stage >= 1:
        return "fsdp"
    if mixed_precision:
        return "replicas"
    if dp == 1:
        return "none"
    return "replicas" if tp > 1 else "ddp"


def stashes_gradients(zero_stage: int, mixed_precision: bool, micro_batches: int, pipelined: bool) -> bool:
    """Whether gradient shards wait in bf16 between micro-batches (data_parallel.GradientStash): ZeRO-2
    under mixed precision with gradient accumulation (pipeline schedules accumulate unsharded instead)."""
    return zero_stage == 2 and mixed_precision and micro_batches > 1 and not pipelined


def reduces_in_background(zero_stage: int, dp_shard: int, replicated: bool, mixed_precision: bool,
                          pipelined: bool, backend: str, reduce_dtype: str = "fp32") -> bool:
    """Whether FSDP2's gradient reduce-scatters run in the background (parallel/host_reduce.py): on gloo
    (CPU ranks; an accelerator overlaps them on its own stream), for sharded layouts whose reduced shard
    FSDP2 reads no further before it becomes the gradient: no replicate all-reduce after it (HSDP), no cast
    (under mixed precision stage 1, and `reduce_dtype="compute"`, reduce in bf16 into fp32 shards), and no
    pipeline schedule (it scales the gradients right after the last backward)."""
    casts = mixed_precision and (zero_stage == 1 or reduce_dtype == "compute")
    return (backend == "gloo" and zero_stage >= 1 and dp_shard > 1 and not replicated and not casts
            and not pipelined)
