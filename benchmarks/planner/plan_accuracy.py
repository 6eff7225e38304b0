"""The planner's per-rank peak against `meshfit verify` (fake-tensor dry run) and real CPU runs.

Run: python benchmarks/planner/plan_accuracy.py [--scale | --scale-only | --long] [--skip-real] [--only TEXT]
Small layouts (the `small` preset, fp32, seq 128, global batch 8) are predicted, dry-run and trained for
3 real steps on local gloo ranks; with --scale, large models at their real world size are predicted and
dry-run only; with --long, the `small` model at seq 2048 (context parallelism, recompute, pipelines) is
predicted and dry-run. Prints one row per layout kind: predicted, verify and real peaks of the most-loaded rank
and the errors, plus the wall time and memory of each dry run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import tempfile
from pathlib import Path

from meshfit.layout.layout import Layout, Workload
from meshfit.models.presets import get_preset
from meshfit.planner.memory.estimate import estimate_memory
from meshfit.util.units import fmt_bytes

SMALL = Workload(seq_len=128, global_batch=8, precision="fp32")
SMALL_CASES = [
    ("ddp", Layout(dp_replicate=2)),
    ("zero1", Layout(dp_shard=2, zero_stage=1)),
    ("zero2", Layout(dp_shard=2, zero_stage=2)),
    ("zero3", Layout(dp_shard=2, zero_stage=3)),
    ("zero3 + full AC", Layout(dp_shard=2, zero_stage=3, activation_checkpointing="full")),
    ("zero3 + offload", Layout(dp_shard=2, zero_stage=3, offload=True)),
    ("hsdp 2×2", Layout(dp_replicate=2, dp_shard=2, zero_stage=3)),
    ("tp 2 + sp", Layout(tp=2, sp=True, loss_parallel=True, micro_batch=2)),
    ("pp 2 1f1b", Layout(pp=2, schedule="1f1b")),
    ("pp 2 gpipe", Layout(pp=2, schedule="gpipe", micro_batch=2)),
    ("pp 2 interleaved", Layout(pp=2, schedule="interleaved-1f1b", virtual_stages=2)),
    ("pp 2 zbv", Layout(pp=2, schedule="zbv", virtual_stages=2)),
    ("3d pp2·fsdp2·tp2", Layout(pp=2, dp_shard=2, tp=2, zero_stage=3, sp=True, loss_parallel=True)),
    ("zero1 2 × tp 2 + sp", Layout(dp_shard=2, zero_stage=1, tp=2, sp=True)),
    ("ddp 2 × tp 2 + sp", Layout(dp_replicate=2, tp=2, sp=True)),
    ("3d pp2·zero1 2·tp2", Layout(pp=2, dp_shard=2, tp=2, zero_stage=1, sp=True)),
]
SCALE_CASES = [
    ("llama3-8b", "zero3 ×64", Layout(dp_shard=64, zero_stage=3), Workload(seq_len=2048, global_batch=64)),
    ("llama3-8b", "zero2 ×64", Layout(dp_shard=64, zero_stage=2), Workload(seq_len=2048, global_batch=64)),
    ("llama3-8b", "zero1 ×64", Layout(dp_shard=64, zero_stage=1), Workload(seq_len=2048, global_batch=64)),
    ("llama3-8b", "fsdp 8 × tp 8 + sp", Layout(dp_shard=8, tp=8, zero_stage=3, sp=True, loss_parallel=True),
     Workload(seq_len=4096, global_batch=64)),
    ("llama3-8b", "pp 4 × fsdp 16", Layout(pp=4, dp_shard=16, zero_stage=3), Workload(seq_len=2048, global_batch=128)),
    ("llama3-8b", "zero1 2 × tp 2 + sp × pp 2", Layout(dp_shard=2, zero_stage=1, tp=2, sp=True, pp=2),
     Workload(seq_len=4096, global_batch=32)),
    ("llama3-8b", "zero3 ×64, seq 8192, full AC", Layout(dp_shard=64, zero_stage=3, activation_checkpointing="full"),
     Workload(seq_len=8192, global_batch=64)),
    ("llama3-8b", "pp 4 × fsdp 16, m = p", Layout(pp=4, dp_shard=16, zero_stage=3), Workload(seq_len=2048, global_batch=64)),
    ("llama3-8b", "pp 4 interleaved × fsdp 16, m = p",
     Layout(pp=4, dp_shard=16, zero_stage=3, schedule="interleaved-1f1b", virtual_stages=2),
     Workload(seq_len=2048, global_batch=64)),
    ("llama3-8b", "pp 2 × fsdp 2 × tp 2 + sp", Layout(pp=2, dp_shard=2, tp=2, zero_stage=3, sp=True, loss_parallel=True),
     Workload(seq_len=4096, global_batch=16)),
    ("llama3-8b", "pp 4 zbv × zero1 2, full AC",
     Layout(pp=4, dp_shard=2, zero_stage=1, schedule="zbv", virtual_stages=2, activation_checkpointing="full"),
     Workload(seq_len=4096, global_batch=32)),
    ("llama3-70b", "zero3 ×256", Layout(dp_shard=256, zero_stage=3), Workload(seq_len=2048, global_batch=256)),
    ("llama3-70b", "fsdp 32 × tp 8 + sp, AC", Layout(dp_shard=32, tp=8, zero_stage=3, sp=True, loss_parallel=True,
                                                   activation_checkpointing="full"),
     Workload(seq_len=8192, global_batch=256)),
]


# Long sequences on `small` (max_seq_len 2048), where activations decide: context parallelism, recompute
# and pipelines, fp32 and mixed precision (docs/planner.md, "Context parallelism").
LONG_MODEL = dataclasses.replace(get_preset("small"), max_seq_len=2048)
LONG = Workload(seq_len=2048, global_batch=2, precision="fp32")
LONG_CASES = [
    (f"{name} {precision}", layout, dataclasses.replace(LONG, precision=precision))
    for precision in ("fp32", "mixed")
    for name, layout in [
        ("cp 1", Layout(zero_stage=3, micro_batch=1)),
        ("cp 2", Layout(cp=2, zero_stage=3, micro_batch=1)),
        ("cp 4", Layout(cp=4, zero_stage=3, micro_batch=1)),
        ("fsdp 2, full AC", Layout(dp_shard=2, zero_stage=3, micro_batch=1, activation_checkpointing="full")),
        ("cp 2, full AC", Layout(cp=2, zero_stage=3, micro_batch=1, activation_checkpointing="full")),
        ("cp 2 × tp 2 + sp", Layout(cp=2, tp=2, zero_stage=3, sp=True, loss_parallel=True, micro_batch=1)),
        ("cp 2 × pp 2", Layout(cp=2, pp=2, zero_stage=3, micro_batch=1)),
        ("pp 2 zbv", Layout(pp=2, schedule="zbv", virtual_stages=2, micro_batch=1)),
        ("pp 2 zbv, full AC", Layout(pp=2, schedule="zbv", virtual_stages=2, micro_batch=1,
                                     activation_checkpointing="full")),
    ]
    # Split-backward schedules do not train on mixed precision's FSDP-managed weights (layout/schedules.py).
    if precision == "fp32" or "zbv" not in name
]


def _verify(queue, model, layout, workload) -> None:
    from meshfit.dryrun.verify import verify_layout

    result = verify_layout(model, layout, workload)
    queue.put(result.to_dict())


def verify_in_subprocess(model, layout: Layout, workload: Workload) -> dict:
    # A fresh process per dry run: the RSS figure is then the dry run's own.
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_verify, args=(queue, model, layout, workload))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def real_peak(layout: Layout, workload: Workload) -> int:
    """Most-loaded rank's peak over steps 2..3 of a real run on local gloo ranks."""
    from meshfit.config import load_config
    from meshfit.planner.planfile import plan_sections
    from meshfit.train.launch import launch

    run_dir = Path(tempfile.mkdtemp(prefix="meshfit-accuracy-"))
    sections = plan_sections(get_preset("small"), workload, layout)
    sections["train"].update(steps=3, device="cpu")
    outcome = launch(load_config(None, sections=sections), run_dir, layout.world_size if layout.world_size > 1 else None)
    if not outcome.ok:
        raise RuntimeError(outcome.message)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # A CPU rank counts offloaded shards in its peak (the host is its own memory); the planner and verify
    # count a GPU's device memory, which does not hold them.
    return max(m["peak"] - m.get("offloaded", 0) for r in records if r["step"] >= 2 for m in r["mem"])


