"""The datasheet per-kernel time model: GEMM roofline with tile and wave quantization, the attention kernels
against their published measurements, and a calibrated device bypassing it all (pure arithmetic)."""

import dataclasses
import math

import pytest

from meshfit.hardware.catalog import GPUS, Cluster, cpu_device, get_gpu
from meshfit.hardware.kernels import FLASH_SEQS, flash_fraction, kernel_rates
from meshfit.hardware.profile import HardwareProfile, Link
from meshfit.layout.layout import Layout, Workload
from meshfit.models.config import ModelConfig
from meshfit.planner.timing import estimate
from meshfit.planner.timing.basis import time_basis
from meshfit.planner.timing.estimate import HBM_EFFICIENCY, step_time
from meshfit.planner.timing.kernels import EAGER_SCORE_BYTES, EAGER_SCORE_BYTES_D, gemm_s, kernel_times

A100 = get_gpu("A100-80GB")
H100 = get_gpu("H100-SXM")


def _bw(gpu) -> float:
    return gpu.hbm_bytes_per_s * HBM_EFFICIENCY


def _rate(m: int, n: int, k: int, gpu=A100) -> float:
    """FLOP/s one bf16 GEMM reaches, as a fraction of the dense peak."""
    return 2.0 * m * n * k / gemm_s(m, n, k, gpu, "mixed", _bw(gpu)) / gpu.bf16_flops


# --- GEMM --------------------------------------------------------------------------------------------------


def test_a_large_gemm_of_whole_waves_runs_at_the_published_maximum_achievable_rate():
    # 108 × 10 tiles of 256 × 128 on the A100's 108 SMs: ten whole waves, at MAMF (271.2 of 312 TFLOP/s).
    assert _rate(108 * 256, 10 * 128, 8192) == pytest.approx(kernel_rates("A100-80GB").matmul_fraction, rel=1e-12)
    assert kernel_rates("A100-80GB").matmul_fraction == pytest.approx(271.2 / 312, abs=1e-3)
    # A large square one comes within 1% of it (19 waves, the last nearly full), and none exceeds it.
    assert _rate(8192, 8192, 8192) == pytest.approx(0.869, rel=0.01)
    for m, n, k in ((8192, 8192, 8192), (4096, 28672, 8192), (16384, 1024, 4096), (300, 500, 700)):
        assert _rate(m, n, k) <= 0.869 + 1e-12
    # The H100 likewise at its own fraction (794.5 of 989, 80.3%), with its 132 SMs.
    assert _rate(132 * 256, 4 * 128, 8192, H100) == pytest.approx(0.803, rel=1e-12)


def test_a_partial_last_wave_costs_a_whole_wave():
    # 12 × 9 = 108 tiles fill the A100's SMs once (K = 16384: compute-bound); one more row of tiles
    # (13 × 9 = 117) needs a second wave of the same length.
    one, two = (gemm_s(m, 9 * 128, 16384, A100, "mixed", _bw(A100)) for m in (12 * 256, 13 * 256))
    assert two == pytest.approx(2 * one)
    assert _rate(12 * 256, 9 * 128, 16384) == pytest.approx(0.869, rel=1e-12)
    # Tile quantization: one row more than whole tiles pads a whole row of tiles (here a 2nd wave as well).
    assert gemm_s(12 * 256 + 1, 9 * 128, 16384, A100, "mixed", _bw(A100)) == pytest.approx(two)
    # The tile is taken in its better orientation: the transposed output fits 128 × 256 tiles just as well.
    assert gemm_s(9 * 128, 12 * 256, 16384, A100, "mixed", _bw(A100)) == pytest.approx(one)


