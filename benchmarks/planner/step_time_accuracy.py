"""Predicted vs measured step time on CPU ranks, from a calibration made in the same run.

    python benchmarks/planner/step_time_accuracy.py [--steps 10] [--rounds 3] [--quick]

Each round runs `meshfit calibrate`'s measurement on every rank count used, then trains each layout of the
`small` preset (fp32, seq 256, global batch 16, AdamW) for --steps steps on local gloo ranks (every other
round in reverse order); a layout's measured step time is the median of its steps after the tracked ones
(train.memory_tracked_steps), its prediction `step_time` on a CPU device built from that round's calibration.
Prints every round's score, then per layout the median prediction and median measured time over the rounds,
their ratio, both rankings and Spearman's rank correlation. About 8 minutes per round on 2 cores. Figures,
not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from meshfit.calibrate.measure import calibrate
from meshfit.config import load_config
from meshfit.hardware.catalog import Cluster, cpu_device
from meshfit.layout.layout import Layout, Workload
from meshfit.models.config import ModelConfig
from meshfit.models.presets import get_preset
from meshfit.planner.planfile import plan_sections
from meshfit.planner.timing.estimate import step_time
from meshfit.train.launch import launch

MODEL = get_preset("small")
WORK = Workload(seq_len=256, global_batch=16, precision="fp32")
LAYOUTS = {
    "ddp": Layout(dp_replicate=2, micro_batch=8),
    "ddp accum": Layout(dp_replicate=2, micro_batch=2),
    "zero1": Layout(dp_shard=2, zero_stage=1, micro_batch=8),
    "zero2 accum": Layout(dp_shard=2, zero_stage=2, micro_batch=4),
    "zero3": Layout(dp_shard=2, zero_stage=3, micro_batch=8),
    "zero3 full ac": Layout(dp_shard=2, zero_stage=3, micro_batch=8, activation_checkpointing="full"),
    "tp2": Layout(tp=2, micro_batch=8),
    "tp2 sp": Layout(tp=2, sp=True, loss_parallel=True, micro_batch=8),
    "pp2 gpipe": Layout(pp=2, schedule="gpipe", micro_batch=4),
    "pp2 1f1b": Layout(pp=2, schedule="1f1b", micro_batch=2),
    "pp2 interleaved": Layout(pp=2, schedule="interleaved-1f1b", virtual_stages=2, micro_batch=2),
    "hsdp 2x2": Layout(dp_replicate=2, dp_shard=2, zero_stage=3, micro_batch=4),
    "pp2 x zero1 2": Layout(pp=2, dp_shard=2, zero_stage=1, schedule="1f1b", micro_batch=2),
    "tp2 x zero3 2": Layout(tp=2, dp_shard=2, zero_stage=3, micro_batch=8),
}


def measured(layout: Layout, steps: int, root: Path, model: ModelConfig = MODEL, work: Workload = WORK) -> float:
    """Median seconds of the steady steps of ``layout`` trained for ``steps`` steps on local CPU ranks."""
    sections = plan_sections(model, work, layout)
    sections["train"].update(steps=steps, device="cpu", log_every=1000)
    run_dir = root / f"{layout.describe()}-s{work.seq_len}-b{work.global_batch}-c{int(work.compiled)}".replace(" ", "")
    outcome = launch(load_config(None, sections=sections), run_dir, layout.world_size)
    if not outcome.ok:
        raise SystemExit(f"{layout.describe()} failed: {outcome.message}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tracked = load_config(None, sections=sections).train.memory_tracked_steps
    steady = [r["step_time_s"] for r in records if r["step"] > tracked] or [r["step_time_s"] for r in records[1:]]
    return statistics.median(steady)


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for position, index in enumerate(order):
        out[index] = float(position)
    return out


def _round(names: list[str], steps: int, quick: bool, reverse: bool, root: Path) -> dict[str, tuple]:
    """One calibration per rank count, then every layout trained once (in reverse order on odd rounds, so
    that drift of the shared machine does not favour the layouts run first): {name: (prediction, seconds)}."""
    root.mkdir(parents=True)
    profiles = {}
    for n in sorted({LAYOUTS[name].world_size for name in names}):
        profiles[n] = calibrate(n, quick=quick, model=MODEL, seq=WORK.seq_len)
        print(f"calibrated {n} ranks in {profiles[n].seconds:.0f} s", flush=True)
    out = {}
    for name in reversed(names) if reverse else names:
        layout = LAYOUTS[name]
        world = layout.world_size
        cluster = Cluster(cpu_device(2**40, profiles[world]), nodes=1, gpus_per_node=world)
        predicted = step_time(MODEL, layout, WORK, cluster)
        real = measured(layout, steps, root)
        out[name] = (predicted, real)
        print(f"{name:18s} ranks {world}  predicted {predicted.total_s * 1e3:7.0f} ms  measured "
              f"{real * 1e3:7.0f} ms  ratio {predicted.total_s / real:5.2f}", flush=True)
    return out


def score(pred: list[float], real: list[float]) -> tuple[int, float]:
    """(layouts within 25%, Spearman rank correlation; nan for fewer than two layouts, as with --only)."""
    within = sum(abs(p / m - 1) <= 0.25 for p, m in zip(pred, real, strict=True))
    return within, statistics.correlation(ranks(pred), ranks(real)) if len(pred) > 1 else float("nan")


def checked_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """--rounds, --steps and --only as both step-time benchmarks take them (the parser has the first two)."""
    parser.add_argument("--quick", action="store_true", help="quick calibration")
    parser.add_argument("--only", default="", help="comma-separated layout names")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps <= load_config(None).train.memory_tracked_steps:
        parser.error("--rounds must be at least 1 and --steps more than train.memory_tracked_steps")
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="calibrate-then-train rounds; medians are compared")
    args = checked_args(parser)
    names = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        rounds = [_round(names, args.steps, args.quick, r % 2 == 1, Path(tmp) / str(r)) for r in range(args.rounds)]
    for r, result in enumerate(rounds, 1):
        within, rho = score([result[n][0].total_s for n in names], [result[n][1] for n in names])
        print(f"round {r} alone: within 25%: {within} of {len(names)}; Spearman {rho:.2f}")
    # Per layout: the median prediction (over the rounds' calibrations) and the median measured time (the
    # lower middle value of an even count, for both).
    rows = []
    for name in names:
        preds = sorted((result[name][0] for result in rounds), key=lambda t: t.total_s)
        rows.append((name, LAYOUTS[name].world_size, preds[(len(preds) - 1) // 2],
                     statistics.median_low(result[name][1] for result in rounds)))
    pred = [r[2].total_s for r in rows]
    real = [r[3] for r in rows]
    print(f"\nsmall preset, fp32, seq {WORK.seq_len}, global batch {WORK.global_batch}; medians over {args.rounds} "
          f"rounds of the predictions and of the measured steady-step medians")
    print(f"{'layout':18s} {'ranks':>5s} {'pred ms':>8s} {'meas ms':>8s} {'ratio':>6s} {'rank p':>6s} {'rank m':>6s}"
          f"  compute / tp / dp / pp / bubble / optimizer ms")
    rp, rm = ranks(pred), ranks(real)
    for (name, world, p, m), a, b in zip(rows, rp, rm, strict=True):
        parts = " / ".join(f"{v * 1e3:.0f}" for v in (p.compute_s, p.tp_comm_s, p.dp_comm_s, p.pp_comm_s,
                                                      p.bubble_s, p.optimizer_s))
        print(f"{name:18s} {world:5d} {p.total_s * 1e3:8.0f} {m * 1e3:8.0f} {p.total_s / m:6.2f} {a + 1:6.0f} "
              f"{b + 1:6.0f}  {parts}")
    within, rho = score(pred, real)
    print(f"within 25%: {within} of {len(rows)}; Spearman rank correlation {rho:.2f}")


if __name__ == "__main__":
    main()
