"""Measured pipeline bubble per schedule vs theory (figures, not a test).

    python benchmarks/training/pipeline_bubble.py [--pp 2] [--microbatches 8] [--steps 4]

Each rank's idle time is the time it spends waiting for activations or gradients from its neighbours
(torch's schedules wait on every batch of point-to-point transfers; the wait is timed). The bubble is
idle / step time, averaged over ranks and steps 2..N. Theory (Narayanan et al. 2021):
GPipe and 1F1B (p−1)/(m+p−1); interleaved with v stages per rank (p−1)/(v·m+p−1); the zero-bubble
schedules split the weight-gradient work to fill the bubble (ideally near 0).
"""

from __future__ import annotations

import argparse
import time

import torch.distributed.pipelining.schedules as schedules

from meshfit.config import load_config
from meshfit.train.dist import init_distributed
from meshfit.train.run import build_run
from meshfit.train.trainer import train_step
from meshfit.util.ranks import run_ranks

THEORY_V = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "interleaved-zb": 2, "zbv": 2, "dualpipev": 2}


def job(overrides: list[str], steps: int) -> float:
    """Mean idle fraction of this rank over steps 2..N."""
    waited = [0.0]
    original = schedules._wait_batch_p2p

    def timed_wait(work):
        start = time.perf_counter()
        original(work)
        waited[0] += time.perf_counter() - start

    schedules._wait_batch_p2p = timed_wait
    run = build_run(load_config(None, overrides), init_distributed("cpu"), None)
    fractions = []
    for step in range(steps):
        waited[0] = 0.0
        rec = train_step(run)
        run.history.append(rec)
        if step > 0:
            fractions.append(waited[0] / rec["step_time_s"])
    return sum(fractions) / len(fractions)


def theory(schedule: str, p: int, m: int) -> float:
    v = THEORY_V[schedule]
    return (p - 1) / (v * m + p - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    base = ["model.preset=small", "model.n_layers=8", "train.global_batch=16", "train.seq_len=128",
            f"parallel.pp={args.pp}", f"pipeline.microbatches={args.microbatches}", "train.log_every=1000"]
    print(f"pp={args.pp}, m={args.microbatches} micro-batches; bubble = idle / step time (mean over ranks)")
    print(f"{'schedule':18s} {'measured':>9s} {'theory':>9s}")
    for name in THEORY_V:
        fractions = run_ranks(job, args.pp, base + [f"pipeline.schedule={name}"], args.steps)
        measured = sum(fractions) / len(fractions)
        note = "  (zero-bubble: ideally ≈ 0)" if name in ("interleaved-zb", "zbv", "dualpipev") else ""
        print(f"{name:18s} {measured:9.3f} {theory(name, args.pp, args.microbatches):9.3f}{note}", flush=True)


if __name__ == "__main__":
    main()
