"""`meshfit calibrate`: measure this machine's rates for the planner's time model (hardware/profile.py).

Every rank measures at once (on a CPU the ranks share the cores, as training's ranks do, with the same
intra-op threads the launcher gives them): matmuls at a transformer block's shapes (forward and both
backward products) per dtype, fused causal attention forward + backward, the fused AdamW step's memory
traffic, the collectives meshfit uses per group size (large messages for bus bandwidth, small ones for
latency) and how much of an all-reduce a concurrent matmul hides (calibrate_collectives.py), and on CUDA
pinned host↔device copies. Each measurement is timed as calibrate_timing.py says.
With a model also its own training rate, split from a cost per dispatched operator, on several ranks that
of its blocks laid out tensor-parallel (calibrate_tp.py) and the collectives at the message sizes its
layouts send (calibrate_sizes.py), and the kernels one compiled block launches (calibrate_compile.py). The
slowest rank's compute rates are kept (it sets the step's pace).
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshfit.calibrate.collectives import collectives, group_sizes, overlap
from meshfit.calibrate.message_sizes import layout_messages
from meshfit.calibrate.tensor_parallel import SHORT_SEQ, model_for_rates, slowest_tp, split_fixed, tp_rates
from meshfit.calibrate.timing import TARGET_S, timed, timed_together
from meshfit.hardware.profile import HardwareProfile, Rates
from meshfit.util.units import fmt_bytes

if TYPE_CHECKING:
    from meshfit.models.config import ModelConfig

DTYPES = tuple(Rates.model_fields)


def _matmul_rate(device: Any, dtype: Any, dim: int, tokens: int, target_s: float) -> float:
    """FLOP/s over a block's products: x·W, its input gradient and its weight gradient, for W of h×3h
    (attention projections) and h×4h (MLP)."""
    import torch

    flops, seconds = 0.0, 0.0
    for width in (3 * dim, 4 * dim):
        x = torch.randn(tokens, dim, device=device, dtype=dtype)
        w = torch.randn(dim, width, device=device, dtype=dtype)
        g = torch.randn(tokens, width, device=device, dtype=dtype)
        for fn in (lambda: x @ w, lambda: g @ w.T, lambda: x.T @ g):
            seconds += timed(fn, device, target_s / 6)
            flops += 2.0 * tokens * dim * width
    return flops / seconds


def _attention_rate(device: Any, dtype: Any, dim: int, seq: int, target_s: float) -> float:
    """FLOP/s of fused causal attention forward + backward, counted as the planner counts it: 12·s·h per
    token (the scores and the weighted sum over every key position, forward and backward)."""
    import torch
    import torch.nn.functional as F

    heads, batch = max(1, dim // 64), 2
    q, k, v = (torch.randn(batch, heads, seq, dim // heads, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    return 12.0 * seq * dim * batch * seq / timed(step, device, target_s)


def _model_rate(device: Any, dtype: Any, model: Any, seq: int, tokens: int, target_s: float
                ) -> tuple[float, float]:
    """(training FLOP/s by flops_per_token's count, seconds per dispatched operator) of meshfit's own model
    code, forward + loss + backward, on at most two of ``model``'s blocks: what matmuls alone do not show
    (norms, activations, rotary embeddings, the loss) at this model's shapes.

    Timed twice (calibrate_tp.split_fixed): one sequence of SHORT_SEQ tokens, whose time is mostly the
    fixed cost that eager execution pays per operator whatever the sizes (planner/timing/op_count.py), and
    ``tokens`` tokens; the fixed part over the operators one step dispatches (counted on it) is the cost
    per operator, and the rate is what the FLOPs add."""
    import torch
    import torch.nn.functional as F

    from meshfit.models import build_model, flops_per_token
    from meshfit.planner.timing.op_count import count_ops

    cfg = model_for_rates(model, seq)
    net = build_model(cfg, device).to(dtype)

    def step(batch: int, length: int) -> Callable[[], None]:
        x = torch.randint(0, cfg.vocab_size, (batch, length), device=device)

        def run() -> None:
            logits = net(x)
            F.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
        return run

    points = [(1, SHORT_SEQ), (max(1, tokens // seq), seq)]
    rate, fixed = split_fixed(*((timed(step(b, s), device, target_s / 2), flops_per_token(cfg, s) * b * s)
                                for b, s in points))
    return rate, fixed / count_ops(step(1, SHORT_SEQ))[0]


def _model_pass(out: dict[str, Any], device: Any, dtype: Any, name: str, model: Any, seq: int, tokens: int,
                target_s: float, say: Callable[[str], None]) -> None:
    """Measure the model's rate and cost per operator into ``out``, averaged (in time per FLOP) with an
    earlier pass's: two samples seconds apart follow a shared host's load as training's many steps do. One
    short pass read 18 GFLOP/s during a burst of other work (34–45 in the rounds around it); keeping the
    faster of two passes instead read 70 and predicted all of 14 held-out layouts 14–62% fast
    (benchmarks/planner/step_time_holdout.py)."""
    import torch.distributed as dist

    dist.barrier()
    rate, op_s = _model_rate(device, dtype, model, seq, tokens, target_s)
    say(f"model {name} (seq {seq}): {rate / 1e9:.1f} GFLOP/s per rank and {op_s * 1e6:.1f} µs per operator, "
        "training")
    earlier = out.setdefault("model_flops", {}).get(name)
    if earlier is not None:
        rate, op_s = 2.0 / (1.0 / rate + 1.0 / earlier), (op_s + out["op_s"][name]) / 2.0
    out["model_flops"][name] = rate
    out.setdefault("op_s", {})[name] = op_s


def _optimizer_rate(device: Any, numel: int, target_s: float) -> float:
    """Bytes/s of the fused AdamW step, counted as the planner counts it: weights, gradients and both
    moments read and written (32 bytes per fp32 parameter)."""
    import torch

    from meshfit.layout.precision import OPTIMIZER_STATES, STORAGE_BYTES

    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn(numel, device=device)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    traffic = 2 * STORAGE_BYTES["fp32"] * (2 + OPTIMIZER_STATES["adamw"])  # as timing.py's step_bytes
    return traffic * numel / timed(opt.step, device, target_s)


def measure_rank(threads: int, dim: int, quick: bool, model: ModelConfig | None = None, seq: int = 0,
                 device_type: str = "cpu") -> dict[str, Any]:
    """One rank's measurements (the gloo process group is up; on CUDA the collectives run over NCCL
    groups); rank 0 prints progress."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    target = TARGET_S["quick" if quick else "full"]
    start = time.perf_counter()

    def say(text: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - start:5.1f}s] {text}", file=sys.stderr, flush=True)

    tokens = 4 * dim if device.type == "cpu" else 2 * dim
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    out: dict[str, Any] = {"matmul_flops": {}, "attention_flops": {}}
    for name in DTYPES:
        dist.barrier()
        out["matmul_flops"][name] = _matmul_rate(device, dtypes[name], dim, tokens, 3 * target)
        say(f"matmul {name} at dim {dim}: {out['matmul_flops'][name] / 1e9:.1f} GFLOP/s per rank")
        dist.barrier()
        out["attention_flops"][name] = _attention_rate(device, dtypes[name], dim, min(tokens, 1024), 2 * target)
        say(f"attention {name}: {out['attention_flops'][name] / 1e9:.1f} GFLOP/s per rank")
        if model is not None:
            _model_pass(out, device, dtypes[name], name, model, seq, tokens, 3 * target, say)
    if model is not None and world > 1:
        # Two batch sizes per point and a difference of their times: longer, for a steadier fit.
        out["tp_flops"] = tp_rates(device, dtypes, model, seq, tokens, 5 * target, timed_together,
                                   group_sizes(world), say)
    dist.barrier()
    numel = (1 << 22) if device.type == "cpu" else (1 << 26)
    out["elementwise_bytes_per_s"] = _optimizer_rate(device, numel, 2 * target)
    say(f"fused AdamW step: {out['elementwise_bytes_per_s'] / 1e9:.1f} GB/s per rank")
    big, small = ((8 << 20), 4096) if device.type == "cpu" else ((256 << 20), 8192)
    if quick:
        big //= 4
    messages = layout_messages(model, seq) if model is not None and world > 1 else None
    out["collectives"], out["collective_times"] = collectives(device, big, small, target, say, messages) \
        if world > 1 else ({}, {})
    if world > 1:
        everyone = dist.new_group(list(range(world)), backend="nccl") if cuda else None
        out["overlap"] = overlap(device, dim, tokens, big, 2 * target, everyone)
        say(f"all-reduce hidden behind a concurrent matmul: {out['overlap']:.0%}")
    if model is not None:  # a second pass, seconds later, averaged with the first (see _model_pass)
        for name in DTYPES:
            _model_pass(out, device, dtypes[name], name, model, seq, tokens, 3 * target, say)
    if cuda:
        host = torch.empty(1 << 26, dtype=torch.uint8, pin_memory=True)
        dev_buf = torch.empty_like(host, device=device)
        out["host_device_bytes_per_s"] = host.numel() / timed(lambda: dev_buf.copy_(host, non_blocking=True),
                                                               device, target)
        say(f"host → device: {fmt_bytes(out['host_device_bytes_per_s'])}/s")
        out["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    out["device_name"] = torch.cuda.get_device_name(device) if cuda else _cpu_name()
    out["seconds"] = time.perf_counter() - start
    return out


def _cpu_name() -> str:
    import platform

    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


class CalibrationError(RuntimeError):
    """The measurement could not run (bad --nproc for the devices, a rank failed); the message says why."""


def calibrate(nproc: int, dim: int | None = None, quick: bool = False, model: ModelConfig | None = None,
              seq: int = 0, device: str = "auto") -> HardwareProfile:
    """Measure on ``nproc`` local ranks: ``device`` "cpu" (gloo), "cuda" (one GPU per rank, NCCL) or "auto"
    (cuda when present); with ``model`` and ``seq`` also the model's own training rate."""
    import torch

    from meshfit.train.dist import wants_cuda
    from meshfit.train.launch import rank_threads
    from meshfit.util.ranks import RankFailed, run_ranks

    cuda = wants_cuda(device)
    if cuda and nproc > torch.cuda.device_count():
        raise CalibrationError(f"--nproc {nproc} needs one GPU per rank; this machine has "
                               f"{torch.cuda.device_count()} visible to torch")
    dim = dim or (model.dim if model is not None else (4096 if cuda else 512))
    threads = rank_threads(nproc)
    try:
        ranks = run_ranks(measure_rank, nproc, threads, dim, quick, model, seq, "cuda" if cuda else "cpu",
                          timeout_s=600.0)
    except (RankFailed, TimeoutError) as exc:
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise CalibrationError(f"the measurement failed on a rank: {last}") from None
    first = ranks[0]
    launches = {}
    if model is not None:  # after the ranks: the compiler would take their cores
        from meshfit.calibrate.compiled_launches import compiled_launches

        launches = compiled_launches(model, "cuda" if cuda else "cpu", quick)
    keys = ("matmul_flops", "attention_flops") + (("model_flops",) if model is not None else ())
    slowest = {key: {d: min(r[key][d] for r in ranks) for d in DTYPES} for key in keys}
    op_s = {d: max(r["op_s"][d] for r in ranks) for d in DTYPES} if model is not None else None
    return HardwareProfile(
        device="cuda" if cuda else "cpu", device_name=first["device_name"], backend="nccl" if cuda else "gloo",
        ranks=nproc, threads_per_rank=threads, memory_bytes=first.get("memory_bytes"),
        matmul_flops=slowest["matmul_flops"], attention_flops=slowest["attention_flops"],
        model_flops=slowest.get("model_flops"), op_s=op_s, seq=seq if model is not None else 0,
        tp_flops=slowest_tp(ranks),
        elementwise_bytes_per_s=min(r["elementwise_bytes_per_s"] for r in ranks),
        collectives=first["collectives"], collective_times=first["collective_times"],
        compiled_launches=launches, overlap=first.get("overlap", 0.0),
        host_device_bytes_per_s=first.get("host_device_bytes_per_s"), torch=torch.__version__,
        created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        seconds=max(r["seconds"] for r in ranks), dim=dim)
