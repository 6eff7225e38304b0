"""Whether one layout can train a model on a workload: the checks `meshfit plan --layout`, `meshfit verify` and
a plan file share, so that what they accept `meshfit train` accepts too (the trainer makes the same checks
in its own terms, train/shape.py, from the same rules: layout/rules.py, layout/model_fit.py).

A refusal names the setting the way the user wrote it: flags for plan and verify, fields for a plan file.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshfit.layout.layout import Layout, Workload
from meshfit.layout.model_fit import expert_parallel_error, moe_layout_error, pipeline_model_error, seq_len_error
from meshfit.layout.rules import layout_error
from meshfit.layout.schedules import least_microbatches
from meshfit.models.config import ModelConfig


@dataclass(frozen=True)
class Names:
    """How the user wrote each setting the checks name."""

    layout: str  # before a layout key: "--layout " or "layout."
    seq_len: str
    positions: str  # how to give the model more positions
    global_batch: str
    micro_batch: str  # the micro-batch, "{}" for its value


FLAGS = Names(layout="--layout ", seq_len="--seq-len", positions="--dims max_seq_len=…",
              global_batch="--global-batch", micro_batch="micro-batch {} (--micro-batch, or micro_batch in --layout)")
PLAN_FIELDS = Names(layout="layout.", seq_len="workload.seq_len", positions="model.max_seq_len=…",
                    global_batch="workload.global_batch", micro_batch="layout.micro_batch={}")


def _given(name: str, value: object) -> str:
    return f"{name} {value}" if name.startswith("--") else f"{name}={value}"


def layout_fit_error(model: ModelConfig, layout: Layout, workload: Workload, names: Names) -> str | None:
    """None when `layout` can train `model` on `workload`; else the first problem, naming the setting."""
    error = seq_len_error(workload.seq_len, model, names.seq_len, names.positions)
    return error or _rename(_shape_error(model, layout, workload), names) or _batch_error(layout, workload, names)


def _shape_error(model: ModelConfig, layout: Layout, workload: Workload) -> str | None:
    """The layout's degrees against the model and the sequence, in the config's names."""
    from meshfit.parallel.context_parallel import cp_degree_error
    from meshfit.parallel.tensor_parallel import tp_degree_error

    error = cp_degree_error(layout.cp, workload.seq_len) if layout.cp > 1 else None
    error = error or layout_error(dp_shard=layout.dp_shard, dp_replicate=layout.dp_replicate, tp=layout.tp,
                                  pp=layout.pp, zero_stage=layout.zero_stage,
                                  offload=layout.offload, sp=layout.sp, loss_parallel=layout.loss_parallel,
                                  schedule=layout.schedule, virtual_stages=layout.virtual_stages, cp=layout.cp,
                                  ep=layout.ep,
                                  mixed_precision=workload.precision != "fp32",
                                  activation_checkpointing=layout.activation_checkpointing, config_names=True)
    seq = "train.seq_len" if layout.cp == 1 else "train.seq_len/cp"
    # Under context parallelism sequence parallelism splits each rank's part of the sequence.
    error = error or (tp_degree_error(model, layout.tp, workload.seq_len // layout.cp, layout.sp, seq)
                      if layout.tp > 1 else None)
    return (error or moe_layout_error(model, layout.tp, layout.pp, layout.cp)
            or expert_parallel_error(model, layout.ep, layout.shard, layout.offload)
            or pipeline_model_error(model, layout.pp, layout.virtual_stages))


def _rename(error: str | None, names: Names) -> str | None:
    if error is None:
        return None
    error = error.replace("parallel.", names.layout).replace("pipeline.", names.layout)
    return error.replace("train.seq_len", names.seq_len)


def _batch_error(layout: Layout, workload: Workload, names: Names) -> str | None:
    """The global batch against the data-parallel degree, the micro-batch and the pipeline's fill."""
    from meshfit.parallel.dims import divisors

    dp, batch, micro = layout.dp, workload.global_batch, layout.micro_batch
    if batch % dp:
        return (f"{_given(names.global_batch, batch)} is not a multiple of the layout's data-parallel degree {dp} "
                f"(dp_replicate × dp_shard); valid: {', '.join(str(dp * k) for k in range(1, 5))}, …")
    local = batch // dp
    if local % micro:
        return (f"{names.micro_batch.format(micro)} does not divide the per-rank batch {local} "
                f"({_given(names.global_batch, batch)} / dp {dp}); valid: {', '.join(map(str, divisors(local)))}")
    least = least_microbatches(layout.schedule, layout.pp) if layout.pp > 1 else 1
    if local // micro >= least:
        return None
    valid = [d for d in divisors(local) if local // d >= least]
    fix = (f"valid: {', '.join(map(str, valid))}" if valid else f"raise {names.global_batch} to a multiple of "
           f"{layout.pp * dp} (pp × dp) or use schedule gpipe")
    return (f"{names.micro_batch.format(micro)} leaves {local // micro} pipeline micro-batch(es) per step (per-rank "
            f"batch {local}), fewer than the {least} schedule {layout.schedule} needs to fill pp={layout.pp} "
            f"ranks; {fix}")
