"""`meshfit calibrate --model`: FSDP2's own time per unit and collective, beyond the collective itself.

Around each all-gather and reduce-scatter FSDP2 copies shards in and out, runs its hooks in Python and, on
CPU ranks, waits for gloo (there are no streams to hide it behind). On 2 CPU ranks that made ZeRO-3 of
`small` 50–200 ms per step slower than DDP, more than its collectives' own time. This measures it on the
model's first blocks, sharded as ZeRO-3 over all ranks by meshfit's own `apply_fsdp` (what `meshfit
train` runs): the step's time, less the same step unsharded, less the collectives at the bus bandwidth and
latency just measured, per unit and collective call (each unit gathers twice and reduces once per step).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from meshfit.calibrate_tp import model_for_rates
from meshfit.models.config import ModelConfig

# Bytes per element of the gathered weights and of the reduced gradients, per measured dtype: fp32
# training, and mixed precision (bf16 compute copies, fp32 reductions).
_BYTES = {"fp32": (4, 4), "bf16": (2, 4)}


def _step(model: ModelConfig, seq: int, batch: int, mesh: Any, dtype_name: str, device: Any
          ) -> Callable[[], None]:
    """Forward + loss + backward of the model, sharded as ZeRO-3 over ``mesh`` (None: unsharded, in the
    compute dtype); run once before it is returned."""
    import torch

    from meshfit.models import build_model, init_weights
    from meshfit.parallel.data_parallel import apply_fsdp
    from meshfit.train.loss import lm_loss

    mixed = dtype_name == "bf16"
    net = build_model(model, "meta")
    if mesh is not None:
        apply_fsdp(net, mesh, stage=3, mixed_precision=mixed, offload=False)
    net.to_empty(device=device)
    init_weights(net, 0, model, None)
    if mesh is None and mixed:
        net.to(torch.bfloat16)
    x = torch.randint(0, model.vocab_size, (batch, seq), device=device)

    def step() -> None:
        net.zero_grad(set_to_none=True)
        lm_loss(net(x), x, model.vocab_size).backward()

    step()
    return step


def _paired_extra(first: Callable[[], None], second: Callable[[], None], device: Any, target_s: float) -> float:
    """Median of (time of ``second`` − time of ``first``), called alternately so that the machine's drift
    (other load) falls on both alike; every rank makes the same number of calls."""
    import torch
    import torch.distributed as dist

    from meshfit.calibrate import MIN_REPS, _sync

    def once(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    pair = torch.tensor([once(first) + once(second)], dtype=torch.float64, device=device)
    dist.all_reduce(pair, op=dist.ReduceOp.MAX)
    reps = max(MIN_REPS, min(200, int(target_s / max(float(pair), 1e-6))))
    return statistics.median(-once(first) + once(second) for _ in range(reps))


def fsdp_call_s(device: Any, dtype_names: list[str], model: ModelConfig, seq: int, tokens: int, target_s: float,
                links: dict[str, dict[str, float]], say: Callable[[str], None]) -> dict[str, float]:
    """{dtype: seconds per FSDP unit and collective call} on all ranks; ``links``: the measured collectives
    over the world ({op: {"bus_bytes_per_s", "latency_s"}})."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshfit.models.config import num_params
    from meshfit.planner.timing import ring_terms

    world = dist.get_world_size()
    cfg = model_for_rates(model, seq)
    batch = max(1, tokens // seq)
    backend = {"dp_shard": "nccl"} if device.type == "cuda" else None
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",), backend_override=backend)
    units = cfg.n_layers + 1  # each block and the root (embeddings, final norm, head)

    def ring(op: str, nbytes: float) -> float:  # `units` calls of op moving nbytes in all
        moved, hops = ring_terms(op, world)
        return moved * nbytes / links[op]["bus_bytes_per_s"] + units * hops * links[op]["latency_s"]

    out: dict[str, float] = {}
    for name in dtype_names:
        dist.barrier()
        plain, sharded = (_step(cfg, seq, batch, m, name, device) for m in (None, mesh))
        extra = _paired_extra(plain, sharded, device, target_s)
        gathered, reduced = (num_params(cfg) * b for b in _BYTES[name])
        comm = 2 * ring("all_gather", gathered) + ring("reduce_scatter", reduced)
        out[name] = max(0.0, extra - comm) / (3 * units)
        say(f"FSDP {name}: {out[name] * 1e3:.1f} ms per unit and collective beyond the collective "
            f"(sharded step {extra * 1e3:.0f} ms longer than unsharded, collectives {comm * 1e3:.0f} ms)")
    return out
