"""Seconds per token of a rank's matmuls and attention core, kernel by kernel, from published per-kernel
measurements: the step time on datasheet figures (a calibrated device runs at its measured rates instead;
planner/timing/estimate.py).

* Matmul: a GEMM of an M×K by a K×N matrix with ``c``-byte values takes the longer of
  - compute, as NVIDIA's "Matrix Multiplication Background" user guide describes cuBLAS: the M×N output is
    cut into 256×128 tiles (the guide's most efficient tile; the better of its two orientations, as the
    library picks among tile shapes) and each SM computes one tile at a time, so the GEMM runs
    ⌈tiles / SMs⌉ waves, each of 2·256·128·K FLOPs per SM at the SM's share of the part's maximum
    achievable matmul rate (hardware/kernels.py). A GEMM of whole waves runs at that rate; padded edge
    tiles (tile quantization) and a last partial wave (wave quantization) cost their full time;
  - memory: A and B read and C written once, c·(MK + KN + MN) bytes at the element-wise rate
    (HBM_EFFICIENCY × the HBM peak): a skinny GEMM, whose FLOPs per byte are below the part's ratio of
    matmul rate to bandwidth, is memory-bound.
  A linear layer x·W (x: T×K, W: K×N) runs three GEMMs a step: forward (T, N, K), input gradient (T, K, N)
  and weight gradient (K, N, T). Under tensor parallelism each rank multiplies its 1/tp of the weights
  (column splits: N/tp; row splits: K/tp) with all T tokens of the micro-batch (gathered under SP).
* Fused attention (torch's flash kernel is FlashAttention-2): the causal forward + backward at the rate
  FlashAttention-2's benchmark measured on the part (hardware/kernels.py), counted as it counts (2·s·d
  FLOPs per query, head and forward under the causal mask, 3.5 times that forward + backward). The forward
  alone is taken as 1/3.5 of the time; the paper reaches up to 73% of an A100's peak forward and 63%
  backward, so a re-run forward is charged a little long.
* Eager attention (the scores materialised, models/layers.py): memory-bound over the s×s scores of every
  head. The kernels FlashAttention-2's PyTorch baseline runs (a bmm writing the scores, softmax, a bmm
  reading them, and their backward) move EAGER_SCORE_BYTES + EAGER_SCORE_BYTES_D·d/s per score at the
  element-wise rate (fitted below); meshfit's eager core adds the scaling, the causal mask and, with
  dropout, the dropout, each an element-wise kernel over the scores (counted as models/traffic.py counts).
  Never faster than its bmms' FLOPs at the matmul rate.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshfit.hardware.kernels import flash_fraction, kernel_rates

if TYPE_CHECKING:
    from meshfit.hardware.catalog import GPU
    from meshfit.models.config import ModelConfig

# The guide's cuBLAS tile on the output (rows × columns), taken in either orientation.
TILE = (256, 128)
# Bytes per score (16-bit values) that FlashAttention-2's PyTorch baseline moves forward + backward, at 80%
# of the HBM peak: 31.8 + 90.4·d/s, least squares over its published A100 80GB rates without a causal mask
# (head dims 64 and 128, sequences 512-8k: 36-46 and 53-86 TFLOP/s; the flash-attention repository's
# assets/flash2_a100_fwd_bwd_benchmark.png), within 8% of each. The d/s part is the queries, keys, values
# and outputs (∝ s·d) next to the s² scores. Not fitted on: the H100's rates (the model's times 5-19% long)
# and both parts' with the causal mask, one more kernel of 3 values per score (−11% to +6%).
EAGER_SCORE_BYTES = 31.8
EAGER_SCORE_BYTES_D = 90.4
# The forward's share of those bytes: its kernels move 4 values per score (the bmm writes the scores,
# softmax reads and writes them, the second bmm reads them), the backward's 7 (a bmm writes the gradient
# of the probabilities, another reads the probabilities, softmax's backward reads two and writes one, two
# bmms read the scores' gradient).
EAGER_FORWARD_SHARE = 4.0 / 11.0


@dataclass(frozen=True)
class KernelTimes:
    """Seconds per token of one rank's kernels (per block, under its tensor-parallel split)."""

    block_fwd: float  # a block's matmuls, forward
    block_bwd: float  # their input and weight gradients
    core_fwd: float  # a block's attention core, forward
    core_bwd: float  # its backward
    head_fwd: float  # the output head's matmul, forward
    head_bwd: float

    @property
    def block(self) -> float:
        """One block forward + backward, attention core included."""
        return self.block_fwd + self.block_bwd + self.core_fwd + self.core_bwd

    @property
    def head(self) -> float:
        return self.head_fwd + self.head_bwd

    def step_s(self, tokens: int, blocks: int, has_head: bool, rerun_blocks: float,
               rerun_cores: float) -> tuple[float, float]:
        """(seconds, of which re-run forwards) of ``tokens`` through ``blocks`` blocks (and the head), with
        ``rerun_blocks`` blocks' forward and ``rerun_cores`` attention cores' forward re-run in backward."""
        redo = rerun_blocks * self.block_fwd + rerun_cores * self.core_fwd
        return tokens * (blocks * self.block + has_head * self.head + redo), tokens * redo


