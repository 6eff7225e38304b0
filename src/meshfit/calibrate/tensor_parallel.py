"""`meshfit calibrate --model`: the model's own training rate under tensor parallelism.

Splitting a block's matmuls over t ranks does not divide its time by t: without sequence parallelism the
norms, residual adds and the loss stay whole on every rank, each split layer runs through DTensor's
per-operator dispatch, and the activations are all-reduced (or, with sequence parallelism, gathered and
scattered) in forward and backward. On 2 CPU ranks, `small`'s first two blocks took 1.6× (8 sequences of
256 tokens) to 2.9× (2 sequences) half the time of one unsplit rank. Rather than model each of these, this
measures them: the model's first blocks, laid out by meshfit's own tensor-parallel code (`apply_model_parallel`,
what `meshfit train` runs), trained at every tensor-parallel degree the ranks allow, with and without
sequence parallelism. The rate is counted as the planner counts a tensor-parallel rank's work,
flops_per_token / t per token; with the fixed cost per block it includes the layout's collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from meshfit.hardware.profile import TP_VARIANTS, Rates, Seconds, TPRates
from meshfit.models.config import ModelConfig


def model_for_rates(model: ModelConfig, seq: int) -> ModelConfig:
    """At most two of ``model``'s blocks (with its embeddings, head and loss), able to take ``seq``."""
    return dataclasses.replace(model, n_layers=min(2, model.n_layers), max_seq_len=max(seq, model.max_seq_len),
                               dropout=0.0)


def _tp_step(model: ModelConfig, seq: int, batch: int, tp_mesh: Any, sp: bool, dtype: Any,
             device: Any) -> Callable[[], None]:
    """One forward + loss + backward of the tensor-parallel model (its vocabulary padded for the degree),
    as training lays it out; run once before it is returned (DTensor's caches, the first gradients)."""
    import torch
    from torch.distributed.tensor.parallel import loss_parallel

    from meshfit.config import ParallelSection
    from meshfit.models import build_model, init_weights
    from meshfit.models.loss import lm_loss
    from meshfit.parallel.parallelize import apply_model_parallel

    net = build_model(model, "meta")
    apply_model_parallel(net, model, tp_mesh, ParallelSection(tp=tp_mesh.size(), sp=sp, loss_parallel=sp))
    net.to_empty(device=device)
    init_weights(net, 0, model, None)
    net.to(dtype)
    x = torch.randint(0, model.vocab_size, (batch, seq), device=device)

    def step() -> None:
        net.zero_grad(set_to_none=True)  # each step writes fresh gradients, as training's first micro-batch
        with loss_parallel() if sp else contextlib.nullcontext():
            lm_loss(net(x), x, model.vocab_size).backward()

    step()
    return step


def split_fixed(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(FLOP/s, fixed seconds per step) through two (seconds, FLOPs) points: a step of a few tokens, where
    the fixed part dominates, and a full one. The small step is as short as training's steps get (one
    16-token sequence) so that a straight line through it does not charge the larger matmuls' better
    efficiency to the fixed part. When noise makes the line fall (or the fixed part negative), all of the
    large step's time is counted as rate."""
    (t1, f1), (t2, f2) = small, large
    if t2 <= t1 or f2 <= f1:
        return f2 / t2, 0.0
    per_flop = (t2 - t1) / (f2 - f1)
    fixed = t1 - f1 * per_flop
    return (1.0 / per_flop, fixed) if fixed > 0 else (f2 / t2, 0.0)


# Tokens of the short step that measures the fixed part (one sequence).
SHORT_SEQ = 16


def tp_rates(device: Any, dtypes: dict[str, Any], model: ModelConfig, seq: int, tokens: int, target_s: float,
             timed: Callable[..., float], sizes: list[int], say: Callable[[str], None]
             ) -> dict[int, dict[str, dict[str, dict[str, float]]]]:
    """{t: {"plain" | "sp": {"flops" | "block_call_s": {dtype: value}}}} for each tensor-parallel degree t
    in ``sizes`` that divides the world and splits the model; the world runs world / t tensor-parallel
    groups at once, as a layout with other dimensions does. ``timed`` is calibrate's collective timer
    (every rank makes the same number of calls).

    Each is timed at two sizes (split_fixed): the time grows with the FLOPs at the "flops" rate, and what it
    does not grow by (DTensor's dispatch, collective latencies, the head's and loss's fixed work) is a fixed
    cost per block and micro-batch, "block_call_s"."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshfit.models import flops_per_token
    from meshfit.models.config import pad_vocab_for_tp
    from meshfit.parallel.tensor_parallel import tp_degree_error

    base = model_for_rates(model, seq)
    # A one-sequence step of SHORT_SEQ tokens (mostly fixed cost) and one of calibrate's tokens.
    points = ((1, SHORT_SEQ), (max(1, tokens // seq), seq))
    world = dist.get_world_size()
    # Training's collectives run over NCCL on GPUs; calibrate's default group is gloo.
    backend = {"rest": "nccl", "tp": "nccl"} if device.type == "cuda" else None
    out: dict[int, dict[str, dict[str, dict[str, float]]]] = {}
    for t in (t for t in sizes if world % t == 0):
        mesh = init_device_mesh(device.type, (world // t, t), mesh_dim_names=("rest", "tp"),
                                backend_override=backend)["tp"]
        cfg = pad_vocab_for_tp(base, t)  # as training builds it
        for sp in (False, True):  # with sp, loss parallelism too (the profile's TP_VARIANTS)
            if any(tp_degree_error(cfg, t, s, sp) is not None for _, s in points):
                continue
            entry = out.setdefault(t, {}).setdefault(TP_VARIANTS[sp], {"flops": {}, "block_call_s": {}})
            for name, dtype in dtypes.items():
                dist.barrier()
                # Counted as the planner counts a tensor-parallel rank's work: flops_per_token / t per token.
                rate, fixed = split_fixed(*((timed(_tp_step(cfg, s, b, mesh, sp, dtype, device), device, target_s),
                                             flops_per_token(cfg, s) * b * s / t) for b, s in points))
                entry["flops"][name] = rate
                entry["block_call_s"][name] = fixed / cfg.n_layers
                say(f"model {name} at tp {t}{' + sp' if sp else ''}: {entry['flops'][name] / 1e9:.1f} GFLOP/s "
                    f"per rank and {entry['block_call_s'][name] * 1e3:.1f} ms per block and micro-batch, training")
    return out


def slowest_tp(ranks: list[dict[str, Any]]) -> dict[int, dict[str, TPRates]]:
    """The slowest rank's tensor-parallel rate and largest fixed cost per degree, variant and dtype."""
    def worst(t: int, v: str, key: str, pick: Callable[..., float]) -> dict[str, float]:
        return {d: pick(r["tp_flops"][t][v][key][d] for r in ranks) for d in Rates.model_fields}

    return {t: {v: TPRates(flops=Rates(**worst(t, v, "flops", min)),
                           block_call_s=Seconds(**worst(t, v, "block_call_s", max)))
                for v in variants} for t, variants in ranks[0].get("tp_flops", {}).items()}
