"""Max |Δloss| and |Δgrad-norm| of each layout vs the one-process fp32 reference over 10 steps.

    python benchmarks/correctness/parity_report.py [--only zero3,hsdp]

The same model, seed and global batch as the parity tests; prints one row per layout. Rows marked bf16
run mixed precision against the fp32 reference (the tests hold those to 2e-3, the fp32 rows to 1e-5).
"""

from __future__ import annotations

import argparse

from meshfit.config import load_config
from meshfit.train.dist import init_distributed
from meshfit.train.trainer import train
from meshfit.util.ranks import run_ranks

BASE = ["model.preset=tiny", "train.steps=10", "train.global_batch=8", "train.seq_len=64", "train.seed=7"]
LAYOUTS = {
    "ddp": (2, ["parallel.dp_replicate=2"]),
    "zero1": (2, ["parallel.dp_shard=2", "parallel.zero_stage=1"]),
    "zero1 accum": (2, ["parallel.dp_shard=2", "parallel.zero_stage=1", "train.micro_batch=1"]),
    "zero2 accum": (2, ["parallel.dp_shard=2", "parallel.zero_stage=2", "train.micro_batch=1"]),
    "zero2": (2, ["parallel.dp_shard=2", "parallel.zero_stage=2"]),
    "zero3": (2, ["parallel.dp_shard=2", "parallel.zero_stage=3"]),
    "zero3+ac": (2, ["parallel.dp_shard=2", "parallel.activation_checkpointing=full"]),
    "zero3+offload": (2, ["parallel.dp_shard=2", "parallel.offload=true"]),
    "hsdp 2x2": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "tp": (2, ["parallel.tp=2"]),
    "tp+sp+loss-parallel": (2, ["parallel.tp=2", "parallel.sp=true", "parallel.loss_parallel=true"]),
    "tp gpt (tied)": (2, ["model.preset=tiny-gpt", "parallel.tp=2", "parallel.sp=true",
                          "parallel.loss_parallel=true"]),
    "tp2 x dp_shard2": (4, ["parallel.tp=2", "parallel.dp_shard=2", "parallel.sp=true"]),
    "tp2 x ddp2": (4, ["parallel.tp=2", "parallel.dp_replicate=2", "parallel.sp=true"]),
    "tp2 x zero1 dp2": (4, ["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero_stage=1", "parallel.sp=true"]),
    "hsdp 2x2 x tp2": (8, ["parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.sp=true"]),
    **{f"pp {name}": (2, ["model.n_layers=4", "parallel.pp=2", f"pipeline.schedule={name}",
                          "pipeline.microbatches=4"])
       for name in ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")},
    "pp2 x zero1": (4, ["model.n_layers=4", "parallel.pp=2", "parallel.dp_shard=2", "parallel.zero_stage=1"]),
    "pp2 x zero3": (4, ["model.n_layers=4", "parallel.pp=2", "parallel.dp_shard=2", "parallel.zero_stage=3"]),
    "3d pp2 x fsdp2 x tp2": (8, ["model.n_layers=4", "parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2",
                                 "parallel.sp=true", "parallel.loss_parallel=true",
                                 "pipeline.schedule=interleaved-1f1b"]),
    "3d pp2 x zero1 dp2 x tp2": (8, ["model.n_layers=4", "parallel.pp=2", "parallel.dp_shard=2",
                                     "parallel.zero_stage=1", "parallel.tp=2", "parallel.sp=true"]),
    # GPT's 50,257-token vocabulary: tp = 2 pads it to 50,258 rows (seq 64, global batch 4, GPT-3's 125M
    # learning rate: at the default 3e-3 this model's first steps are unstable, and any rounding grows).
    "gpt3-125m tp2": (2, ["model.preset=gpt3-125m", "train.global_batch=4", "train.lr=6e-4", "parallel.tp=2"]),
    "gpt3-125m tp2+sp": (2, ["model.preset=gpt3-125m", "train.global_batch=4", "train.lr=6e-4", "parallel.tp=2",
                             "parallel.sp=true", "parallel.loss_parallel=true"]),
    "zero3 bf16": (2, ["parallel.dp_shard=2", "parallel.mixed_precision=true"]),
    "zero3 bf16 reduce=compute": (2, ["parallel.dp_shard=2", "parallel.mixed_precision=true",
                                      "parallel.reduce_dtype=compute"]),
    "zero2 bf16 accum reduce=compute": (2, ["parallel.dp_shard=2", "parallel.zero_stage=2", "train.micro_batch=1",
                                            "parallel.mixed_precision=true", "parallel.reduce_dtype=compute"]),
    "zero1 bf16 accum": (2, ["parallel.dp_shard=2", "parallel.zero_stage=1", "train.micro_batch=1",
                             "parallel.mixed_precision=true"]),
    "zero2 bf16 accum": (2, ["parallel.dp_shard=2", "parallel.zero_stage=2", "train.micro_batch=1",
                             "parallel.mixed_precision=true"]),
    "one rank bf16": (1, ["parallel.mixed_precision=true"]),
    "ddp bf16 accum": (2, ["parallel.dp_replicate=2", "train.micro_batch=2", "parallel.mixed_precision=true"]),
    "tp2+sp bf16": (2, ["parallel.tp=2", "parallel.sp=true", "parallel.mixed_precision=true"]),
    # Recompute policies and the eager attention kernel (its reference runs eager too).
    "zero3+ac op": (2, ["parallel.dp_shard=2", "parallel.activation_checkpointing=op"]),
    "tp2+sp+ac op": (2, ["parallel.tp=2", "parallel.sp=true", "parallel.activation_checkpointing=op"]),
    "gpt eager tp2+sp": (2, ["model.preset=tiny-gpt", "model.attention=eager", "parallel.tp=2", "parallel.sp=true"]),
    "gpt eager tp2+sp+ac attn": (2, ["model.preset=tiny-gpt", "model.attention=eager", "parallel.tp=2",
                                     "parallel.sp=true", "parallel.activation_checkpointing=attention"]),
    # Context parallelism, Llama (RoPE) and GPT (learned positions; untied, as pipelines need).
    **{f"{family} {name}": (n, [*model, *over]) for family, model in (
        ("llama", []), ("gpt", ["model.preset=tiny-gpt", "model.tie_embeddings=false"]))
       for name, (n, over) in {
           "cp2": (2, ["parallel.cp=2"]), "cp4": (4, ["parallel.cp=4"]),
           "cp2 x zero3 dp2": (4, ["parallel.cp=2", "parallel.dp_shard=2"]),
           "cp2 x tp2+sp": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
           "cp2 x pp2": (4, ["parallel.cp=2", "parallel.pp=2"]),
           "cp2 x tp2 x pp2": (8, ["model.n_layers=4", "parallel.cp=2", "parallel.tp=2", "parallel.sp=true",
                                   "parallel.pp=2"]),
       }.items()},
    "cp2 bf16": (2, ["parallel.cp=2", "parallel.mixed_precision=true"]),
}


def job(overrides: list[str]) -> dict:
    cfg = load_config(None, overrides)
    return train(cfg, init_distributed("cpu"), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated layout names")
    args = parser.parse_args()
    chosen = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    refs: dict[str, dict] = {}
    print(f"{'layout':24s} ranks  max|Δloss|   max|Δgrad-norm|")
    for name in chosen:
        nproc, overrides = LAYOUTS[name]
        # Each layout is compared with one process running the same model and global batch.
        model = [o for o in overrides if o.startswith(("model.", "train.global_batch", "train.lr"))]
        key = ",".join(model)
        if key not in refs:
            refs[key] = run_ranks(job, 1, BASE + model + ["train.log_every=1000"])[0]
        ref = refs[key]
        res = run_ranks(job, nproc, BASE + overrides + ["train.log_every=1000"])[0]
        dl = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"], strict=True))
        dg = max(abs(a - b) for a, b in zip(res["grad_norms"], ref["grad_norms"], strict=True))
        print(f"{name:24s} {nproc:5d}  {dl:10.2e}   {dg:10.2e}", flush=True)


if __name__ == "__main__":
    main()