def _peak(gpu: GPU, precision: str) -> float:
    return gpu.fp32_flops if precision == "fp32" else gpu.bf16_flops


def _bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def gemm_s(m: float, n: float, k: float, gpu: GPU, precision: str, bandwidth: float) -> float:
    """Seconds of one M×K by K×N GEMM on ``gpu`` (``bandwidth``: the element-wise bytes per second)."""
    rate = _peak(gpu, precision) * kernel_rates(gpu.name).matmul_fraction
    if gpu.sms > 0:
        tm, tn = TILE
        tiles = min(math.ceil(m / tm) * math.ceil(n / tn), math.ceil(m / tn) * math.ceil(n / tm))
        compute = math.ceil(tiles / gpu.sms) * 2.0 * tm * tn * k * gpu.sms / rate
    else:
        compute = 2.0 * m * n * k / rate
    memory = _bytes(precision) * (m * k + k * n + m * n) / bandwidth
    return max(compute, memory)


def linear_s(tokens: int, n_in: float, n_out: float, gpu: GPU, precision: str,
             bandwidth: float) -> tuple[float, float]:
    """(forward, backward) seconds of x·W with x tokens × n_in and W n_in × n_out."""
    fwd = gemm_s(tokens, n_out, n_in, gpu, precision, bandwidth)
    bwd = gemm_s(tokens, n_in, n_out, gpu, precision, bandwidth) + gemm_s(n_in, n_out, tokens, gpu, precision,
                                                                           bandwidth)
    return fwd, bwd


def block_linears(model: ModelConfig, tp: int) -> tuple[tuple[float, float], ...]:
    """(inputs, outputs) of each linear layer of a block on one tensor-parallel rank: the query, key and
    value projections and the FFN's up (and gate) split by columns, the output projections by rows. A
    Mixture-of-Experts block's: the router and its shared experts' SwiGLU (its routed experts' GEMMs are
    ``_expert_s``'s)."""
    h, f = model.dim, model.moe_shared_experts * model.moe_hidden if model.moe else model.ffn_hidden
    q, kv = model.q_width, model.n_kv_heads * model.head_size
    up = ((h, f / tp),) * (2 if model.family == "llama" else 1) if f else ()  # SwiGLU's gate and up, or GPT's
    router = ((h, model.moe_experts),) if model.moe else ()
    down = ((f / tp, h),) if f else ()
    return ((h, q / tp), (h, kv / tp), (h, kv / tp), (q / tp, h), *router, *up, *down)


