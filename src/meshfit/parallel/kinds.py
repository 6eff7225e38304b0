"""Which torch building block keeps a layout's data-parallel state: one rule for training and planning."""

from __future__ import annotations

# none: one data-parallel rank; ddp: torch's DistributedDataParallel (stage 0); replicas: FSDP2 over the
# replicate dimension alone, for stage-0 replicas of tensor-parallel (DTensor) weights, which DDP cannot
# take; fsdp: FSDP2 sharding over dp_shard (stages 1-3, HSDP).
KINDS = ("none", "ddp", "replicas", "fsdp")


def data_parallel_kind(zero_stage: int, dp: int, tp: int) -> str:
    """The building block for ``zero_stage`` with ``dp`` data-parallel and ``tp`` tensor-parallel ranks."""
    if zero_stage >= 1:
        return "fsdp"
    if dp == 1:
        return "none"
    return "replicas" if tp > 1 else "ddp"
