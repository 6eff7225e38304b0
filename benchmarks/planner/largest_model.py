"""Largest model that trains under a per-rank budget with ZeRO-3 + full activation checkpointing.

    python benchmarks/planner/largest_model.py [--budget 96MiB] [--nproc 2]

A Llama-style family of fixed width is scaled in depth; each candidate trains a few steps under the
budget on N CPU ranks (the budget stops it at the first operator that would not fit). The largest depth
that trains is found by bisection and printed as a fraction of the model-state limit N·B/16 parameters
(16 bytes per parameter: fp32 weights, gradients and two AdamW moments, perfectly sharded, nothing else).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from meshfit.config import load_config
from meshfit.models import num_params
from meshfit.train.launch import launch
from meshfit.util.units import fmt_bytes, parse_bytes

FAMILY = ["model.preset=small", "model.dim=256", "model.n_heads=8", "model.n_kv_heads=4",
          "model.ffn_hidden=704", "model.vocab_size=512"]
TRAIN = ["train.steps=3", "train.global_batch=8", "train.micro_batch=1", "train.seq_len=64",
         "train.log_every=1000", "parallel.activation_checkpointing=full"]


def trains(layers: int, budget: str, nproc: int, tmp: Path) -> bool:
    overrides = FAMILY + TRAIN + [f"model.n_layers={layers}", f"parallel.dp_shard={nproc}",
                                  f"train.memory_budget={budget}"]
    outcome = launch(load_config(None, overrides), tmp / f"layers{layers}", nproc)
    print(f"  {layers:3d} layers: {'trains' if outcome.ok else 'over budget'}", flush=True)
    return outcome.ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="96MiB")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--max-layers", type=int, default=64)
    args = parser.parse_args()
    budget = parse_bytes(args.budget)
    lo, hi = 1, args.max_layers  # invariant: lo trains (checked below), hi + 1 does not (or is the cap)
    with tempfile.TemporaryDirectory() as tmp:
        if not trains(lo, args.budget, args.nproc, Path(tmp)):
            raise SystemExit("even one layer does not fit; raise --budget")
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if trains(mid, args.budget, args.nproc, Path(tmp)):
                lo = mid
            else:
                hi = mid - 1
    params = num_params(load_config(None, FAMILY + [f"model.n_layers={lo}"]).model.resolve())
    limit = args.nproc * budget / 16
    print(f"budget {fmt_bytes(budget)} per rank × {args.nproc} ranks: model-state limit {limit / 1e6:.2f}M params")
    print(f"largest model that trains: {lo} layers, {params / 1e6:.2f}M params = {params / limit:.2f} of the limit")


if __name__ == "__main__":
    main()