def test_a_skinny_or_small_gemm_is_memory_bound_and_slower():
    # K = 16: 2·16 FLOPs per output value written (2 bytes): far below the A100's 271 TFLOP/s over
    # 1.63 TB/s, so the time is the bytes moved at the element-wise rate.
    m = n = 8192
    t = gemm_s(m, n, 16, A100, "mixed", _bw(A100))
    assert t == pytest.approx(2 * (m * 16 + 16 * n + m * n) / _bw(A100))
    assert _rate(m, n, 16) < 0.1
    # A weight gradient of a thin projection at a short micro-batch, and a tiny GEMM: both well below MAMF.
    assert _rate(1024, 128, 8192) < 0.5 * 0.869
    assert _rate(512, 512, 512) < 0.5 * 0.869
    # The memory bound follows the HBM rate: the A100 40GB's slower HBM makes the skinny GEMM slower.
    a40 = get_gpu("A100-40GB")
    assert gemm_s(m, n, 16, a40, "mixed", _bw(a40)) > 1.3 * t


def test_every_catalog_part_has_kernel_rates_and_says_what_it_assumes():
    for name, gpu in GPUS.items():
        rates = kernel_rates(name)
        assert 0.4 < rates.matmul_fraction < 0.9 and gpu.sms > 0, name
        assert 0.1 < flash_fraction(name, 128, 4096) < 0.7, name
    assert not kernel_rates("A100-80GB").assumed and not kernel_rates("H100-SXM").assumed
    assert any("attention" in a for a in kernel_rates("B200").assumed)
    assert any("80%" in a for a in kernel_rates("L40S").assumed)
    basis = time_basis(get_gpu("B200"))
    assert "per-kernel" in basis.label and any("A100's fraction" in lack for lack in basis.lacks)


# --- Attention ---------------------------------------------------------------------------------------------


def test_flash_rates_are_the_published_ones_at_the_measured_points_and_interpolate_between():
    # FlashAttention-2, forward + backward with a causal mask (its repository's benchmark figures).
    assert flash_fraction("A100-80GB", 128, 2048) * 312 == pytest.approx(155)
    assert flash_fraction("A100-80GB", 64, 16384) * 312 == pytest.approx(171)
    assert flash_fraction("H100-SXM", 128, 8192) * 989.4 == pytest.approx(308)
    # Halfway between the head dims, linear in log2(sequence) between 2k and 4k.
    f = math.log2(3 * 1024) - 11
    expected = ((140 + (156 - 140) * f) + (155 + (173 - 155) * f)) / 2
    assert flash_fraction("A100-80GB", 96, 3 * 1024) * 312 == pytest.approx(expected)
    assert flash_fraction("A100-80GB", 256, 10**6) == flash_fraction("A100-80GB", 128, FLASH_SEQS[-1])


# FlashAttention-2's PyTorch baseline (bmm, softmax, bmm; fp16, no dropout), forward + backward TFLOP/s at
# sequences 512-8k, from the same figures: the eager bytes were fitted on the A100 rows without the mask.
_EAGER_PUBLISHED = {
    ("A100-80GB", False, 64): (36, 40, 43, 45, 46), ("A100-80GB", False, 128): (53, 67, 76, 79, 86),
    ("H100-SXM", False, 64): (62, 72, 81, 86, 87), ("H100-SXM", False, 128): (93, 120, 145, 160, 167),
    ("A100-80GB", True, 64): (15, 16, 17, 18, 18), ("A100-80GB", True, 128): (23, 28, 32, 32, 34),
    ("H100-SXM", True, 64): (26, 29, 31, 32, 32), ("H100-SXM", True, 128): (40, 50, 57, 61, 63),
}


