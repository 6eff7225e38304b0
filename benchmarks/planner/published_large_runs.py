"""The planner's step time (datasheet rates) against published throughput of large runs on A100s.

    python benchmarks/planner/published_large_runs.py [--breakdown] [--efficiency F]

Each run is listed with the configuration its source states (model shape, TP/PP/DP, interleaving, micro-batch,
global batch, sequence length, GPUs, recompute) and the throughput it published, counted as the source counts
it, and compared like for like:

* Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"),
  Table 1 (39B–530B GPT on 512–2520 A100-80GB; micro-batch, global batch and interleaving from the paper's
  scripts, Megatron-LM examples/sc21/run_table_1.sh) and Table 2 (DeepSpeed ZeRO-3 without model
  parallelism, 175B, global batch 1536 on 384, 768 and 1536 GPUs at micro-batch 4, 2 and 1): TFLOP/s per GPU by the paper's formula 96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration, which counts full
  activation recomputation. The plan runs full recompute (the scripts' `--recompute-method uniform`, every
  layer) and its step time is turned into TFLOP/s by the same formula. Vocabulary 51,200, sequence 2048,
  GPT blocks with dropout 0.1, attention without a fused kernel (2021: materialised scores), 16-bit.
* Smith et al. 2022 ("Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B"), section 2.4: 530B
  (105 layers, hidden 20480, 128 heads), TP 8 × PP 35, micro-batch 1, global batch 1920, seq 2048, on 280,
  350 and 420 DGX A100 nodes: 126, 121 and 113 TFLOP/s per GPU (60.1, 50.2 and 44.4 s per iteration, which
  is the same formula). The paper names no interleaving: planned as 1F1B.
* MosaicML llm-foundry, scripts/train/benchmarking/README.md, "A100 80GB with 1600 Gbps node-node
  interconnect (RoCE)": MPT-70B (80 layers, d_model 8192, 64 heads, 4× GELU MLP, vocabulary 50,368, tied),
  FSDP FULL_SHARD, seq 2048, activation checkpointing of every block, bf16 with 16-bit reductions: 64 GPUs,
  micro-batch 8 × 4 accumulation steps (global batch 2048), 410 tokens/s per GPU; 32 GPUs, micro-batch 2 ×
  16 (global batch 1024), 373 tokens/s per GPU.
* torchtitan docs/performance.md (its A100 release): FSDP2 over 64 A100-80GB, activation checkpointing of
  every block: Llama 3 70B, local batch 1, seq 8192, 331 tokens/s per GPU; Llama 2 70B, local batch 2,
  seq 4096, 353 tokens/s per GPU. The network is not stated; planned with DGX A100's 8 × 200 Gb/s per node.

Prints plan vs published and the error per run, the counts within ±15% and ±25%, and with --breakdown the
plan's terms per run; --efficiency F runs every matmul and the attention at F of the peak instead of the
per-kernel rates (planner/timing/kernels.py; a what-if, printed as such). Figures, not a test.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from meshfit.hardware.catalog import Cluster
from meshfit.layout.layout import Layout, Workload
from meshfit.models.config import ModelConfig
from meshfit.models.presets import get_preset
from meshfit.planner.timing.estimate import StepTime, step_time

A100 = "A100-80GB"


def megatron_gpt(h: int, layers: int, heads: int) -> ModelConfig:
    """A GPT of Narayanan et al. 2021: vocabulary 51,200, seq 2048, 4h MLP, tied head, dropout 0.1."""
    return ModelConfig(family="gpt", dim=h, n_layers=layers, n_heads=heads, n_kv_heads=heads, vocab_size=51200,
                       ffn_hidden=4 * h, max_seq_len=2048, tie_embeddings=True, dropout=0.1)


GPT_39B, GPT_76B = megatron_gpt(8192, 48, 64), megatron_gpt(10240, 60, 80)
GPT_145B, GPT_310B = megatron_gpt(12288, 80, 96), megatron_gpt(16384, 96, 128)
GPT_530B, GPT_175B = megatron_gpt(20480, 105, 128), megatron_gpt(12288, 96, 96)
MT_NLG = ModelConfig(family="gpt", dim=20480, n_layers=105, n_heads=128, n_kv_heads=128, vocab_size=50272,
                     ffn_hidden=4 * 20480, max_seq_len=2048, tie_embeddings=True, dropout=0.1)
MPT_70B = ModelConfig(family="gpt", dim=8192, n_layers=80, n_heads=64, n_kv_heads=64, vocab_size=50368,
                      ffn_hidden=4 * 8192, max_seq_len=2048, tie_embeddings=True)
LLAMA3_70B = get_preset("llama3-70b")
LLAMA2_70B = ModelConfig(family="llama", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                         ffn_hidden=28672, max_seq_len=4096, tie_embeddings=False, rope_theta=10000.0)


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: ModelConfig
    layout: Layout
    gpus: int
    global_batch: int
    seq: int
    published: float
    unit: str  # "TFLOP/s" (Narayanan's formula, per GPU) or "tokens/s" (per GPU)
    attention: str = "eager"
    precision: str = "mixed"


def ptd(tp: int, pp: int, dp: int, mb: int, v: int = 1) -> Layout:
    """Megatron-LM PTD-P: data-parallel replicas of TP × PP, full recompute, 1F1B or interleaved with v."""
    return Layout(dp_replicate=dp, tp=tp, pp=pp, micro_batch=mb, activation_checkpointing="full",
                  schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v)


def zero3(n: int, mb: int, reduce_dtype: str = "fp32") -> Layout:
    return Layout(dp_shard=n, zero_stage=3, micro_batch=mb, activation_checkpointing="full",
                  reduce_dtype=reduce_dtype)


N21, T1, T2 = "Narayanan et al. 2021", "Table 1", "Table 2"
RUNS = (
    Run("GPT 39B, 512 GPUs", f"{N21} {T1}", GPT_39B, ptd(8, 2, 32, 4), 512, 1536, 2048, 138, "TFLOP/s"),
    Run("GPT 76B, 1024 GPUs", f"{N21} {T1}", GPT_76B, ptd(8, 4, 32, 2, 3), 1024, 1792, 2048, 140, "TFLOP/s"),
    Run("GPT 145B, 1536 GPUs", f"{N21} {T1}", GPT_145B, ptd(8, 8, 24, 2, 2), 1536, 2304, 2048, 148, "TFLOP/s"),
    Run("GPT 310B, 1920 GPUs", f"{N21} {T1}", GPT_310B, ptd(8, 16, 15, 1, 2), 1920, 2160, 2048, 155, "TFLOP/s"),
    Run("GPT 530B, 2520 GPUs", f"{N21} {T1}", GPT_530B, ptd(8, 35, 9, 1, 3), 2520, 2520, 2048, 163, "TFLOP/s"),
    Run("GPT 175B ZeRO-3, 384 GPUs", f"{N21} {T2}", GPT_175B, zero3(384, 4), 384, 1536, 2048, 144, "TFLOP/s"),
    Run("GPT 175B ZeRO-3, 768 GPUs", f"{N21} {T2}", GPT_175B, zero3(768, 2), 768, 1536, 2048, 88, "TFLOP/s"),
    Run("GPT 175B ZeRO-3, 1536 GPUs", f"{N21} {T2}", GPT_175B, zero3(1536, 1), 1536, 1536, 2048, 44, "TFLOP/s"),
    Run("MT-NLG 530B, 2240 GPUs", "Smith et al. 2022 §2.4", MT_NLG, ptd(8, 35, 8, 1), 2240, 1920, 2048, 126,
        "TFLOP/s"),
    Run("MT-NLG 530B, 2800 GPUs", "Smith et al. 2022 §2.4", MT_NLG, ptd(8, 35, 10, 1), 2800, 1920, 2048, 121,
        "TFLOP/s"),
    Run("MT-NLG 530B, 3360 GPUs", "Smith et al. 2022 §2.4", MT_NLG, ptd(8, 35, 12, 1), 3360, 1920, 2048, 113,
        "TFLOP/s"),
    Run("MPT-70B FSDP, 64 GPUs", "llm-foundry benchmarks", MPT_70B, zero3(64, 8, "compute"), 64, 2048, 2048, 410,
        "tokens/s", attention="flash"),
    Run("MPT-70B FSDP, 32 GPUs", "llm-foundry benchmarks", MPT_70B, zero3(32, 2, "compute"), 32, 1024, 2048, 373,
        "tokens/s", attention="flash"),
    Run("Llama 3 70B FSDP2, 64 GPUs", "torchtitan performance.md", LLAMA3_70B, zero3(64, 1), 64, 64, 8192, 331,
        "tokens/s", attention="flash"),
    Run("Llama 2 70B FSDP2, 64 GPUs", "torchtitan performance.md", LLAMA2_70B, zero3(64, 2), 64, 128, 4096, 353,
        "tokens/s", attention="flash"),
)


def paper_flops_per_token(model: ModelConfig, seq: int) -> float:
    """Narayanan et al. 2021, eq. (3) per token: 96·l·h²·(1 + s/6h + V/16lh) (recompute counted)."""
    h, l, v = model.dim, model.n_layers, model.vocab_size
    return 96 * l * h**2 * (1 + seq / (6 * h) + v / (16 * l * h))


def plan(run: Run, efficiency: float | None = None) -> tuple[float, StepTime]:
    """(the plan's figure in the run's unit, the plan's step time); ``efficiency``: every matmul's fraction of
    the peak instead of the per-kernel rates (a what-if, not the plan)."""
    work = Workload(seq_len=run.seq, global_batch=run.global_batch, precision=run.precision,
                    attention=run.attention)
    t = step_time(run.model, run.layout, work, Cluster(A100, nodes=run.gpus // 8, gpus_per_node=8),
                  efficiency=efficiency)
    per_gpu = t.tokens_per_s / run.gpus
    if run.unit == "TFLOP/s":
        return per_gpu * paper_flops_per_token(run.model, run.seq) / 1e12, t
    return per_gpu, t


def breakdown(t: StepTime) -> str:
    parts = (("compute", t.compute_s), ("of which elementwise", t.elementwise_s), ("recompute", t.recompute_s),
             ("tp", t.tp_comm_s), ("dp", t.dp_comm_s), ("pp", t.pp_comm_s), ("bubble", t.bubble_s),
             ("optimizer", t.optimizer_s))
    return f"step {t.total_s:.2f} s: " + ", ".join(f"{name} {s:.2f}" for name, s in parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--breakdown", action="store_true", help="print the plan's terms per run")
    parser.add_argument("--efficiency", type=float, default=None,
                        help="what-if: every matmul and the attention at this fraction of the peak instead of "
                             "the per-kernel rates")
    args = parser.parse_args()
    if args.efficiency is not None:
        print(f"what-if: matmuls and attention at {args.efficiency:.3f} of the peak (not the plan)\n")
    print("| run | layout | source | published | plan | error |\n|---|---|---|---|---|---|")
    errors = []
    for run in RUNS:
        value, t = plan(run, args.efficiency)
        err = value / run.published - 1
        errors.append(err)
        print(f"| {run.name} | {run.layout.describe()} | {run.source} | {run.published:g} {run.unit} | "
              f"{value:.1f} | {err:+.0%} |")
        if args.breakdown:
            print(f"|  | {breakdown(t)} | | | | |")
    within, within25 = sum(abs(e) <= 0.15 for e in errors), sum(abs(e) <= 0.25 for e in errors)
    slow = sum(e < -0.15 for e in errors)
    print(f"\nwithin ±15%: {within} of {len(errors)}, within ±25%: {within25}; slower than published by more "
          f"than 15%: {slow}; "
          f"errors from {min(errors):+.0%} to {max(errors):+.0%}, "
          f"mean |error| {sum(abs(e) for e in errors) / len(errors):.0%}")


if __name__ == "__main__":
    main()
