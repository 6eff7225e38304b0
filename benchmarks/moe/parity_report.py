"""Mixture-of-Experts layouts against one process: max |Δloss| and |Δgrad-norm| over 10 steps, and whether the
tokens per expert and the aux-loss-free expert biases are equal.

    python benchmarks/moe/parity_report.py [--only ep2,ep4]

`tiny-moe` (8 experts of width 32, top 2, the auxiliary loss at 0.01, the expert bias updated at 1e-3),
fp32 and dropless unless a row says otherwise, global batch 8 of 64 tokens, seed 7. Routing, the auxiliary
loss and capacity are a micro-batch's, so the one-process reference runs micro-batches of one data-parallel
rank's batch (8 / dp sequences). Rows marked bf16 run mixed precision against the fp32 reference (the tests
hold those to 1e-3, the fp32 rows to 1e-5).
"""

from __future__ import annotations

import argparse
import re

from meshfit.config import load_config
from meshfit.models.moe import MoE
from meshfit.train.dist import init_distributed
from meshfit.train.run import build_run
from meshfit.train.trainer import train_step
from meshfit.util.ranks import run_ranks

BASE = ["model.preset=tiny-moe", "model.moe_bias_update_rate=0.001", "train.steps=10", "train.global_batch=8",
        "train.seq_len=64", "train.seed=7", "train.log_every=1000"]
# name: (ranks, data-parallel ranks (dp_replicate × dp_shard), overrides)
LAYOUTS: dict[str, tuple[int, int, list[str]]] = {
    "ep2": (2, 2, ["parallel.dp_shard=2", "parallel.ep=2"]),
    "ep4": (4, 4, ["parallel.dp_shard=4", "parallel.ep=4"]),
    **{f"ep2 x zero{z} dp4": (4, 4, ["parallel.dp_shard=4", "parallel.ep=2", f"parallel.zero_stage={z}"])
       for z in (1, 2, 3)},
    "ep2 x hsdp 2x2": (4, 4, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2"]),
    "ep2 capacity 1.0": (2, 2, ["parallel.dp_shard=2", "parallel.ep=2", "model.moe_capacity_factor=1.0"]),
    "ep2 full recompute": (2, 2, ["parallel.dp_shard=2", "parallel.ep=2", "parallel.activation_checkpointing=full"]),
    "ep2 op recompute": (2, 2, ["parallel.dp_shard=2", "parallel.ep=2", "parallel.activation_checkpointing=op"]),
    "ep2 compiled": (2, 2, ["parallel.dp_shard=2", "parallel.ep=2", "train.compile=true"]),
    "ep2 bf16": (2, 2, ["parallel.dp_shard=2", "parallel.ep=2", "parallel.mixed_precision=true"]),
    # Tensor parallelism on attention (the MoE block whole on each tp rank; under sp each routes its slice)
    # and context parallelism (the auxiliary loss the whole sequences'), with and without ep.
    "tp2 loss-parallel": (2, 1, ["parallel.tp=2", "parallel.loss_parallel=true"]),
    "tp2+sp": (2, 1, ["parallel.tp=2", "parallel.sp=true"]),
    "cp2": (2, 1, ["parallel.cp=2"]),
    "ep2 over cp2": (2, 1, ["parallel.cp=2", "parallel.ep=2"]),
    "ep2 x tp2 dp2": (4, 2, ["parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2", "parallel.loss_parallel=true"]),
    "ep2 x tp2+sp dp2": (4, 2, ["parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2", "parallel.sp=true"]),
    "ep2 x cp2 dp2": (4, 2, ["parallel.dp_shard=2", "parallel.ep=2", "parallel.cp=2"]),
    # Pipelines: 4 blocks (the first dense), 2 sequences per pipeline micro-batch.
    **{f"pp2 {schedule}": (2, 1, ["model.n_layers=4", "parallel.pp=2", f"pipeline.schedule={schedule}",
                                  "pipeline.microbatches=4", *extra])
       for schedule, extra in (("1f1b", []), ("interleaved-1f1b", ["pipeline.virtual_stages=2"]),
                               ("gpipe", []))},
    "ep2 x pp2": (4, 2, ["model.n_layers=4", "parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2",
                         "pipeline.microbatches=2"]),
}


def job(overrides: list[str]) -> dict:
    """10 steps; losses, gradient norms, the most-loaded expert's tokens per step and the expert biases."""
    cfg = load_config(None, overrides)
    run = build_run(cfg, init_distributed("cpu"), None)
    records = [train_step(run) for _ in range(cfg.train.steps)]
    # A pipeline rank holds its stage's blocks only: their biases are compared with the same layers'.
    biases = {re.search(r"layers\.(\d+)", name).group(1): m.router.expert_bias.tolist()
              for name, m in run.model.named_modules() if isinstance(m, MoE)}
    return {"losses": [r["loss"] for r in records], "grad_norms": [r["grad_norm"] for r in records],
            "tokens": [r["moe_tokens_max"] for r in records], "biases": biases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated layout names")
    args = parser.parse_args()
    chosen = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    refs: dict[tuple, dict] = {}
    print(f"{'layout':22s} ranks  max|Δloss|   max|Δgrad-norm|  tokens/expert  biases")
    for name in chosen:
        nproc, dp, overrides = LAYOUTS[name]
        model = [o for o in overrides if o.startswith("model.")]
        # Under a pipeline, micro-batches are the schedule's (2 sequences here); else one rank's batch.
        micro = 2 if any(o.startswith("parallel.pp") for o in overrides) else 8 // dp
        key = (micro, *model)
        if key not in refs:
            refs[key] = run_ranks(job, 1, [*BASE, *model, f"train.micro_batch={micro}"])[0]
        ref, res = refs[key], run_ranks(job, nproc, [*BASE, *overrides])[0]
        dl = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"], strict=True))
        dg = max(abs(a - b) for a, b in zip(res["grad_norms"], ref["grad_norms"], strict=True))
        same = {"tokens": "equal" if res["tokens"] == ref["tokens"] else "DIFFER",
                "biases": "equal" if all(ref["biases"][k] == v for k, v in res["biases"].items()) else "DIFFER"}
        print(f"{name:22s} {nproc:5d}  {dl:10.2e}   {dg:10.2e}      {same['tokens']:13s}  {same['biases']}", flush=True)


if __name__ == "__main__":
    main()
