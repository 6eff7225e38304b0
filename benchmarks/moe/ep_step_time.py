"""Step time and peak memory of expert parallelism (ep 2) next to ZeRO-3 without it, 2 CPU ranks.

    python benchmarks/moe/ep_step_time.py [--preset small-moe] [--steps 12] [--repeats 4] [--micro-batch 8]

Both layouts train the same model from the same initialisation on the same global batch (16 × 128 tokens,
synthetic data), ZeRO-3 over the 2 ranks (`parallel.dp_shard=2`): `zero3` gathers every expert's weights on
both ranks (FSDP), `ep2` keeps 4 of the 8 experts per block on each rank and sends the tokens to them
(`parallel.ep=2`, two all-to-alls each way per MoE block). Runs alternate, zero3, ep2, zero3, ep2, …, so that
both see the same machine. Step time = median of the steps after the third of a run (the untracked ones
under `train.memory_tracking=auto`); the table gives the median over runs and the median of the ep2/zero3
ratio within each pair. Peak = each rank's highest tracked peak in the run (the tracker's, steps 1–3).
Figures, not a test: the host may be shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from meshfit.config import load_config
from meshfit.train.launch import launch
from meshfit.util.units import fmt_bytes

LAYOUTS = {"zero3": ["parallel.ep=1"], "ep2": ["parallel.ep=2"]}


def _run(base: list[str], overrides: list[str], run_dir: Path) -> tuple[float, list[int]]:
    outcome = launch(load_config(None, base + overrides), run_dir, 2)
    if not outcome.ok:
        raise SystemExit(f"{overrides} failed: {outcome.message}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["step_time_s"] for r in records if r["step"] > 3]
    peaks = [max(r["mem"][rank]["peak"] for r in records) for rank in range(2)]
    return statistics.median(steady), peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-moe")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()
    base = [f"model.preset={args.preset}", f"train.steps={args.steps}", "train.global_batch=16",
            "train.seq_len=128", f"train.micro_batch={args.micro_batch}", "train.log_every=1000",
            "parallel.dp_shard=2", "parallel.zero_stage=3", "checkpoint.at_end=false"]
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    peaks: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name, overrides in LAYOUTS.items():
                step, peaks[name] = _run(base, overrides, Path(tmp) / f"{name}-{rep}")
                times[name].append(step)
                print(f"run {rep + 1} {name}: {step * 1000:.1f} ms", flush=True)
    ratios = [ep / z for ep, z in zip(times["ep2"], times["zero3"], strict=True)]
    print(f"model {args.preset}, 2 ranks (gloo, 1 thread each), ZeRO-3, global batch 16 × 128 tokens, micro-batch "
          f"{args.micro_batch}, median of steps 4..{args.steps}, {args.repeats} runs each, interleaved")
    print(f"{'layout':8s} {'median ms':>10s} {'runs (ms)':>34s} {'peak rank 0':>12s} {'peak rank 1':>12s}")
    for name in LAYOUTS:
        runs = " ".join(f"{t * 1000:.0f}" for t in times[name])
        print(f"{name:8s} {statistics.median(times[name]) * 1000:10.1f} {runs:>34s} "
              f"{fmt_bytes(peaks[name][0]):>12s} {fmt_bytes(peaks[name][1]):>12s}")
    print(f"ep2 / zero3: ratio of medians {statistics.median(times['ep2']) / statistics.median(times['zero3']):.3f}, "
          f"median of pair ratios {statistics.median(ratios):.3f} (pairs: {' '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
