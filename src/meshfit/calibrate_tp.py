"""`meshfit calibrate --model`: the model's own training rate under tensor parallelism.

Splitting a block's matmuls over t ranks does not divide its time by t: without sequence parallelism the
norms, residual adds and the loss stay whole on every rank, each split layer runs through DTensor's
per-operator dispatch, and the activations are all-reduced (or, with sequence parallelism, gathered and
scattered) in forward and backward. On 2 CPU ranks, `small`'s first two blocks took
1.6× (8 sequences of 256 tokens) to 2.9× (2 sequences) half the time of one unsplit rank. Rather than model each of these, this measures
them: the model's first blocks, laid out by meshfit's own tensor-parallel code (`apply_model_parallel`,
what `meshfit train` runs), trained at every tensor-parallel degree the ranks allow, with and without
sequence parallelism. The rate is counted as the planner counts a tensor-parallel rank's work,
flops_per_token / t per token; with the fixed cost per block it includes the layout's collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from meshfit.models.config import ModelConfig

# The profile's keys: tensor parallelism alone, and with sequence and loss parallelism.
VARIANTS = {"plain": False, "sp": True}


def model_for_rates(model: ModelConfig, seq: int) -> ModelConfig:
    """At most two of ``model``'s blocks (with its embeddings, head and loss), able to take ``seq``."""
    return dataclasses.replace(model, n_layers=min(2, model.n_layers), max_seq_len=max(seq, model.max_seq_len),
                               dropout=0.0)


def _tp_step(model: ModelConfig, seq: int, batch: int, tp_mesh: Any, sp: bool, dtype: Any,
             device: Any) -> Callable[[], None]:
    """One forward + loss + backward of the tensor-parallel model (its vocabulary padded for the degree),
    as training lays it out."""
    import torch
    from torch.distributed.tensor.parallel import loss_parallel

    from meshfit.config import ParallelSection
    from meshfit.models import build_model, init_weights
    from meshfit.parallel.parallelize import apply_model_parallel
    from meshfit.train.loss import lm_loss

    cfg = model
    net = build_model(cfg, "meta")
    apply_model_parallel(net, cfg, tp_mesh, ParallelSection(tp=tp_mesh.size(), sp=sp, loss_parallel=sp))
    net.to_empty(device=device)
    init_weights(net, 0, cfg, None)
    net.to(dtype)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def step() -> None:
        with loss_parallel() if sp else contextlib.nullcontext():
            lm_loss(net(x), x, cfg.vocab_size).backward()

    return step


def tp_rates(device: Any, dtypes: dict[str, Any], model: ModelConfig, seq: int, tokens: int, target_s: float,
             timed: Callable[..., float], sizes: list[int], say: Callable[[str], None]
             ) -> dict[int, dict[str, dict[str, dict[str, float]]]]:
    """{t: {"plain" | "sp": {"flops" | "block_call_s": {dtype: value}}}} for each tensor-parallel degree t
    in ``sizes`` that splits the model; the world runs world / t tensor-parallel groups at once, as a layout
    with other dimensions does. ``timed`` is calibrate's collective timer (every rank makes the same number
    of calls).

    Each is timed at two batch sizes: the time grows with the tokens at the "flops" rate, and what it does
    not grow by (DTensor's dispatch, collective latencies) is a fixed cost per block and micro-batch,
    "block_call_s" (measured at 34–65 ms per block for `small` on 2 CPU ranks, more than the split matmuls
    of a 256-token sequence)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshfit.models import flops_per_token
    from meshfit.models.config import pad_vocab_for_tp
    from meshfit.parallel.tensor_parallel import tp_degree_error

    base = model_for_rates(model, seq)
    # Batches of sequences a factor of 4 apart (a wide lever on the fixed part), around calibrate's tokens.
    batches = (max(1, tokens // seq // 2), 4 * max(1, tokens // seq // 2))
    world = dist.get_world_size()
    out: dict[int, dict[str, dict[str, dict[str, float]]]] = {}
    for t in sizes:
        mesh = init_device_mesh(device.type, (world // t, t), mesh_dim_names=("rest", "tp"))["tp"]
        cfg = pad_vocab_for_tp(base, t)  # as training builds it
        for variant, sp in VARIANTS.items():
            if tp_degree_error(cfg, t, seq, sp) is not None:
                continue
            entry = out.setdefault(t, {}).setdefault(variant, {"flops": {}, "block_call_s": {}})
            for name, dtype in dtypes.items():
                dist.barrier()
                one, two = (timed(_tp_step(cfg, seq, b, mesh, sp, dtype, device), device, target_s)
                            for b in batches)
                per_seq = (two - one) / (batches[1] - batches[0])
                if per_seq <= 0:  # noise larger than the added work: no fixed part can be told apart
                    per_seq = two / batches[1]
                entry["flops"][name] = flops_per_token(cfg, seq) * seq / t / per_seq
                entry["block_call_s"][name] = max(0.0, one - batches[0] * per_seq) / cfg.n_layers
                say(f"model {name} at tp {t}{' + sp' if sp else ''}: {entry['flops'][name] / 1e9:.1f} GFLOP/s "
                    f"per rank and {entry['block_call_s'][name] * 1e3:.1f} ms per block and micro-batch, training")
    return out
