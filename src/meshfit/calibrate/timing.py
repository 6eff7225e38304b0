"""How `meshfit calibrate` times one measurement: repeat a call until enough time has passed (after a warm-up),
on every rank of a group together, synchronising the device where it runs asynchronously."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

# Per measurement: repeat until this many seconds have passed (at least MIN_REPS calls, after one warm-up).
TARGET_S = {"full": 0.4, "quick": 0.12}
MIN_REPS = 3


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: Any, target_s: float) -> float:
    """Median seconds per call of ``fn``."""
    fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < MIN_REPS or time.perf_counter() - start < target_s:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_together(fn: Callable[[], Any], device: Any, target_s: float, group: Any = None) -> float:
    """``timed`` for collectives: every rank of ``group`` must make the same number of calls, so the count
    follows from the slowest rank's first call."""
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
    reps = max(MIN_REPS, min(200, int(target_s / max(float(first), 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
