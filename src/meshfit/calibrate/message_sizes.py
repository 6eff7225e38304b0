"""`meshfit calibrate --model`: collectives timed at the message sizes the model's layouts send.

The bandwidth/latency line (calibrate_collectives.py `_link`) goes through two sizes, 8 MiB and 4 KiB on
CPU ranks, and a layout's messages lie between them or beyond: a tensor-parallel block's activations, a pipeline stage's
boundary activation, one FSDP unit's parameters. Each collective is also timed at those sizes and kept as
measured points ({group size: {op: {bytes: seconds}}}); the time model interpolates between them
(planner/timing/comms.py `collective_s`) and keeps the line beyond them.

The messages, per micro-batch of 1 and of MICRO_BATCHES[-1] sequences of ``seq`` tokens:

* tensor parallelism: tokens × dim activations all-reduced (plain) or gathered and reduce-scattered
  (sequence parallelism), in fp32 and bf16;
* pipeline parallelism: the same activation sent to the next stage (send/recv);
* ZeRO/FSDP: the largest unit of one block (parallel/fsdp_units.py, the trainer's split) gathered in the compute
  dtype (bf16 or fp32) and reduce-scattered (HSDP: all-reduced) in the reduce dtype (fp32 or bf16).

Only eager process-group calls are timed: a compiled block's functional collectives (traced into the graph:
context parallelism's key/value gathers, DTensor's under tensor parallelism) end in the same process-group
operations. They are not free of their own cost, though: a torch.compile'd functional all-gather on 2 gloo
ranks took 0.52–0.58 ms at 64 KiB against 0.28–0.29 ms for the process-group call (it allocates its output
and runs through the compiled graph), 0.58–1.02 against 0.53–0.55 ms at 1 MiB and 3.5–6.7 against 2.5–6.3
ms at 4 MiB (two runs each, a busy host); the time model does not add that difference. Buffers are fp32
whatever dtype a message is counted in (the bytes are what the time model asks about; gloo's and NCCL's
bf16 paths may differ somewhat in reduction speed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshfit.planner.timing.comms import ring_terms
from meshfit.util.units import fmt_bytes

if TYPE_CHECKING:
    from meshfit.models.config import ModelConfig

MICRO_BATCHES = (1, 8)  # sequences per micro-batch whose activations are timed
VALUE_BYTES = (4, 2)  # fp32, bf16


def layout_messages(model: ModelConfig, seq: int) -> dict[str, list[int]]:
    """{op: message bytes (sorted)} that ``model``'s layouts send at sequence length ``seq``."""
    from meshfit.layout.data_parallel_kind import DEFAULT_MAX_UNIT_PARAMS
    from meshfit.models import build_model
    from meshfit.parallel.fsdp_units import unit_sizes

    activations = {b * seq * model.dim * v for b in MICRO_BATCHES for v in VALUE_BYTES}
    block = build_model(dataclasses.replace(model, n_layers=1), "meta").layers["0"]  # no memory on meta
    unit = max(unit_sizes(block, DEFAULT_MAX_UNIT_PARAMS))
    params = {unit * v for v in VALUE_BYTES}
    both = sorted(activations | params)
    return {"all_reduce": both, "all_gather": both, "reduce_scatter": both, "send_recv": sorted(activations)}


def at_sizes(collective: Callable[..., float], op: str, group: Any, rank: int, size: int, line: dict[str, float],
             messages: dict[str, list[int]] | None, device: Any, target_s: float, say: Callable[[str], None]
             ) -> dict[int, float]:
    """{bytes: seconds per call} of ``op`` over ``group`` at the layouts' message sizes (none without
    ``messages``), a quarter of ``target_s`` each: a few seconds in all on CPU ranks. ``collective`` is
    calibrate's timer for one size (every rank of the group makes the same calls); ``line`` the op's
    bandwidth/latency line, printed beside each time."""
    if not messages:
        return {}
    times = {nbytes: collective(op, group, rank, size, nbytes, device, target_s / 4) for nbytes in messages[op]}
    moved, hops = ring_terms(op, size)
    bus, latency = line["bus_bytes_per_s"], line["latency_s"]
    say("  at the layouts' message sizes, ms (the line's in brackets): " + ", ".join(
        f"{fmt_bytes(b)} {t * 1e3:.2f} ({(moved * b / bus + hops * latency) * 1e3:.2f})"
        for b, t in sorted(times.items())))
    return times
