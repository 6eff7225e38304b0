"""The planner's step time (datasheet rates) against two published training throughputs.

    python benchmarks/planner/published_throughput.py [--efficiency F]

* torchtitan, Llama-3 8B on 8 × H100 (FSDP, bf16, local batch 2, seq 8192, selective activation
  checkpointing): 5,762 tokens/s per GPU in its performance docs (benchmarks/llama3_h100_202412_torchtitan.md,
  end of 2024). Its H100s are Grand Teton's: 96GB HBM2e at 2.4 TB/s (planned so: the catalog's H100 SXM with
  that HBM rate) and the default 500 W power limit, which the plan does not model (the published matmul and
  attention rates it uses are the H100 SXM's, a 700 W part). torchtitan's op-level policy re-runs every second
  matmul of the forward (the FLOPs of meshfit's `selective`, every second block) and every element-wise op
  (meshfit's `op`): both are printed, and no recompute.
* Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"),
  Table 1, first row: a 1.7B GPT (24 layers, hidden 2304, 24 heads, vocabulary 51,200) on 32 A100s, TP 1,
  PP 1, global batch 512, seq 2048: 137 TFLOP/s per GPU, counted by the paper's formula, which assumes
  activation recomputation (96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration: 4 passes of the blocks'
  matmuls where a step without recompute runs 3). Printed both ways: the plan without recompute in model
  FLOPs, and with full recompute counted by the paper's formula (like for like). Attention without a fused
  kernel, as in 2021 (materialised scores: `eager`), as published_large_runs.py plans the paper's other rows.

Prints the plan's figure, its compute / element-wise split and the error. Figures, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses

from meshfit.hardware.catalog import Cluster, get_gpu
from meshfit.layout.layout import Layout, Workload
from meshfit.models.config import ModelConfig, flops_per_token
from meshfit.models.presets import get_preset
from meshfit.planner.timing.estimate import step_time

GPT_1_7B = ModelConfig(family="gpt", dim=2304, n_layers=24, n_heads=24, n_kv_heads=24, vocab_size=51200,
                       ffn_hidden=4 * 2304, max_seq_len=2048, tie_embeddings=True, dropout=0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--efficiency", type=float, default=None,
                        help="what-if: every matmul and the attention at this fraction of the peak instead of "
                             "the per-kernel rates")
    eff = parser.parse_args().efficiency
    if eff is not None:
        print(f"what-if: matmuls and attention at {eff:.3f} of the peak (not the plan)")
    grand_teton = dataclasses.replace(get_gpu("H100-SXM"), memory_bytes=96 * 2**30, hbm_bytes_per_s=2.4e12)
    model, node = get_preset("llama3-8b"), Cluster(grand_teton, nodes=1, gpus_per_node=8)
    work = Workload(seq_len=8192, global_batch=16, precision="mixed")
    published = 5762.0
    print("torchtitan Llama-3 8B, 8 × H100 (HBM 2.4 TB/s), FSDP (zero3 dp=8), local batch 2, seq 8192: published "
          f"{published:,.0f} tokens/s per GPU")
    for ac in ("selective", "op", "none"):
        t = step_time(model, Layout(dp_shard=8, zero_stage=3, micro_batch=2, activation_checkpointing=ac),
                      work, node, efficiency=eff)
        per_gpu = t.tokens_per_s / 8
        print(f"  {ac:9s} plan {per_gpu:7,.0f} tokens/s per GPU ({per_gpu / published - 1:+.0%}); step "
              f"{t.total_s:.2f} s, compute {t.compute_s:.2f} s of which element-wise {t.elementwise_s:.2f} s "
              f"and recompute {t.recompute_s:.2f} s; MFU {t.mfu:.0%}")
    cluster = Cluster("A100-80GB", nodes=4, gpus_per_node=8)
    work = Workload(seq_len=2048, global_batch=512, precision="mixed", attention="eager")
    print("Narayanan et al. 2021, Table 1 row 1: 1.7B GPT, 32 × A100-80GB, DDP 32, global batch 512, seq 2048: "
          "published 137 TFLOP/s per GPU")
    g, s = GPT_1_7B, 2048
    paper = 96 * g.n_layers * g.dim**2 * (1 + s / (6 * g.dim) + g.vocab_size / (16 * g.n_layers * g.dim))
    for ac, per_token, label in (("none", flops_per_token(g, s), "model"), ("full", paper, "paper-formula")):
        t = step_time(g, Layout(dp_replicate=32, micro_batch=16, activation_checkpointing=ac), work, cluster,
                      efficiency=eff)
        tflops = t.tokens_per_s / 32 * per_token / 1e12
        print(f"  recompute {ac:4s} plan {tflops:.1f} {label} TFLOP/s per GPU ({tflops / 137 - 1:+.0%}); step "
              f"{t.total_s:.2f} s, element-wise {t.elementwise_s:.2f} s, recompute {t.recompute_s:.2f} s")


if __name__ == "__main__":
    main()
