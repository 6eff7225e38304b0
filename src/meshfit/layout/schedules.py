"""The pipeline schedules meshfit runs: one table for training, planning and validation (no torch import)."""

from __future__ import annotations

# meshfit name -> (torch schedule class name, stages per rank: None = any ≥ 2, V-shaped stage placement)
SCHEDULES: dict[str, tuple[str, int | None, bool]] = {
    "gpipe": ("GPipe", 1, False),
    "1f1b": ("1F1B", 1, False),
    "interleaved-1f1b": ("Interleaved1F1B", None, False),
    "interleaved-zb": ("InterleavedZeroBubble", None, False),
    "zbv": ("ZBVZeroBubble", 2, True),
    "dualpipev": ("DualPipeV", 2, True),
}
SCHEDULE_NAMES = tuple(SCHEDULES)


def fixed_virtual_stages(schedule: str) -> int | None:
    """Stages per rank the schedule runs, or None when it runs any number ≥ 2 (interleaved schedules)."""
    return SCHEDULES[schedule][1]


def default_virtual_stages(schedule: str) -> int:
    fixed = fixed_virtual_stages(schedule)
    return fixed if fixed is not None else 2


def least_microbatches(schedule: str, pp: int) -> int:
    """Fewest micro-batches per step the schedule runs on `pp` pipeline ranks: every schedule but GPipe
    interleaves forwards and backwards, which needs the pipeline full (one micro-batch per rank)."""
    return 1 if schedule == "gpipe" else pp


def v_shaped(schedule: str) -> bool:
    """Stage r and 2p−1−r on rank r (the V schedules); otherwise round-robin."""
    return SCHEDULES[schedule][2]


# Schedules that split each backward into input- and weight-gradient steps (zero-bubble schedules).
SPLIT_BACKWARD = ("interleaved-zb", "zbv", "dualpipev")


def split_backward_error(schedule: str, zero_stage: int, replicated: bool, mixed_precision: bool) -> str | None:
    """Why a split-backward schedule cannot train with this data parallelism (``replicated``: replicas of
    the weights over dp_replicate or context-parallel ranks), or None.

    torch's pipelining computes the weight gradients of a split backward with ``torch.autograd.grad`` on
    the stage's parameters, outside the hooks data parallelism relies on: under FSDP-managed weights that
    are re-sharded after the forward (ZeRO-3, and meshfit's mixed-precision replicas at zero_stage 0) the
    first stage's gradients are lost (measured: `small`, PP 2, loss 0.28 off the one-process run after 10
    steps), and DDP fails inside its reducer (torch issue 144530). ZeRO-1 and 2 keep their weights gathered
    from forward to backward and match."""
    if schedule not in SPLIT_BACKWARD:
        return None
    if zero_stage == 3:
        return "FSDP re-shards the weights after the forward and the first stage's gradients are lost"
    if zero_stage == 0 and mixed_precision:
        return "mixed precision computes on FSDP-managed weight copies and the first stage's gradients are lost"
    if zero_stage == 0 and replicated:
        return "replicas of the weights lose gradients (FSDP-managed under TP) or fail in DDP's reducer"
    return None


def split_backward_recompute_error(schedule: str, recompute: str) -> str | None:
    """Why a split-backward schedule cannot train with this recompute policy, or None: torch's op-level
    selective checkpointing allows one backward through each region, and the weight-gradient step is a
    second one (measured: the dry run fails at the first step for each of them)."""
    if schedule in SPLIT_BACKWARD and recompute == "op":
        return ("op-level recompute allows one backward through each block and the weight-gradient step is a "
                "second one")
    return None
