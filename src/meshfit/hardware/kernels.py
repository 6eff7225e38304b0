"""Published kernel measurements per catalog GPU: the rates a plan on datasheet figures runs matmuls and the
fused attention kernel at (planner/timing/kernels.py turns them into seconds per kernel shape).

Plain data. Every figure names its source; a part without a published measurement says what is assumed
instead (``assumed``, which `meshfit plan --explain` prints with the plan's time basis).

* Matmul: the maximum achievable matmul FLOP/s (MAMF) over the dense bf16 peak, from the "Maximum Achievable
  Matmul FLOPS comparison table" of Bekman's ml-engineering (compute/accelerator/README.md; `mamf-finder.py`,
  bf16, the mean of 100 iterations after 50 warm-up ones for each shape of a search, caches reset between
  iterations): A100 SXM 271.2 of 312 TFLOP/s (86.9%), H100 SXM 794.5 of 989 (80.3%), MI300X 668.4 of 1300
  (51.4%). The same table's GH200 (an H100 die at 900 W) reaches 83.6% and the A100 PCIe 81.1%.
* Fused attention: torch's flash kernel is FlashAttention-2. Its forward + backward rate with a causal mask
  at head dimensions 64 and 128 and sequences of 512 to 16k tokens, on an A100 80GB SXM4 and an H100 80GB
  SXM5 (flash-attention repository, assets/flash2_a100_fwd_bwd_benchmark.png and
  flash2_h100_fwd_bwd_benchmark.png, the FlashAttention-2 paper's figures; batch × sequence = 16k tokens,
  2048-wide). Counted as that benchmark counts: 4·s²·d FLOPs per head and sequence forward, halved under
  the causal mask, and 3.5 times that forward + backward (the backward re-computes the scores).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

# Sequence lengths of the FlashAttention-2 benchmark (the rates below are at these lengths).
FLASH_SEQS = (512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class FlashRates:
    """FlashAttention-2 forward + backward TFLOP/s with a causal mask by head dimension (at FLASH_SEQS),
    measured on a part whose dense bf16 peak was ``peak_tflops``."""

    peak_tflops: float
    by_head_dim: dict[int, tuple[float, ...]]


# flash2_a100_fwd_bwd_benchmark.png, panels (c) and (d): "With causal mask", head dimension 64 and 128.
_A100_FLASH = FlashRates(312.0, {64: (88, 119, 140, 156, 165, 171), 128: (99, 133, 155, 173, 182, 189)})
# flash2_h100_fwd_bwd_benchmark.png, panels (c) and (d). The catalog's H100 SXM peak (989.4 TFLOP/s).
_H100_FLASH = FlashRates(989.4, {64: (141, 192, 232, 257, 273, 284), 128: (163, 221, 265, 294, 308, 328)})


@dataclass(frozen=True)
class KernelRates:
    """What a part's matmuls and attention kernel reach, and which of the two is assumed rather than
    measured on that part."""

    matmul_fraction: float  # MAMF / dense peak
    flash: FlashRates  # the FlashAttention-2 measurement its attention rate is read from
    flash_scale: float = 1.0  # the measured fractions × this (1 when measured on the part itself)
    assumed: tuple[str, ...] = ()


# NVIDIA parts without a MAMF entry: the lowest NVIDIA fraction of the table (H100 SXM, 80.3%), rounded.
_NVIDIA_MATMUL_ASSUMED = 0.80
_A100_MAMF, _H100_MAMF = 0.869, 0.803


def _like_a100(matmul: float, assumed: tuple[str, ...]) -> KernelRates:
    # No published FlashAttention-2 rate on the part: the A100's fraction of the peak, scaled by how the
    # part's matmuls compare with the A100's (the kernel runs on the same tensor cores).
    words = ("the attention kernel at the A100's fraction of the peak (FlashAttention-2 on an A100), scaled by "
             "the part's matmul fraction")
    return KernelRates(matmul, _A100_FLASH, matmul / _A100_MAMF, (*assumed, words))


_NO_MAMF = (("matmuls at 80% of the peak (no published maximum achievable matmul rate for the part; NVIDIA's "
             "measured parts reach 80.3-86.9%)"),)
_RATES: dict[str, KernelRates] = {
    # The A100 40GB SXM has the 80GB's SMs and clocks; its slower HBM only enters the memory-bound terms.
    "A100-40GB": KernelRates(_A100_MAMF, _A100_FLASH),
    "A100-80GB": KernelRates(_A100_MAMF, _A100_FLASH),
    "H100-SXM": KernelRates(_H100_MAMF, _H100_FLASH),
    # The H200 is the H100 SXM's die at the same 700 W with faster HBM: the H100's compute rates assumed.
    "H200": KernelRates(_H100_MAMF, _H100_FLASH,
                        assumed=("the H100 SXM's matmul and attention rates (same die and power)",)),
    # The PCIe card: fewer SMs, lower clocks and power; the H100 SXM's attention fraction assumed.
    "H100-PCIe": KernelRates(_NVIDIA_MATMUL_ASSUMED, _H100_FLASH, _NVIDIA_MATMUL_ASSUMED / _H100_MAMF,
                             _NO_MAMF + ("the attention kernel at the H100 SXM's fraction of the peak",)),
    "B200": _like_a100(_NVIDIA_MATMUL_ASSUMED, _NO_MAMF),
    "MI300X": _like_a100(0.514, ()),
    "L40S": _like_a100(_NVIDIA_MATMUL_ASSUMED, _NO_MAMF),
    "RTX-4090": _like_a100(_NVIDIA_MATMUL_ASSUMED, _NO_MAMF),
}
# A device outside the catalog (a renamed or calibrated one): the NVIDIA default and the A100's attention.
_UNKNOWN = _like_a100(_NVIDIA_MATMUL_ASSUMED, _NO_MAMF)


def kernel_rates(gpu_name: str) -> KernelRates:
    """The published (or assumed) kernel rates of the catalog part ``gpu_name``."""
    return _RATES.get(gpu_name, _UNKNOWN)


def flash_fraction(gpu_name: str, head_dim: int, seq: int) -> float:
    """FlashAttention-2's causal forward + backward rate as a fraction of the part's dense bf16 peak (counted
    as its benchmark counts), linear in log2(sequence) between the measured lengths and in the head dimension
    between 64 and 128; outside them the nearest measured one (head dimensions above 128 were not measured)."""
    rates = kernel_rates(gpu_name)
    table = rates.flash.by_head_dim
    lo, hi = min(table), max(table)
    d = min(max(head_dim, lo), hi)
    at_lo, at_hi = _along_seq(table[lo], seq), _along_seq(table[hi], seq)
    tflops = at_lo + (at_hi - at_lo) * (d - lo) / (hi - lo)
    return tflops / rates.flash.peak_tflops * rates.flash_scale


def _along_seq(values: tuple[float, ...], seq: int) -> float:
    x = math.log2(min(max(seq, FLASH_SEQS[0]), FLASH_SEQS[-1]))
    logs = [math.log2(s) for s in FLASH_SEQS]
    i = min(max(bisect.bisect_right(logs, x) - 1, 0), len(logs) - 2)
    return values[i] + (values[i + 1] - values[i]) * (x - logs[i]) / (logs[i + 1] - logs[i])