def _err(pred: float, meas: float | None) -> str:
    return f"{(pred - meas) / meas:+6.1%}" if meas else "     -"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", action="store_true", help="also the large models (verify only)")
    parser.add_argument("--skip-real", action="store_true", help="no real CPU runs")
    parser.add_argument("--scale-only", action="store_true", help="only the large models")
    parser.add_argument("--long", action="store_true", help="only the long-sequence cases on `small` (verify only)")
    parser.add_argument("--only", help="only the cases whose 'model layout' name contains this")
    parser.add_argument("--verbose", action="store_true", help="each large case's components, planned and dry-run")
    args = parser.parse_args()
    if args.long:
        long(args.only)
        return
    if not args.scale_only:
        small(args.skip_real)
    if args.scale or args.scale_only:
        scale(args.only, args.verbose)


def small(skip_real: bool) -> None:
    # The dry run stands in for NCCL ranks; real gloo ranks hold what `--gpu cpu` plans (backend "gloo").
    print(f"{'layout (small, fp32)':24s} {'predicted':>10s} {'verify':>10s} {'vs verify':>9s} {'CPU plan':>10s} "
          f"{'real':>10s} {'vs real':>8s}")
    for name, layout in SMALL_CASES:
        pred = estimate_memory(get_preset("small"), layout, SMALL).as_dict()["total"]
        cpu = estimate_memory(get_preset("small"), layout, SMALL, backend="gloo").as_dict()["total"]
        fake = verify_in_subprocess("small", layout, SMALL)["measured"]["total"]
        real = None if skip_real else real_peak(layout, SMALL)
        print(f"{name:24s} {fmt_bytes(pred):>10s} {fmt_bytes(fake):>10s} {_err(pred, fake):>9s} "
              f"{fmt_bytes(cpu):>10s} {fmt_bytes(real):>10s} {_err(cpu, real):>8s}", flush=True)


