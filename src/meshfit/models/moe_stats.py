"""What the Mixture-of-Experts blocks of a model counted in a step, taken by the trainer.

Two hooks, both layout-agnostic (the caller brings the reduction over ranks):

* ``take_aux_loss(model)``: after a micro-batch's forward, the sum of its blocks' load-balancing losses
  (already times their coefficient), to add to the loss before backward; None when no block has one.
* ``end_step(model, reduce_sum)``: once per optimizer step, before the optimizer steps. Every block's
  counts of the step (tokens per expert, dropped copies, auxiliary loss, micro-batches) are packed into
  one tensor, ``reduce_sum`` sums it in place over the data-parallel ranks (one all-reduce), each
  aux-loss-free expert bias moves by ``rate · sign(mean load − load)`` (DeepSeek-V3: under-loaded experts
  become more likely), and the counts restart. Counts are taken in forward only, never in the forward
  that activation checkpointing runs again in backward.
"""

from __future__ import annotations

import re
from collections.abc import Callable
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


def take_aux_loss(model: nn.Module) -> torch.Tensor | None:
    losses = []
    for _, block in moe_blocks(model):
        if block.aux_loss is not None:
            losses.append(block.aux_loss)
            block.aux_loss = None
    return torch.stack(losses).sum() if losses else None


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


@torch.no_grad()
def end_step(model: nn.Module, reduce_sum: Callable[[torch.Tensor], None] | None = None,
             update_bias: bool = True) -> StepCounts | None:
    """Sum the step's counts over ranks, update the expert biases (unless `update_bias` is False: a step
    the optimizer skips), restart the counts; None for a model without Mixture-of-Experts blocks, or
    when no block counted this step (on every rank alike: all of them ran the same forwards)."""
    found = moe_blocks(model)
    blocks = [block for _, block in found]
    if not blocks or not blocks[0].counted:
        return None
    experts = blocks[0].router.experts
    packed = torch.cat([torch.cat([b.counted["tokens"], b.counted["dropped"].view(1), b.counted["aux_loss"].view(1),
                                   b.counted["micro_batches"].view(1)]) for b in blocks]).view(len(blocks), -1)
    if reduce_sum is not None:
        reduce_sum(packed)
    tokens = packed[:, :experts]
    for block, load in zip(blocks, tokens, strict=True):
        block.counted = {}
        bias = block.router.expert_bias
        if update_bias and bias is not None:
            bias.add_(torch.sign(load.mean() - load), alpha=block.bias_rate)
    micro = packed[0, experts + 2].clamp(min=1)
    return StepCounts(layers=[layer for layer, _ in found], tokens=tokens.clone(), dropped=packed[:, experts].clone(),
                      aux_loss=packed[:, experts + 1].sum() / micro)
