"""The rules a layout must follow to run, written once for `meshfit plan`, `meshfit verify` and `meshfit train`.

The planner's Layout and the trainer's config sections name the same fields; `layout_error` words its
answer in either vocabulary: ``layout zero_stage`` for a plan, ``parallel.zero_stage`` for a config.
"""

from __future__ import annotations

from meshfit.layout.schedules import (
    SCHEDULES,
    fixed_virtual_stages,
    split_backward_error,
    split_backward_recompute_error,
)

# Config section of each field the rules name.
SECTION = {"dp_shard": "parallel", "dp_replicate": "parallel", "tp": "parallel", "cp": "parallel", "ep": "parallel",
           "zero_stage": "parallel",
           "offload": "parallel", "sp": "parallel", "loss_parallel": "parallel", "schedule": "pipeline",
           "virtual_stages": "pipeline", "mixed_precision": "parallel", "activation_checkpointing": "parallel"}


def default_zero_stage(dp_shard: int, cp: int = 1) -> int:
    """parallel.zero_stage when not given: FSDP (3) when state is sharded (over dp_shard × cp: context-
    parallel ranks hold the same weights, so they shard them), else DDP (0)."""
    return 3 if dp_shard * cp > 1 else 0


def data_parallel_rest(dp_replicate: int, dp_shard: int | None, tp: int, pp: int,
                       zero_stage: int | None, cp: int = 1) -> tuple[int, int]:
    """(dp_replicate, dp_shard) with an unset dp_shard (None) filled in, -1 meaning "the rest of the ranks".

    Unset, the data-parallel dimension takes the ranks the other degrees leave, as torchtitan's dp_shard
    does: dp_shard, so that the default zero_stage is 3 (FSDP) and each rank keeps 1/N of the weights,
    gradients and optimizer states (DDP's full replica per rank is what does not fit); with zero_stage=0
    (DDP, which shards nothing) the rest goes to dp_replicate instead, or, when dp_replicate is set too, none
    is sharded. When another degree already takes the rest, dp_shard is 1."""
    if dp_shard is not None:
        return dp_replicate, dp_shard
    if -1 in (dp_replicate, tp, pp, cp):
        return dp_replicate, 1
    if zero_stage == 0:
        return (-1 if dp_replicate == 1 else dp_replicate), 1
    return dp_replicate, -1


def _namer(config_names: bool):
    return (lambda f: f"{SECTION[f]}.{f}") if config_names else (lambda f: f)


def layout_error(*, config_names: bool, **fields: object) -> str | None:
    """What is wrong with this combination (naming the field and what would work), or None.

    ``fields``: dp_shard, tp, pp, zero_stage, offload, sp, loss_parallel, schedule, virtual_stages, and
    optionally cp, ep, dp_replicate, mixed_precision and activation_checkpointing.
    """
    error = _first_error(_namer(config_names), **fields)  # type: ignore[arg-type]
    return error if error is None or config_names else f"layout {error}"


def _first_error(name, *, dp_shard: int, tp: int, pp: int, zero_stage: int, offload: bool, sp: bool,
                 loss_parallel: bool, schedule: str, virtual_stages: int, cp: int = 1,
                 mixed_precision: bool = False, dp_replicate: int = 1,
                 activation_checkpointing: str = "none", ep: int = 1) -> str | None:
    if (dp_shard * cp) % ep:
        return (f"{name('ep')}={ep} must divide {name('dp_shard')} × {name('cp')} = {dp_shard} × {cp} (expert "
                "parallelism borrows its ranks from the data-parallel shard and context-parallel ranks)")
    if zero_stage == 0 and cp > 1 and (tp > 1 or mixed_precision):
        return (f"{name('cp')}={cp} with {name('zero_stage')}=0 replicates the weights on every context-parallel "
                "rank, which meshfit does with DDP only in fp32 without tensor parallelism; use "
                f"{name('zero_stage')} 1, 2 or 3 (state sharded over dp_shard × cp)")
    if zero_stage == 0 and dp_shard > 1:
        return (f"{name('dp_shard')}={dp_shard} shards state across ranks, which needs {name('zero_stage')} 1, 2 "
                f"or 3; zero_stage=0 is DDP (use {name('dp_replicate')} for plain replicas)")
    if offload and zero_stage < 2:
        return (f"{name('offload')}=true needs {name('zero_stage')} 2 or 3 (got {zero_stage}): host offload is "
                "done by FSDP for sharded parameters, gradients and optimizer states")
    for flag, on in (("sp", sp), ("loss_parallel", loss_parallel)):
        if on and tp == 1:
            return f"{name(flag)}=true needs tensor parallelism ({name('tp')} > 1)"
    if schedule not in SCHEDULES:
        return f"{name('schedule')}={schedule!r}; valid: {', '.join(SCHEDULES)}"
    fixed = fixed_virtual_stages(schedule)
    if pp > 1 and fixed is not None and virtual_stages != fixed:
        return (f"{name('virtual_stages')}={virtual_stages}: schedule {schedule} runs exactly {fixed} stage(s) "
                "per rank")
    if pp > 1 and fixed is None and virtual_stages < 2:
        return (f"{name('virtual_stages')}={virtual_stages}: {schedule} needs ≥ 2 stages per rank (use gpipe or "
                "1f1b for one)")
    why = split_backward_recompute_error(schedule, activation_checkpointing) if pp > 1 else None
    if why:
        return (f"{name('schedule')}={schedule} splits each backward into input- and weight-gradient steps: {why}; "
                f"use {name('activation_checkpointing')} full, selective or attention, or {name('schedule')} "
                "1f1b or interleaved-1f1b")
    why = split_backward_error(schedule, zero_stage, dp_replicate * cp > 1, mixed_precision) if pp > 1 else None
    if why:
        return (f"{name('schedule')}={schedule} splits each backward into input- and weight-gradient steps, which "
                f"torch runs outside data parallelism's hooks: with {name('zero_stage')}={zero_stage}, {why}; use "
                f"{name('schedule')} 1f1b or interleaved-1f1b, {name('zero_stage')} 1 or 2 over {name('dp_shard')} "
                "> 1 ranks, or fp32 without replicas")
    return None