def _expert_s(model: ModelConfig, gpu: GPU, precision: str, mb_tokens: int, ep: int, imbalance: float,
              bandwidth: float) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE block's routed-expert GEMMs on the most-loaded rank per
    micro-batch: its E/ep experts, each a SwiGLU over its routed copies (planner/timing/experts.py)."""
    from meshfit.planner.timing.experts import expert_gemms

    local, copies = expert_gemms(model, mb_tokens, ep, imbalance)
    h, f = model.dim, model.moe_hidden
    parts = [linear_s(copies, h, f, gpu, precision, bandwidth)] * 2 + [linear_s(copies, f, h, gpu, precision,
                                                                                bandwidth)]
    return local * sum(p[0] for p in parts), local * sum(p[1] for p in parts)


def _flash_s(model: ModelConfig, gpu: GPU, precision: str, seq: int, tp: int, cp: int) -> tuple[float, float]:
    """(forward, backward) seconds per query token of a block's fused causal attention."""
    heads, d = model.n_heads / tp, model.head_size
    if precision == "fp32":  # no flash kernel in fp32; not measured: the matmul rate assumed
        rate = _peak(gpu, precision) * kernel_rates(gpu.name).matmul_fraction
    else:
        rate = flash_fraction(gpu.name, d, seq // cp) * gpu.bf16_flops
    forward = 2.0 * seq * d * heads  # FLOPs per query token as the benchmark counts them (causal: half of 4·s·d)
    total = 3.5 * forward / rate
    return total / 3.5, total * 2.5 / 3.5


def _eager_s(model: ModelConfig, gpu: GPU, precision: str, seq: int, tp: int, cp: int,
             bandwidth: float) -> tuple[float, float]:
    """(forward, backward) seconds per query token of a block's eager attention core."""
    heads, d, c = model.n_heads / tp, model.head_size, _bytes(precision)
    base = (EAGER_SCORE_BYTES + EAGER_SCORE_BYTES_D * d / (seq // cp)) * c / 2
    dropout = model.dropout if model.family == "gpt" else 0.0  # Llama's attention has no dropout
    # Per score and direction: the scaling (read, write), the causal mask (read, one-byte mask, write) and the
    # dropout (read, write, one-byte mask).
    extra = 2 * c + (2 * c + 1) + ((2 * c + 1) if dropout > 0 else 0)
    scores = heads * seq  # every key: the eager core computes the whole rectangle and masks it
    rate = _peak(gpu, precision) * kernel_rates(gpu.name).matmul_fraction
    fwd = max(scores * (base * EAGER_FORWARD_SHARE + extra) / bandwidth, 2 * 2 * d * scores / rate)
    bwd = max(scores * (base * (1 - EAGER_FORWARD_SHARE) + extra) / bandwidth, 4 * 2 * d * scores / rate)
    return fwd, bwd


@functools.lru_cache(maxsize=1024)
def kernel_times(model: ModelConfig, gpu: GPU, precision: str, attention: str, mb_tokens: int, seq: int, tp: int,
                 cp: int, bandwidth: float, ep: int = 1, imbalance: float = 1.0) -> KernelTimes:
    """Seconds per token of a rank's matmuls and attention core on ``gpu``: micro-batches of ``mb_tokens``
    tokens per rank (their sequences' 1/cp under context parallelism) of ``seq``-token sequences, 1/tp of
    every block's and the head's weights. A Mixture-of-Experts model's block is the mean of its dense and
    MoE blocks (experts split over ``ep`` ranks, the most-loaded one ``imbalance`` times the balanced share)."""
    block = [linear_s(mb_tokens, n_in, n_out, gpu, precision, bandwidth) for n_in, n_out in block_linears(model, tp)]
    if model.moe:
        from meshfit.planner.memory.activations import dense_model

        dense = [linear_s(mb_tokens, n_in, n_out, gpu, precision, bandwidth)
                 for n_in, n_out in block_linears(dense_model(model), tp)]
        block.append(_expert_s(model, gpu, precision, mb_tokens, ep, imbalance, bandwidth))
        share = model.moe_layers / model.n_layers  # the mean block: dense first blocks and MoE blocks
        block = [(f * share, b * share) for f, b in block] + [(f * (1 - share), b * (1 - share)) for f, b in dense]
    head_fwd, head_bwd = linear_s(mb_tokens, model.dim, model.padded_vocab / tp, gpu, precision, bandwidth)
    if attention == "eager":
        core_fwd, core_bwd = _eager_s(model, gpu, precision, seq, tp, cp, bandwidth)
    else:
        core_fwd, core_bwd = _flash_s(model, gpu, precision, seq, tp, cp)
    return KernelTimes(block_fwd=sum(f for f, _ in block) / mb_tokens, block_bwd=sum(b for _, b in block) / mb_tokens,
                       core_fwd=core_fwd, core_bwd=core_bwd, head_fwd=head_fwd / mb_tokens,
                       head_bwd=head_bwd / mb_tokens)
