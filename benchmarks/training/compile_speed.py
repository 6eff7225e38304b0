"""Eager vs compiled (train.compile) step time, with and without op-level recompute, on one CPU rank.

    python benchmarks/training/compile_speed.py [--preset small] [--seq-len 256] [--batch 4] [--rounds 8] [--threads 1]

Four runs of the same model, data and optimizer are built in this one process: eager and compiled, each
with activation_checkpointing none and op. Each runs two warm-up steps (the compiled ones compile there;
the time is printed), then the four take one step in turn for --rounds rounds, so the machine's drift
falls on all four alike. Printed: the median step time of each, compiled / eager, op / none within eager
and within compiled, and the first losses (which agree to fp32 rounding). No memory tracking
(train.memory_tracking=off), so every timed step of the compiled runs runs compiled.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshfit.config import load_config
from meshfit.parallel.compile import compile_seconds
from meshfit.train.dist import init_distributed
from meshfit.train.run import build_run
from meshfit.train.trainer import train_step

CASES = (("eager", "none"), ("eager", "op"), ("compiled", "none"), ("compiled", "op"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (one micro-batch)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = init_distributed("cpu")
    runs, losses = {}, {}
    for mode, ac in CASES:
        cfg = load_config(None, [f"model.preset={args.preset}", f"train.seq_len={args.seq_len}",
                                 f"train.global_batch={args.batch}", f"train.steps={args.rounds + 2}",
                                 "train.memory_tracking=off", "train.log_every=1000", "train.device=cpu",
                                 f"train.compile={'true' if mode == 'compiled' else 'false'}"],
                          sections={"parallel": {"activation_checkpointing": ac}})
        run = build_run(cfg, env, None)
        before, start = compile_seconds(), time.perf_counter()
        losses[(mode, ac)] = [train_step(run)["loss"] for _ in range(2)]
        print(f"{mode:8} ac={ac:4}: warm-up {time.perf_counter() - start:6.1f} s "
              f"(compiling {compile_seconds() - before:5.1f} s)", flush=True)
        runs[(mode, ac)] = run
    times: dict[tuple[str, str], list[float]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            times[case].append(train_step(runs[case])["step_time_s"])
    med = {case: statistics.median(t) for case, t in times.items()}
    low = {case: min(t) for case, t in times.items()}
    print(f"\nmodel {args.preset}, {args.batch} × {args.seq_len} tokens per step, 1 rank, "
          f"{args.threads} thread(s), medians of {args.rounds} interleaved steps after 2 warm-up steps")
    for case in CASES:
        print(f"  {case[0]:8} ac={case[1]:4}: {med[case] * 1e3:8.1f} ms/step (fastest {low[case] * 1e3:7.1f})   "
              f"first losses "
              f"{', '.join(f'{x:.6f}' for x in losses[case])}")
    def ratio(a: tuple[str, str], b: tuple[str, str]) -> str:
        return f"{med[a] / med[b]:.2f}× (fastest steps {low[a] / low[b]:.2f}×)"

    for ac in ("none", "op"):
        print(f"  compiled / eager, ac={ac}: {ratio(('compiled', ac), ('eager', ac))}")
    for mode in ("eager", "compiled"):
        print(f"  op / none, {mode}: {ratio((mode, 'op'), (mode, 'none'))}")


if __name__ == "__main__":
    main()
