"""Pipeline parallelism: split the layers into stages (data), place stages on ranks, build the schedule.

Stages are contiguous runs of transformer blocks; the first stage also holds the token embedding, the
last the final norm, the output head and the loss. The split (meshfit.layout.stage_split) balances the forward
FLOPs per token of each stage. Schedules come from torch.distributed.pipelining.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from meshfit.layout.schedules import SCHEDULES
from meshfit.layout.stage_split import balanced_split, head_flops, layer_flops
from meshfit.models import ModelConfig
from meshfit.models.moe_stats import uncounted
from meshfit.parallel.pipeline_memory import LeanStage, SendWaits


@dataclass(frozen=True)
class StagePlan:
    """Which layers each global stage holds and which stages this layout puts on each pipeline rank."""

    layers: tuple[tuple[int, ...], ...]  # global stage id -> layer indices
    v_shape: bool

    @property
    def n_stages(self) -> int:
        return len(self.layers)

    def stages_of_rank(self, pp_rank: int, pp: int) -> list[int]:
        per_rank = self.n_stages // pp
        if self.v_shape:  # rank r holds stages r and 2p-1-r: first and last stage on rank 0
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + k * pp for k in range(per_rank)]  # interleaved: round-robin


def plan_stages(cfg: ModelConfig, seq_len: int, pp: int, virtual: int, schedule: str,
                layers_per_stage: list[int] | None) -> StagePlan:
    n_stages = pp * virtual
    counts = layers_per_stage or balanced_split(cfg.n_layers, n_stages, layer_flops(cfg, seq_len),
                                                head_flops(cfg))
    bounds = [sum(counts[:i]) for i in range(n_stages + 1)]
    layers = tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(n_stages))
    return StagePlan(layers=layers, v_shape=SCHEDULES[schedule][2])


def cut_stage(model: nn.Module, layer_ids: tuple[int, ...], first: bool, last: bool) -> nn.Module:
    """Keep only this stage's blocks (names unchanged, so initialization matches the full model)."""
    keep = {str(i) for i in layer_ids}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if not first:
        model.tok_embeddings = None
        if hasattr(model, "pos_embeddings"):
            model.pos_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


def build_schedule(name: str, stages: list[PipelineStage], microbatches: int, loss_fn
                   ) -> tuple[object, SendWaits | None]:
    """The torch schedule (gradients are scaled by 1/microbatches so they equal a full-batch mean) and, for
    multi-stage schedules, what waits for its sends as early as is safe (see pipeline_memory; the caller
    drains it after every step)."""
    cls = get_schedule_class(SCHEDULES[name][0])
    multi = SCHEDULES[name][1] != 1
    schedule = cls(stages if multi else stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
    # Single-stage 1F1B already waits for each send before the next one; GPipe keeps every micro-batch anyway.
    return schedule, (SendWaits.install(schedule, stages) if multi else None)


class _Stage(LeanStage):
    """torch (2.13) learns a stage's shapes by running it once, forward and backward, on placeholder
    inputs before the first step: that forward counts no Mixture-of-Experts tokens (models/moe_stats)."""

    def _forward_metadata_inference(self, *args, **kwargs):
        with uncounted(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)


def make_stage(module: nn.Module, stage_id: int, n_stages: int, device: torch.device, group) -> PipelineStage:
    """A stage whose receive buffers exist only while their micro-batch needs them (pipeline_memory)."""
    return _Stage(module, stage_id, n_stages, device, group=group)