@pytest.mark.parametrize("key", sorted(_EAGER_PUBLISHED))
def test_eager_attention_bytes_reproduce_the_published_pytorch_baseline(key):
    name, causal, d = key
    gpu = get_gpu(name)
    fitted_on = name == "A100-80GB" and not causal
    for seq, tflops in zip(FLASH_SEQS, _EAGER_PUBLISHED[key]):
        measured = 3.5 * 4 * d / (2 if causal else 1) / (tflops * 1e12)  # seconds per score, as counted there
        # The baseline's causal variant adds its mask to the scores: one more kernel, 3 values per score.
        score_bytes = EAGER_SCORE_BYTES + EAGER_SCORE_BYTES_D * d / seq + (6 if causal else 0)
        planned = score_bytes / _bw(gpu)
        assert planned / measured == pytest.approx(1.0, abs=0.08 if fitted_on else 0.20), (key, seq)


def _gpt(dim: int = 4096, heads: int = 32, dropout: float = 0.0) -> ModelConfig:
    return ModelConfig(family="gpt", dim=dim, n_layers=4, n_heads=heads, n_kv_heads=heads, vocab_size=50304,
                       ffn_hidden=4 * dim, max_seq_len=4096, tie_embeddings=True, dropout=dropout)


def test_eager_attention_costs_more_than_flash_and_dropout_adds_its_kernel():
    args = ("mixed", 2 * 2048, 2048, 1, 1, _bw(A100))
    flash = kernel_times(_gpt(), A100, "mixed", "flash", *args[1:])
    eager = kernel_times(_gpt(), A100, "mixed", "eager", *args[1:])
    dropped = kernel_times(_gpt(dropout=0.1), A100, "mixed", "eager", *args[1:])
    assert eager.core_fwd + eager.core_bwd > 2 * (flash.core_fwd + flash.core_bwd)
    # The dropout's kernel each way: 2 values and a 1-byte mask per score of every head and key.
    extra = 2 * 32 * 2048 * (2 * 2 + 1) / _bw(A100)
    assert dropped.core_fwd + dropped.core_bwd - eager.core_fwd - eager.core_bwd == pytest.approx(extra)
    # The matmuls do not depend on the attention kernel.
    assert (flash.block_fwd, flash.block_bwd, flash.head) == (eager.block_fwd, eager.block_bwd, eager.head)


# --- Calibrated devices bypass the datasheet model ---------------------------------------------------------


def _profile(flops: float = 1e10) -> HardwareProfile:
    link = Link(bus_bytes_per_s=1e9, latency_s=1e-4)
    return HardwareProfile(device="cuda", device_name="test", backend="nccl", ranks=2, threads_per_rank=1,
                           matmul_flops={"fp32": flops, "bf16": flops}, attention_flops={"fp32": flops, "bf16": flops},
                           elementwise_bytes_per_s=1e10, collectives={2: dict.fromkeys(
                               ("all_reduce", "all_gather", "reduce_scatter", "send_recv"), link)}, overlap=0.0,
                           model_flops={"fp32": flops, "bf16": flops}, seq=64)


def test_a_calibrated_device_runs_at_its_measured_rates_not_the_kernel_model(monkeypatch):
    model, work, layout = _gpt(dim=256, heads=4), Workload(seq_len=256, global_batch=4), Layout(dp_shard=2,
                                                                                               zero_stage=3)
    calibrated = [Cluster(cpu_device(2**30, _profile()), nodes=1, gpus_per_node=2),
                  Cluster(dataclasses.replace(A100, profile=_profile()), nodes=1, gpus_per_node=2)]
    expected = [step_time(model, layout, work, cluster) for cluster in calibrated]

    def refuse(*args, **kwargs):
        raise AssertionError("the per-kernel model ran")

    monkeypatch.setattr(estimate, "kernel_times", refuse)
    for cluster, before in zip(calibrated, expected):
        t = step_time(model, layout, work, cluster)
        assert t == before
    # A what-if efficiency on datasheet figures runs one rate too; the plain datasheet plan the kernel model.
    step_time(model, layout, work, Cluster(A100, nodes=1, gpus_per_node=2), efficiency=0.5)
    with pytest.raises(AssertionError, match="per-kernel model ran"):
        step_time(model, layout, work, Cluster(A100, nodes=1, gpus_per_node=2))
