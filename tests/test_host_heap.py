"""glibc heap settings for CPU ranks: freed blocks stay for the next step; stranded pages go back on request."""

import subprocess
import sys

import pytest

from meshfit.memory import host_heap

pytestmark = pytest.mark.skipif(host_heap._libc() is None, reason="needs glibc's mallopt and malloc_trim")

# A 20 MiB block allocated, touched and freed four times in a fresh process: minor page faults per round.
_ROUNDS = """
import resource, sys
from meshfit.memory import host_heap
if sys.argv[1] == "keep":
    assert host_heap.keep_freed_blocks()
faults = []
for _ in range(4):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = bytearray(20 << 20)
    block[::4096] = b"\\x01" * len(block[::4096])
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
print(*faults)
"""


def _faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [int(v) for v in out.stdout.split()]


def test_keep_freed_blocks_reuses_them_from_the_second_round():
    pages = (20 << 20) // 4096
    default, keep = _faults("default"), _faults("keep")
    # glibc's defaults map the first block, free it, then extend the heap for the second: faults twice.
    assert default[1] > pages // 2, default
    # Kept: the heap block freed in round 1 serves every later round without a fault.
    assert keep[0] > pages // 2 and max(keep[1:]) < pages // 20, keep


def _rss_mib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))


def test_return_free_heap_gives_stranded_heap_pages_back():
    blocks = [bytearray(64 * 1024) for _ in range(2048)]  # 128 MiB in heap-sized blocks (under mmap's threshold)
    for block in blocks:
        block[::4096] = b"\x01" * len(block[::4096])  # touch every page
    pin = bytearray(1024)  # allocated after them: the heap top cannot shrink past it
    held = _rss_mib()
    del blocks
    stranded = _rss_mib()
    host_heap.return_free_heap()
    after = _rss_mib()
    assert held - stranded < 32, (held, stranded)  # free() alone keeps the pages
    assert stranded - after > 96, (stranded, after)
    del pin
