"""The Mixture-of-Experts MLP of the Llama family: a router, routed SwiGLU experts, optional shared experts.

* ``Router``: token-choice top-k in fp32. Scores are a softmax over the experts or a sigmoid per expert;
  an aux-loss-free expert bias (DeepSeek-V3) shifts which experts are chosen, never the gate values, which
  come from the unbiased scores (renormalised over the top k with ``moe_norm_topk``, times
  ``moe_route_scale``). ``balanced`` routes round-robin, whatever the scores: split sizes known before any
  value is (a dry run's fake tensors have none to read).
* ``GroupedExperts``: the routed experts as three 3-D parameters of global shape, ``w1 (E, F, D)``,
  ``w2 (E, D, F)``, ``w3 (E, F, D)`` (expert j's slice is a Hugging Face expert's ``nn.Linear`` weight), computed
  by ``torch._grouped_mm`` over tokens sorted by expert, or by a loop over the experts where the grouped
  kernel cannot run (its operands need 16-byte aligned rows).
* ``LocalDispatcher``: sorts the routed copies of the tokens by expert (dropping those over an expert's
  capacity), and adds the experts' weighted outputs back per token. The block calls it and nothing else
  about where experts live: expert parallelism replaces it by a dispatcher that exchanges the sorted tokens
  between ranks (parallel/expert_parallel.py).

The block reads no parallel size. What it counts for the step (tokens per expert, dropped tokens, the
auxiliary loss) stays on the module until the trainer takes it (models/moe_stats.py). The auxiliary loss
trains where the block is (``AuxLossScaler``), so no loss function elsewhere (a pipeline's last stage,
another rank) needs to see it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from meshfit.models.config import ModelConfig

# (fraction, mean probabilities) of one part of the sequences -> the whole sequences' (parallel/moe_parts.py).
Parts = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.score, self.norm_topk, self.route_scale = cfg.moe_score, cfg.moe_norm_topk, cfg.moe_route_scale
        self.gate = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.balanced = False  # round-robin routing (dry runs: static split sizes)
        # The aux-loss-free bias is state of the model (checkpointed), not a parameter: no gradient reaches it.
        self.expert_bias: torch.Tensor | None
        if cfg.moe_bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts), persistent=True)
        else:
            self.expert_bias = None

    @torch.no_grad()
    def init_buffers(self) -> None:
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (scores [T, E] fp32, chosen experts [T, k], gate values [T, k] fp32)."""
        logits = F.linear(x.float(), self.gate.weight.float())  # fp32: near-ties decide the choice
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        if self.balanced:
            tokens = x.shape[0]
            slots = torch.arange(tokens * self.top_k, device=x.device).view(tokens, self.top_k)
            chosen = slots % self.experts  # k distinct experts per token, every expert equally loaded
        else:
            select = scores if self.expert_bias is None else scores + self.expert_bias
            chosen = select.topk(self.top_k, dim=-1).indices
        gates = scores.gather(-1, chosen)
        if self.norm_topk:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return scores, chosen, gates * self.route_scale


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _aligned(t: torch.Tensor) -> bool:
    # torch._grouped_mm wants 16-byte aligned row strides and start (the allocator aligns storages).
    size = t.element_size()
    return (t.storage_offset() * size) % 16 == 0 and all((s * size) % 16 == 0 for s in t.stride() if s != 1)


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU, ``w2(silu(w1 x) * w3 x)`` per expert on its own tokens."""

    holds_matmul = True  # an FSDP unit of its own when a block is split (parallel/fsdp_units.py)

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))  # gate
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))  # down
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))  # up
        self.kernel = "auto"  # "grouped", "loop", or "auto": grouped where it runs

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, D]: tokens sorted by expert, counts [E] of them per expert (rows past their sum are
        ignored, and come back as zeros)."""
        # Under expert parallelism the weights are DTensors of global shape; the kernel takes this rank's
        # experts (the dispatcher sorted the tokens by them).
        w1, w2, w3 = (_local(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        if self._grouped(x, w1, w2, w3):
            offsets = counts.cumsum(0).to(torch.int32)
            # Rows past the groups (dropped copies) come out of the kernel undefined, in forward and in the
            # input's gradient: masked on both sides (a mask, not a product: they may hold NaN).
            rows = (torch.arange(x.shape[0], device=x.device) < offsets[-1]).unsqueeze(-1)
            x = torch.where(rows, x, 0.0)
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
            return torch.where(rows, torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets), 0.0)
        return self._loop(x, counts, w1, w2, w3)

    def _grouped(self, x: torch.Tensor, *weights: torch.Tensor) -> bool:
        if self.kernel != "auto":
            return self.kernel == "grouped"
        hidden = weights[0].shape[1]
        probe = (x.shape[-1] * x.element_size()) % 16 == 0 and (hidden * x.element_size()) % 16 == 0
        return probe and _aligned(x) and all(_aligned(w) for w in weights)

    @staticmethod
    def _loop(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              w3: torch.Tensor) -> torch.Tensor:
        sizes = counts.tolist()  # a host sync: the fallback's price
        used = sum(sizes)
        parts = x[:used].split(sizes)
        outs = [F.linear(F.silu(F.linear(p, w1[j])) * F.linear(p, w3[j]), w2[j]) for j, p in enumerate(parts)]
        outs.append(x.new_zeros(x.shape[0] - used, w2.shape[1]))
        return torch.cat(outs)


@dataclass
class Routed:
    """Tokens sorted by expert, and what combining their outputs needs."""

    tokens: torch.Tensor  # [T·k, D], grouped by expert; dropped copies last
    counts: torch.Tensor  # [E] kept copies per expert
    demand: torch.Tensor  # [E] copies routed to each expert before any was dropped
    dropped: torch.Tensor  # () copies over capacity
    source: torch.Tensor  # [T·k] the token each sorted row came from
    gates: torch.Tensor  # [T·k] its gate value (0 where dropped), fp32
    sizes: list[int] | None = None  # counts known on the host without reading a tensor (balanced routing)
    back: object = None  # what a dispatcher that moved the tokens needs to bring the outputs back


def balanced_counts(tokens: int, top_k: int, experts: int, capacity_factor: float | None) -> list[int]:
    """Kept copies per expert under ``Router.balanced`` (copy i of the micro-batch goes to expert i mod E),
    computed from shapes alone: what a dry run on fake tensors cannot read from the counts tensor."""
    copies = tokens * top_k
    demand = [copies // experts + (1 if e < copies % experts else 0) for e in range(experts)]
    if capacity_factor is None:
        return demand
    capacity = math.ceil(capacity_factor * tokens * top_k / experts)
    return [min(d, capacity) for d in demand]


class LocalDispatcher:
    """Dispatch to experts that are all on this rank."""

    def dispatch(self, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor, experts: int,
                 capacity_factor: float | None, balanced: bool = False) -> Routed:
        tokens, k = chosen.shape
        flat = chosen.reshape(-1)
        one_hot = F.one_hot(flat, experts)  # counts without bincount: fake tensors have no values to count
        demand = one_hot.sum(0)
        keep = torch.ones_like(flat, dtype=torch.bool)
        if capacity_factor is not None:
            capacity = math.ceil(capacity_factor * tokens * k / experts)
            position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # earlier tokens first (position policy)
            keep = position < capacity
        key = torch.where(keep, flat, experts)  # dropped copies sort after every expert's group
        order = key.argsort(stable=True)
        counts = torch.zeros_like(demand).scatter_add_(0, flat, keep.to(demand.dtype))
        source = order // k
        kept_gates = torch.where(keep, gates.reshape(-1), 0.0)[order]
        sizes = balanced_counts(tokens, k, experts, capacity_factor) if balanced else None
        return Routed(x[source], counts, demand, (~keep).sum(), source, kept_gates, sizes)

    def combine(self, out: torch.Tensor, routed: Routed, tokens: int) -> torch.Tensor:
        """Each token's gate-weighted sum of its experts' outputs, [T, D] in the output's dtype."""
        weighted = out.float() * routed.gates.unsqueeze(-1)
        summed = torch.zeros(tokens, out.shape[-1], dtype=torch.float32, device=out.device)
        return summed.index_add_(0, routed.source, weighted).to(out.dtype)


class SwiGLU(nn.Module):
    """A shared expert's (or several side by side) SwiGLU; the same computation as the dense block's."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class AuxLossScaler(torch.autograd.Function):
    """Returns the block's output unchanged and, in backward, gives the auxiliary loss the gradient `scale`:
    the loss trains as if added to the step's loss, wherever that loss is computed (Megatron-Core's
    MoEAuxLossAutoScaler has the same idea). `scale` is what the language-model loss of the micro-batch is
    scaled by before it reaches the gradients (the trainer sets it: models/moe_stats.set_aux_loss_scale)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.aux_meta, ctx.scale = (aux.shape, aux.dtype, aux.device), scale
        return out.view_as(out)  # a view: autograd needs a new tensor for the output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def _in_backward() -> bool:
    """Whether autograd is running a backward now (activation checkpointing recomputing the forward)."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """The Mixture-of-Experts MLP of one block: [b, s, D] -> [b, s, D]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.dim, cfg.moe_hidden)
        shared = cfg.moe_shared_experts * cfg.moe_hidden
        self.shared = SwiGLU(cfg.dim, shared) if shared else None
        self.dispatcher = LocalDispatcher()
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_coeff = cfg.moe_aux_loss_coeff
        self.bias_rate = cfg.moe_bias_update_rate
        self.aux_grad_scale = 1.0  # the auxiliary loss's gradient (AuxLossScaler), set by the trainer
        self.counting = True  # off while a pipeline stage runs a forward only to learn its shapes
        # Set by the layout where this rank holds a part of each sequence (context or sequence parallelism):
        # the whole sequences' (f, P) of the auxiliary loss from this part's (parallel/moe_parts.py). None: whole.
        self.sequence_parts: Parts | None = None
        self.counted: dict[str, torch.Tensor] = {}  # this step's tokens per expert, dropped copies, aux loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self._routed(flat)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)

    # torch.compile (train.compile) runs this part eagerly, a graph break on each side: the dispatch reads
    # split sizes on the host (.tolist() under expert parallelism), the expert kernel is chosen by the
    # storage alignment of its operands, and the counts are kept only outside a recomputing backward,
    # which a traced graph could not tell apart. The rest of the block (attention, norms, shared experts)
    # is compiled.
    @torch.compiler.disable
    def _routed(self, flat: torch.Tensor) -> torch.Tensor:
        """The routed experts' gate-weighted outputs for the tokens `flat` [T, D]; counts them for the step."""
        scores, chosen, gates = self.router(flat)
        routed = self.dispatcher.dispatch(flat, chosen, gates, self.router.experts, self.capacity_factor,
                                          balanced=self.router.balanced)
        out = self.dispatcher.combine(self.experts(routed.tokens, routed.counts), routed, flat.shape[0])
        if self.training and torch.is_grad_enabled():
            # Computed in a recomputed forward too: activation checkpointing wants the same saved tensors.
            aux = (load_balancing_loss(scores, routed.demand, self.sequence_parts) * self.aux_coeff
                   if self.aux_coeff > 0 else None)
            if aux is not None:
                out = AuxLossScaler.apply(out, aux, self.aux_grad_scale)
            if self.counting and not _in_backward():
                self._account(aux, scores, routed)
        return out

    @torch.no_grad()
    def _account(self, aux: torch.Tensor | None, scores: torch.Tensor, routed: Routed) -> None:
        step = {"tokens": routed.demand.float(), "dropped": routed.dropped.float(),
                "aux_loss": aux.detach() if aux is not None else scores.new_zeros(()),
                "micro_batches": scores.new_ones(())}
        for key, value in step.items():
            self.counted[key] = self.counted[key] + value if key in self.counted else value


def load_balancing_loss(scores: torch.Tensor, demand: torch.Tensor, parts: Parts | None = None) -> torch.Tensor:
    """Switch/GShard load-balancing loss, ``E · Σ_e f_e · P_e``: f_e the fraction of routed copies that chose
    expert e, P_e the mean probability it got (sigmoid scores normalised per token). 1 when balanced.
    (transformers' ``load_balancing_loss_func`` is top_k times this, over all layers' tokens at once.)

    `parts`: these tokens are one part of each sequence, the others on other ranks; it turns this part's f
    and P into the whole sequences' (the loss is not linear in the tokens), so that every part computes the
    loss a process holding whole sequences does, with a gradient the layout's reduction makes exact."""
    probs = scores / scores.sum(dim=-1, keepdim=True)
    fraction = demand.float() / demand.sum()
    mean_probs = probs.mean(dim=0)
    if parts is not None:
        fraction, mean_probs = parts(fraction, mean_probs)
    return scores.shape[-1] * (fraction * mean_probs).sum()
