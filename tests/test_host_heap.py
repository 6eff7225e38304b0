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
    default, keep = _faults("default"), _faults("keep")
    # glibc's defaults map the first block, free it, then extend the heap for the second: it faults again.
    # Kept: the heap block freed in round 1 serves every later round. (Relative, so that huge pages, which
    # fault once per 2 MiB, pass as well.)
    assert default[1] > 0 and max(keep[1:]) * 10 <= default[1], (default, keep)


# 128 MiB in 64 KiB blocks (heap-sized under any threshold), freed: what free() keeps and the trim returns.
# glibc's own trim at free() is held off (M_TRIM_THRESHOLD 1 GiB) so that the pages are surely stranded.
_STRANDED = """
import ctypes
from meshfit.memory import host_heap
host_heap._libc().mallopt(-1, 1 << 30)
def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))
blocks = [bytearray(64 * 1024) for _ in range(2048)]
for block in blocks:
    block[::4096] = b"\\x01" * len(block[::4096])
held = rss()
del blocks
stranded = rss()
host_heap.return_free_heap()
print(held, stranded, rss())
"""


def test_return_free_heap_gives_stranded_heap_pages_back():
    out = subprocess.run([sys.executable, "-c", _STRANDED], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    held, stranded, after = (int(v) for v in out.stdout.split())
    assert held - stranded < 32, (held, stranded)  # free() alone keeps the pages
    assert stranded - after > 96, (stranded, after)


def test_a_cpu_training_rank_keeps_freed_blocks(tmp_path, monkeypatch):
    from meshfit.config import load_config
    from meshfit.train.worker import run_worker

    calls = []
    monkeypatch.setattr(host_heap, "keep_freed_blocks", lambda: calls.append(1) or True)
    cfg = load_config(None, ["model.preset=tiny", "train.steps=1", "train.device=cpu", "train.global_batch=2",
                             "train.seq_len=16", "checkpoint.at_end=false"])
    assert run_worker(tmp_path, cfg, quiet=True) == 0
    assert calls == [1]