def long(only: str | None = None) -> None:
    print(f"\n{'layout (small, seq 2048)':30s} {'predicted':>10s} {'verify':>10s} {'error':>7s} "
          f"{'acts pred':>10s} {'acts verify':>11s}  phases (plan / dry run)")
    for name, layout, workload in LONG_CASES:
        if only and only not in name:
            continue
        est = estimate_memory(LONG_MODEL, layout, workload)
        res = verify_in_subprocess(LONG_MODEL, layout, workload)
        fake = res["measured"]
        print(f"{name:30s} {fmt_bytes(est.total):>10s} {fmt_bytes(fake['total']):>10s} "
              f"{_err(est.total, fake['total']):>7s} {fmt_bytes(est.activations):>10s} "
              f"{fmt_bytes(fake['activations']):>11s}  {est.phase} / {res['phase']}", flush=True)


def scale(only: str | None = None, verbose: bool = False) -> None:
    print(f"\n{'model':11s} {'layout (mixed precision)':34s} {'predicted':>10s} {'verify':>10s} {'error':>7s} "
          f"{'dry run':>8s} {'RSS':>10s}  phases (plan / dry run)")
    for preset, name, layout, workload in SCALE_CASES:
        if only and only not in f"{preset} {name}":
            continue
        est = estimate_memory(get_preset(preset), layout, workload)
        pred = est.as_dict()["total"]
        res = verify_in_subprocess(preset, layout, workload)
        fake = res["measured"]["total"]
        print(f"{preset:11s} {name:34s} {fmt_bytes(pred):>10s} {fmt_bytes(fake):>10s} {_err(pred, fake):>7s} "
              f"{res['wall_s']:7.1f}s {fmt_bytes(res['max_rss_bytes']):>10s}  {est.phase} / {res['phase']}",
              flush=True)
        if verbose:
            print("    plan   ", {k: fmt_bytes(v) for k, v in est.as_dict().items()}, f"pp rank {est.pp_rank}")
            print("    dry run", {k: fmt_bytes(v) for k, v in res["measured"].items()}, f"rank {res['rank']}",
                  flush=True)


if __name__ == "__main__":
    main()
