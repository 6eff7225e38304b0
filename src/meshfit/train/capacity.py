"""How many local ranks this machine can hold: one check, made before any rank starts, for `meshfit
train --nproc`, `meshfit calibrate --nproc` and `meshfit demo` alike.

Every local rank is a process that imports torch and shares the cores with the others, and all of them
start at once. Beyond RANKS_PER_CORE ranks per core, or beyond the memory their bare processes need, a
launch only thrashes or is killed by the kernel's out-of-memory killer part way through its start;
`--oversubscribe` starts them anyway. Reads only the standard library (no torch import before the check).
"""

from __future__ import annotations

import os
from pathlib import Path

from meshfit.config import ConfigError
from meshfit.util.units import fmt_bytes

# The demo's 3-D layout runs 8 ranks on a 2-core machine; more per core leaves each rank's thread under a
# quarter of a core, with gloo's collectives waiting on peers that are not scheduled.
RANKS_PER_CORE = 4
# The memory a rank needs of its own before any model: measured 80-190 MiB (private, dirty) for
# calibrate's ranks, forked from a server that imported torch, and 240 MiB for a training rank of the
# tiny model started as a fresh interpreter.
RANK_MIN_BYTES = 100 * 2**20


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota when there is one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, quota)) if quota else cores


def _cgroup_cpu_quota() -> int | None:
    def read(path: str) -> list[str]:
        try:
            return Path(path).read_text().split()
        except OSError:
            return []

    v2 = read("/sys/fs/cgroup/cpu.max")  # "max 100000" or "200000 100000"
    if len(v2) == 2 and v2[0] != "max":
        return -(-int(v2[0]) // int(v2[1]))
    quota, period = read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if quota and period and int(quota[0]) > 0:
        return -(-int(quota[0]) // int(period[0]))
    return None


def available_memory() -> int | None:
    """Bytes new processes can still take: the kernel's MemAvailable, or less under a cgroup memory limit
    (its limit minus what the group holds, page cache it can reclaim not counted). None when unknown."""
    sizes = [_meminfo_available(), _cgroup_headroom()]
    known = [s for s in sizes if s is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom() -> int | None:
    for limit_file, usage_file, stat_file, cache_key in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),  # cgroup v2
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):  # cgroup v1
        try:
            limit = Path("/sys/fs/cgroup", limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 2**60:  # no limit
                continue
            usage = int(Path("/sys/fs/cgroup", usage_file).read_text())
            stat = dict(line.split() for line in Path("/sys/fs/cgroup", stat_file).read_text().splitlines())
            return max(0, int(limit) - usage + int(stat.get(cache_key, 0)))
        except (OSError, ValueError):
            continue
    return None


def rank_limit() -> tuple[int, str]:
    """The most local ranks this machine holds, and why (its cores, or its memory when that is less)."""
    cores = usable_cores()
    limit, why = cores * RANKS_PER_CORE, f"{cores} core{'s' if cores > 1 else ''} × {RANKS_PER_CORE} ranks per core"
    memory = available_memory()
    if memory is not None and memory // RANK_MIN_BYTES < limit:
        limit = max(1, memory // RANK_MIN_BYTES)
        why = f"{fmt_bytes(memory)} of available memory, at least {fmt_bytes(RANK_MIN_BYTES)} per rank"
    return limit, why


def check_local_ranks(nproc: int, oversubscribe: bool, what: str = "") -> None:
    """Refuse to start `nproc` local ranks at once when the machine cannot hold them (ConfigError, one
    line), unless `oversubscribe`. `what` says who asks for them (default: "--nproc N")."""
    if oversubscribe:
        return
    limit, why = rank_limit()
    if nproc > limit:
        raise ConfigError(f"{what or f'--nproc {nproc}'}: this machine holds at most {limit} local ranks at once "
                          f"({why}); use {limit} or fewer, or add --oversubscribe to start them anyway")
