"""`meshfit calibrate`'s collectives: bus bandwidth and per-hop latency per op and group size, the same ops
at the message sizes a model's layouts send (calibrate_sizes.py), and how much of an all-reduce a
concurrent matmul hides. Each rank runs these together with its peers (calibrate.py ``measure_rank``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from meshfit.calibrate.message_sizes import at_sizes
from meshfit.calibrate.timing import timed, timed_together
from meshfit.hardware.profile import GroupLinks
from meshfit.planner.timing.comms import ring_terms

COLLECTIVES = tuple(GroupLinks.model_fields)  # the profile's fields name what is measured


def _collective(op: str, group: Any, rank: int, size: int, nbytes: int, device: Any, target_s: float) -> float:
    """Seconds per call of ``op`` over ``group`` for a buffer of ``nbytes`` (the whole gathered / reduced
    buffer; send/recv: one message each way, halved)."""
    import torch
    import torch.distributed as dist

    n = max(size, nbytes // 4 // size * size)
    full = torch.ones(n, device=device)
    part = torch.ones(n // size, device=device)
    if op == "all_reduce":
        fn = lambda: dist.all_reduce(full, group=group)  # noqa: E731
    elif op == "all_gather":
        # The calls FSDP2 makes (torch 2.13 names them deprecated; their replacements are newer than 2.11).
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor` is deprecated")
        fn = lambda: dist.all_gather_into_tensor(full, part, group=group)  # noqa: E731
    elif op == "reduce_scatter" and dist.get_backend(group) == "gloo":
        from meshfit.parallel.host_reduce import reduce_scatter  # what FSDP2 runs on CPU ranks

        fn = lambda: reduce_scatter(part, full, group, dist.ReduceOp.AVG)  # noqa: E731
    elif op == "reduce_scatter":
        warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor` is deprecated")
        fn = lambda: dist.reduce_scatter_tensor(part, full, group=group)  # noqa: E731
    else:
        peer = 1 - rank

        def fn() -> None:  # ping-pong between the group's first two ranks
            if rank == 0:
                dist.send(full, peer, group=group)
                dist.recv(full, peer, group=group)
            else:
                dist.recv(full, peer, group=group)
                dist.send(full, peer, group=group)
    dist.barrier(group=group)
    seconds = timed_together(fn, device, target_s, group)
    return seconds / 2 if op == "send_recv" else seconds


def group_sizes(world: int) -> list[int]:
    """Group sizes to measure: powers of two up to the world, and the world."""
    sizes = {world} if world > 1 else set()
    n = 2
    while n < world:
        sizes.add(n)
        n *= 2
    return sorted(sizes)


def collectives(device: Any, big: int, small: int, target_s: float, say: Callable[[str], None],
                 messages: dict[str, list[int]] | None = None
                 ) -> tuple[dict[int, dict[str, dict[str, float]]], dict[int, dict[str, dict[int, float]]]]:
    """({group size: {op: line}}, {group size: {op: {bytes: seconds}}} at ``messages``' sizes, when given)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    backend = "nccl" if device.type == "cuda" else None
    pair = dist.new_group([0, 1], backend=backend)  # every rank takes part in new_group
    # Point to point is between two ranks whatever the group size: measured once.
    send_recv = _link("send_recv", pair, rank, 2, big, small, device, target_s) if rank < 2 else {}
    say(f"send/recv between 2 ranks: {_describe(send_recv)}")
    sent = at_sizes(_collective, "send_recv", pair, rank, 2, send_recv, messages, device, target_s, say) \
        if rank < 2 else {}
    out: dict[int, dict[str, dict[str, float]]] = {}
    times: dict[int, dict[str, dict[int, float]]] = {}
    for size in group_sizes(world):
        group = dist.new_group(list(range(size)), backend=backend)
        results = {"send_recv": send_recv}
        times[size] = {"send_recv": sent} if sent else {}
        for op in COLLECTIVES:
            if op == "send_recv" or rank >= size:
                continue
            results[op] = _link(op, group, rank, size, big, small, device, target_s)
            say(f"{op} over {size} ranks: {_describe(results[op])}")
            if messages:
                times[size][op] = at_sizes(_collective, op, group, rank, size, results[op], messages, device,
                                           target_s, say)
        dist.barrier()
        out[size] = results
    return out, {n: t for n, t in times.items() if t}


def _link(op: str, group: Any, rank: int, n: int, big: int, small: int, device: Any, target_s: float
          ) -> dict[str, float]:
    """Bus bandwidth from a large message, per-hop latency from a small one."""
    t_big = _collective(op, group, rank, n, big, device, target_s)
    t_small = _collective(op, group, rank, n, small, device, target_s)
    moved, hops = ring_terms(op, n)  # the time model's ring, read backwards
    bus = moved * big / t_big
    latency = max(0.0, t_small - moved * small / bus) / hops
    return {"bus_bytes_per_s": bus, "latency_s": latency}


def _describe(link: dict[str, float]) -> str:
    return f"{link['bus_bytes_per_s'] / 1e9:.2f} GB/s bus, {link['latency_s'] * 1e6:.0f} µs per hop" if link else ""


def overlap(device: Any, dim: int, tokens: int, nbytes: int, target_s: float, group: Any) -> float:
    """Share of a matmul loop's time that hides a concurrent all-reduce: (t_comm + t_compute − t_both) /
    t_compute, with the all-reduce sized to last about as long as the compute."""
    import torch
    import torch.distributed as dist

    x = torch.randn(tokens, dim, device=device)
    w = torch.randn(dim, 4 * dim, device=device)
    buf = torch.ones(max(1, nbytes // 4), device=device)
    compute = lambda: [x @ w for _ in range(4)]  # noqa: E731
    t_c = timed(compute, device, target_s)
    t_a = timed_together(lambda: dist.all_reduce(buf, group=group), device, target_s, group)

    def both() -> None:
        work = dist.all_reduce(buf, group=group, async_op=True)
        compute()
        work.wait()

    t_b = timed_together(both, device, target_s, group)
    return min(1.0, max(0.0, (t_a + t_c - t_b) / t_c))
