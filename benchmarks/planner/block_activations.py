"""Bytes one transformer block keeps for backward under mixed precision, measured vs the literature.

    python benchmarks/planner/block_activations.py [--seq 256] [--batch 2] [--cp]

For each model family, tensor-parallel degree t = 1, 2 (with and without sequence parallelism), attention
kernel and recompute policy, the model is laid out by meshfit's own `parallelize` (mixed precision: FSDP2's
MixedPrecisionPolicy, bf16 compute copies of fp32 weights) on t gloo ranks, and torch's memory tracker
counts the activations alive at the end of the forward of a 2-block and a 1-block model; their
difference is one block. Printed in units of s·b·h bytes per rank, next to:

* literature: Korthikanti et al. 2022's per-layer count (planner/memory/formulas.py: 34 + 5as/h without TP,
  10 + 24/t (+ 5as/(ht)) with TP, 34/t (+ 5as/(ht)) with TP + SP; "attention" recompute drops the
  core), for the Llama block the same counting rule (SwiGLU, grouped K/V, no dropout); "op" recompute
  has no published figure (—);
* plan: what `meshfit plan` assumes for that block (planner/memory/activations.py).

Shapes: GPT dim 256, 8 heads, MLP 1024, dropout 0.1; Llama dim 256, 8 heads, 4 KV heads, SwiGLU 688.

With ``--cp`` it measures context parallelism instead (cp = 2 and 4, t = 1 and t = 2 with SP, dropout 0):
rank 0 of a fake world (dryrun/fake_world.py, as `meshfit verify` runs one rank) builds the blocks with
parallel.cp, runs the forward of its part of the sequence on fake tensors under the same tracker, and the
plan column is `block_activation_bytes(..., cp=cp)`: the rank's seq/cp tokens plus the gathered keys and
values.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from meshfit.config import ParallelSection
from meshfit.models import build_model
from meshfit.models.presets import get_preset
from meshfit.parallel.dims import ParallelDims
from meshfit.parallel.parallelize import parallelize
from meshfit.planner.memory.activations import block_activation_bytes
from meshfit.planner.memory.formulas import activation_bytes_per_layer
from meshfit.util.ranks import run_ranks

CASES = [("gpt", "eager", 0.1), ("gpt", "flash", 0.0), ("llama", "flash", 0.0), ("llama", "eager", 0.0)]
LAYOUTS = [(1, False), (2, False), (2, True)]
POLICIES = ["none", "op", "attention"]


def model_config(family: str, attention: str, dropout: float, n_layers: int):
    base = get_preset("small-gpt" if family == "gpt" else "small")
    return dataclasses.replace(base, attention=attention, dropout=dropout, n_layers=n_layers)


def _forward_activations(cfg, t: int, sp: bool, policy: str, seq: int, batch: int) -> int:
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=t, pp=1)
    parallel = ParallelSection(tp=t, sp=sp, activation_checkpointing=policy)
    model = parallelize(build_model(cfg, "meta"), dims, dims.build_mesh("cpu"), cfg, parallel=parallel,
                        zero_stage=0, mixed_precision=True, device=torch.device("cpu"), seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(tokens)
        torch.distributed.barrier()  # after every rank's collectives of this forward, before counting
        snapshot = next(iter(tracker.get_tracker_snapshot().values()))
    return sum(v for k, v in snapshot.items() if str(k).endswith(("ACT", "TEMP")))


def block_job(family: str, attention: str, dropout: float, t: int, sp: bool, policy: str, seq: int,
              batch: int) -> float:
    """Bytes of one block on this rank: the activations of a 2-block model minus a 1-block model's."""
    two, one = (_forward_activations(model_config(family, attention, dropout, n), t, sp, policy, seq, batch)
                for n in (2, 1))
    return float(two - one)


