"""What the Mixture-of-Experts blocks of a model counted in a step, taken by the trainer.

Hooks, all layout-agnostic (the caller brings the reduction over ranks):

* ``set_aux_loss_scale(model, scale)``: the gradient each block gives its load-balancing loss in backward
  (models/moe.AuxLossScaler): the loss trains in the block itself, on whichever rank holds it, never
  added to the language-model loss.
* ``end_step(model, reduce_sum, layers)``: once per optimizer step, before the optimizer steps. Every block's
  counts of the step (tokens per expert, dropped copies, auxiliary loss, micro-batches) are packed into
  one tensor with a row for each of the model's MoE `layers` (zeros for those this rank does not hold: a
  pipeline stage holds some), ``reduce_sum`` sums it in place over the ranks that hold the rows and see
  different tokens (one all-reduce per group), each aux-loss-free expert bias this rank holds moves by
  ``rate · sign(mean load − load)`` (DeepSeek-V3: under-loaded experts become more likely), and the
  counts restart. Counts are taken in forward only, never in the forward that activation checkpointing
  runs again in backward, nor in the one a pipeline stage runs to learn its shapes (``uncounted``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from meshfit.models.moe import MoE


def moe_blocks(model: nn.Module) -> list[tuple[int, MoE]]:
    """The model's Mixture-of-Experts MLPs with their layer index, in layer order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            found.append((int(match.group(1)) if match else len(found), module))
    return found


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Every block's auxiliary loss trains with gradient `scale`: what the trainer scales a micro-batch's
    language-model loss by (1 / accumulation steps; 1 under a pipeline, whose schedule divides the
    gradients by its micro-batches afterwards), so that the loss trains as if added to that one."""
    for _, block in moe_blocks(model):
        block.aux_grad_scale = scale


@contextlib.contextmanager
def uncounted(model: nn.Module) -> Iterator[None]:
    """Forwards run inside count nothing (a pipeline stage's forward on placeholder inputs)."""
    blocks = [block for _, block in moe_blocks(model)]
    for block in blocks:
        block.counting = False
    try:
        yield
    finally:
        for block in blocks:
            block.counting = True


@dataclass
class StepCounts:
    """A step's counts, summed over the data-parallel ranks (tensors: read them only where values exist)."""

    layers: list[int]  # the index of each Mixture-of-Experts layer
    tokens: torch.Tensor  # [MoE layers, E] routed token copies per expert
    dropped: torch.Tensor  # [MoE layers] copies over capacity
    aux_loss: torch.Tensor  # () the auxiliary loss of a micro-batch, mean over micro-batches and ranks

    def record(self) -> dict[str, object]:
        """The step record's fields (reads the values: a host sync)."""
        tokens = self.tokens
        load = tokens.max(dim=-1).values / tokens.mean(dim=-1).clamp(min=1e-9)
        return {"moe_layers": self.layers, "moe_aux_loss": self.aux_loss.item(), "moe_dropped_tokens": int(self.dropped.sum().item()),
                "moe_load": [round(v, 4) for v in load.tolist()],
                "moe_tokens_max": [int(v) for v in tokens.max(dim=-1).values.tolist()],
                "moe_tokens_mean": [round(v, 2) for v in tokens.mean(dim=-1).tolist()]}


def _row(block: MoE | None, width: int, device: torch.device) -> torch.Tensor:
    counted = block.counted if block is not None else {}
    if not counted:  # a layer another rank holds (or that counted nothing): zeros to the sum
        return torch.zeros(width, device=device)
    return torch.cat([counted["tokens"], counted["dropped"].view(1), counted["aux_loss"].view(1),
                      counted["micro_batches"].view(1)])


@torch.no_grad()
def end_step(model: nn.Module, reduce_sum: Callable[[torch.Tensor], None] | None = None,
             update_bias: bool = True, layers: list[int] | None = None,
             experts: int | None = None) -> StepCounts | None:
    """Sum the step's counts over ranks, update the expert biases (unless `update_bias` is False: a step
    the optimizer skips), restart the counts; None for a model without Mixture-of-Experts blocks, or
    when no block counted this step.

    `layers` with `experts` (routed experts per block): every MoE layer of the whole model, for a rank that
    holds only some of them (a pipeline stage, which may hold none) and whose `reduce_sum` brings the
    other stages' rows; every rank then takes part alike, whatever it holds. Without them: the blocks this
    rank holds, which all counted or none did (all ranks ran the same forwards)."""
    found = dict(moe_blocks(model))
    if layers is None:
        layers = list(found)
        if not layers or not found[layers[0]].counted:
            return None
        experts = found[layers[0]].router.experts
    if not layers or experts is None:
        return None
    device = next(model.parameters()).device
    packed = torch.stack([_row(found.get(layer), experts + 3, device) for layer in layers])
    if reduce_sum is not None:
        reduce_sum(packed)
    tokens = packed[:, :experts]
    for layer, load in zip(layers, tokens, strict=True):
        if (block := found.get(layer)) is None:
            continue
        block.counted = {}
        bias = block.router.expert_bias
        if update_bias and bias is not None:
            bias.add_(torch.sign(load.mean() - load), alpha=block.bias_rate)
    micro = packed[0, experts + 2].clamp(min=1)
    return StepCounts(layers=list(layers), tokens=tokens.clone(), dropped=packed[:, experts].clone(),
                      aux_loss=packed[:, experts + 1].sum() / micro)
