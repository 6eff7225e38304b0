"""How pipeline stages split a model's blocks: pure arithmetic shared by training and the planner.

The split balances forward FLOPs per token: contiguous runs of blocks, the last stage also carrying the
output head's matmul (the embedding lookup costs next to nothing, so the first stage gets more blocks).
"""

from __future__ import annotations

from meshfit.models.config import ModelConfig, moe_mlp_params


def layer_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one transformer block (matmuls + attention scores and weighted sum).

    A Mixture-of-Experts block computes with its router, top_k routed and its shared experts (its active
    weights, not all of them); where the first blocks stay dense, the mean over the model's blocks stands
    for each (the split weighs every block alike)."""
    q, kv = cfg.q_width, cfg.n_kv_heads * cfg.head_size
    attn = 2 * cfg.dim * (2 * q + 2 * kv)  # q and output projections, k and v projections
    mlp = 2 * cfg.dim * cfg.ffn_hidden * (3 if cfg.family == "llama" else 2)
    if cfg.moe_layers:
        mlp = (mlp * (cfg.n_layers - cfg.moe_layers) + 2 * moe_mlp_params(cfg, active=True) * cfg.moe_layers) \
            / cfg.n_layers
    return attn + mlp + 4 * q * seq_len


def head_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the output head."""
    return 2.0 * cfg.dim * cfg.padded_vocab


def _best_max_stage(layers: int, stages: int, layer_cost: float, head_cost: float) -> float:
    """Cheapest possible most-expensive stage: with k blocks on the last stage (it has the head) the
    others need ⌈(layers−k)/(stages−1)⌉ at most."""
    if stages == 1:
        return layers * layer_cost + head_cost
    front = stages - 1
    return min(max(k * layer_cost + head_cost, -(-(layers - k) // front) * layer_cost)
               for k in range(1, layers - front + 1))


def _fit(budget: float, layer_cost: float, head_cost: float) -> int:
    """Most blocks t with t · layer_cost + head_cost ≤ budget (the comparison balanced_split makes)."""
    t = max(0, int((budget - head_cost) / layer_cost))
    while (t + 1) * layer_cost + head_cost <= budget:
        t += 1
    while t > 0 and t * layer_cost + head_cost > budget:
        t -= 1
    return t


def balanced_split(layers: int, stages: int, layer_cost: float, head_cost: float) -> list[int]:
    """Blocks per stage, contiguous, minimising the most expensive stage (the head counts on the last).

    The split gives each stage, front to back, the fewest blocks that still let the stages after it
    meet the best achievable maximum of the remaining sub-problem; that fewest count follows from how
    many blocks the later stages can hold under that maximum.
    """
    counts, rest = [], layers
    for k in range(stages, 1, -1):
        budget = _best_max_stage(rest, k, layer_cost, head_cost)
        room = _fit(budget, layer_cost, head_cost) + (k - 2) * _fit(budget, layer_cost, 0.0)
        take = max(1, rest - room)
        counts.append(take)
        rest -= take
    return counts + [rest]