def _fake_forward_activations(cfg, t: int, sp: bool, policy: str, seq: int, batch: int, cp: int) -> int:
    """Activations alive after the forward of cp rank 0 (its seq / cp tokens) in a fake world of cp · t."""
    from meshfit.dryrun.fake_world import fake_world
    from meshfit.parallel.context_parallel import shard_sequence

    with fake_world(cp * t, 0) as fake:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=t, pp=1, cp=cp)
        parallel = ParallelSection(tp=t, sp=sp, cp=cp, activation_checkpointing=policy)
        # ZeRO-3 over the cp ranks: mixed precision keeps no stage-0 replicas across them.
        model = parallelize(build_model(cfg, "meta"), dims, dims.build_mesh("cpu"), cfg, parallel=parallel,
                            zero_stage=3, mixed_precision=True, device=torch.device("cpu"), seed=0,
                            materialize=lambda: fake, seq_len=seq)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
        tracker = MemTracker()
        tracker.track_external(model)
        with fake, tracker:
            model(shard_sequence(tokens, cp, 0))
            snapshot = next(iter(tracker.get_tracker_snapshot().values()))
        return sum(v for k, v in snapshot.items() if str(k).endswith(("ACT", "TEMP")))


def cp_rows(seq: int, batch: int) -> None:
    print(f"{'family':<6} {'attention':<9} {'t':>2} {'SP':>3} {'policy':<9} {'cp':>2} {'measured':>9} {'plan':>7} "
          f"{'ratio':>6}   (units of s·b·h bytes per rank, s the whole sequence)")
    for family, attention, _ in CASES:
        cfg = model_config(family, attention, 0.0, 1)
        unit = seq * batch * cfg.dim
        for t, sp in ((1, False), (2, True)):
            for policy in POLICIES:
                for cp in (2, 4):
                    two, one = (_fake_forward_activations(model_config(family, attention, 0.0, n), t, sp, policy,
                                                          seq, batch, cp) for n in (2, 1))
                    plan = block_activation_bytes(cfg, mode="bf16", seq=seq, batch=batch, tp=t, sp=sp,
                                                  attention=attention, policy=policy, cp=cp)
                    print(f"{family:<6} {attention:<9} {t:>2} {'yes' if sp else 'no':>3} {policy:<9} {cp:>2} "
                          f"{(two - one) / unit:>9.3f} {plan / unit:>7.3f} {(two - one) / plan:>6.3f}", flush=True)


def literature(cfg, t: int, sp: bool, policy: str, seq: int, batch: int) -> float | None:
    if policy == "op":
        return None
    return activation_bytes_per_layer(
        s=seq, b=batch, h=cfg.dim, a=cfg.n_heads, t=t, sp=sp, recompute="selective" if policy == "attention" else "none",
        dropout=cfg.dropout > 0, attention=cfg.attention, family=cfg.family, ffn=cfg.ffn_hidden / cfg.dim,
        kv=cfg.n_kv_heads / cfg.n_heads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--cp", action="store_true", help="context-parallel rows (fake world) instead")
    args = parser.parse_args()
    if args.cp:
        cp_rows(args.seq, args.batch)
        return
    print(f"{'family':<6} {'attention':<9} {'t':>2} {'SP':>3} {'policy':<9} {'measured':>9} {'literature':>10} "
          f"{'ratio':>6} {'plan':>7} {'ratio':>6}   (units of s·b·h bytes per rank)")
    for family, attention, dropout in CASES:
        cfg = model_config(family, attention, dropout, 1)
        unit = args.seq * args.batch * cfg.dim
        for t, sp in LAYOUTS:
            for policy in POLICIES:
                measured = run_ranks(block_job, t, family, attention, dropout, t, sp, policy, args.seq,
                                     args.batch)[0]
                lit = literature(cfg, t, sp, policy, args.seq, args.batch)
                plan = block_activation_bytes(cfg, mode="bf16", seq=args.seq, batch=args.batch, tp=t, sp=sp,
                                              attention=attention, dropout=dropout, policy=policy)
                lit_s = f"{lit / unit:>10.2f} {measured / lit:>6.3f}" if lit else f"{'—':>10} {'':>6}"
                print(f"{family:<6} {attention:<9} {t:>2} {'yes' if sp else 'no':>3} {policy:<9} "
                      f"{measured / unit:>9.2f} {lit_s} {plan / unit:>7.2f} {measured / plan:>6.3f}", flush=True)


if __name__ == "__main__":
    main()
