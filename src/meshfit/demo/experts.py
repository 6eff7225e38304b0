"""The demo's third scene: a Mixture-of-Experts model whose experts, not its activations, exceed a rank.

The routed experts hold most of an MoE model's weights. ZeRO-3 shards them with everything else, but it
gathers each block's weights whole to compute it: every expert of the block (with the next block's,
prefetched, and the block's full gradients in backward), although each token uses only top_k of them.
Expert parallelism (parallel.ep) keeps each rank's experts local instead and sends the tokens to them: a
rank gathers only its own E/ep experts. The model states per rank are the same (both split every expert
over all ranks); what differs is the gathered working set. The scene's budget (`EXPERTS_BUDGET`, per rank
count) lies between the two peaks, measured. Results go to DIR/experts.json and DIR/experts_memory.png.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from meshfit.demo.chart import memory_chart
from meshfit.demo.scene import run_scene
from meshfit.demo.tables import parity_text
from meshfit.demo.trial import Entry, Trial
from meshfit.layout.layout import Layout
from meshfit.util.units import fmt_bytes, parse_bytes

# The demo's model with every block's MLP replaced by 16 routed SwiGLU experts of width 512 (top 2):
# 26.3M parameters, 25.2M of them in experts (6.3M per block).
EXPERTS_MODEL = ("model.n_layers=4", "model.moe_experts=16", "model.moe_ffn_hidden=512", "model.moe_top_k=2")
# Between the two layouts' peaks per rank, measured on CPU ranks: 2 ranks, ZeRO-3 358 MiB and ep 2 270 MiB;
# 4 ranks, ZeRO-3 249 MiB and ep 4 147 MiB.
EXPERTS_BUDGET = {2: "300MiB", 4: "200MiB"}


def expert_trials(nproc: int) -> list[Trial]:
    return [
        Trial("moe-zero3", Layout(dp_shard=nproc, zero_stage=3, micro_batch=1),
              "ZeRO-3: every expert sharded, but each block's 16 gathered whole to compute it", model=EXPERTS_MODEL),
        Trial("moe-ep", Layout(dp_shard=nproc, zero_stage=3, ep=nproc, micro_batch=1),
              f"expert parallelism: each rank keeps {16 // nproc} experts per block; tokens travel to them",
              model=EXPERTS_MODEL),
    ]


def run_experts_scene(run_dir: Path, nproc: int, console: Console) -> list[Entry]:
    budget = EXPERTS_BUDGET[nproc]
    limit = parse_bytes(budget)
    entries = run_scene(f"Mixture of Experts. The same model with 16 experts per block (top 2) under a budget of "
                        f"{fmt_bytes(limit)}: the experts hold most of the weights, and ZeRO-3 gathers all of a "
                        "block's experts to compute it.", expert_trials(nproc), budget, run_dir, console)
    zero3, ep = entries
    if zero3.peak_mem_bytes and ep.peak_mem_bytes:
        console.print(f"Peak per rank: {fmt_bytes(zero3.peak_mem_bytes)} with ZeRO-3 alone, "
                      f"{fmt_bytes(ep.peak_mem_bytes)} with ep={nproc}: the same sharded states, but a block's "
                      f"gathered experts are 1/{nproc} as many.")
    if text := parity_text(entries):
        console.print(text)
    (run_dir / "experts.json").write_text(json.dumps(
        {"budget_bytes": limit, "model": list(EXPERTS_MODEL), "layouts": [e.to_json() for e in entries]}, indent=2))
    memory_chart([e.to_json() for e in entries], limit, run_dir / "experts_memory.png")
    return entries
