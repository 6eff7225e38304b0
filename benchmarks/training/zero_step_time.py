"""Step time of DDP, ZeRO-1/2/3 and a 2-stage pipeline on 2 ranks, with the memory tracker on every step
("full") and with meshfit's default ("auto": tracked for the first 3 steps, then carried over).

    python benchmarks/training/zero_step_time.py [--steps 10] [--repeats 2] [--preset small] [--micro-batch 4]

All runs train the same model on the same global batch (16 × 128 tokens) in this one invocation, the two
tracking modes back to back for each layout and repeat (alternating which goes first). Step time = median
of the steps after the third (the steady steps, untracked under "auto"); the table gives the median over
repeats and the full/auto ratio inside each pair. Figures, not a test: the machine may be shared.
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

LAYOUTS = {
    "ddp": ["parallel.dp_replicate=2"],
    "zero1": ["parallel.dp_shard=2", "parallel.zero_stage=1"],
    "zero2": ["parallel.dp_shard=2", "parallel.zero_stage=2"],
    "zero3": ["parallel.dp_shard=2", "parallel.zero_stage=3"],
    "pp2 1f1b": ["parallel.pp=2", "pipeline.schedule=1f1b", "pipeline.microbatches=4"],
}
MODES = ("auto", "full")


def _run(base: list[str], overrides: list[str], mode: str, run_dir: Path) -> tuple[float, int]:
    outcome = launch(load_config(None, base + overrides + [f"train.memory_tracking={mode}"]), run_dir, 2)
    if not outcome.ok:
        raise SystemExit(f"{overrides} ({mode}) failed: {outcome.message}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["step_time_s"] for r in records if r["step"] > 3]
    return statistics.median(steady), outcome.result["peak_mem_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    base = [f"model.preset={args.preset}", f"train.steps={args.steps}", "train.global_batch=16",
            "train.seq_len=128", "train.log_every=1000"]
    times: dict[tuple[str, str], list[float]] = {}
    ratios: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name, overrides in LAYOUTS.items():
                pair = {}
                for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                    # A pipeline splits its batch into pipeline.microbatches instead.
                    batch = [] if "parallel.pp=2" in overrides else [f"train.micro_batch={args.micro_batch}"]
                    pair[mode], peaks[name] = _run(base + batch, overrides, mode, Path(tmp) / f"{name}-{mode}-{rep}")
                    times.setdefault((name, mode), []).append(pair[mode])
                ratios.setdefault(name, []).append(pair["full"] / pair["auto"])
    print(f"model {args.preset}, 2 ranks, global batch 16 × 128 tokens, micro-batch {args.micro_batch}, "
          f"median of steps 4..{args.steps}, {args.repeats} repeats")
    print(f"{'layout':10s} {'auto ms':>9s} {'full ms':>9s} {'full/auto':>10s} {'vs DDP (auto)':>14s} {'peak':>10s}")
    ddp = statistics.median(times[("ddp", "auto")])
    for name in LAYOUTS:
        auto, full = (statistics.median(times[(name, m)]) for m in MODES)
        print(f"{name:10s} {auto * 1000:9.1f} {full * 1000:9.1f} {statistics.median(ratios[name]):10.2f} "
              f"{auto / ddp:14.2f} {fmt_bytes(peaks[name]):>10s}")


if __name__ == "__main__":
    main()
