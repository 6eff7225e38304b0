"""meshfit and DeepSpeed step by step inside the same two processes: the step-time ratio without run-to-run noise.

    .venv-peers/bin/python benchmarks/peers/vs_deepspeed_interleaved.py [--steps N] [--only ddp,pp]

vs_deepspeed.py runs each engine in its own processes, so every ratio also carries how fast the shared
host happened to be during each run (its pairs of a layout spread over ±10-20% here). This one builds both
engines in the same 2 gloo rank processes (one intra-op thread each) — the same model, data, optimizer,
schedule, clipping and layout as vs_deepspeed.py, whose pieces it reuses — and alternates their steps
(meshfit, DeepSpeed, DeepSpeed, meshfit, ...), with a barrier before each, so both see the same machine
within a second. meshfit steps through its trainer's own `train_step` with its step guard, default
settings (the heap settings of memory/host_heap.py apply to both engines here, as the processes are shared);
DeepSpeed through vs_deepspeed's loop. Per layout it prints the median step time of each engine
over the steady steps, the median of the per-step ratios with a 95% bootstrap interval, and the largest
loss difference (the two engines see the same batches, so their losses agree step by step).

A launch's interval covers only its own steps, yet launches of the same code differ by more than that
(ZeRO-1 gave 0.990 in one launch and 1.037 in another): something fixed for a launch (where the heap and
the ranks happened to land) weighs on each engine differently. With `--launches N` each layout runs N
times, the layouts in rotation, and the last line per layout pools them: the median of the launch
medians, with a 95% interval from resampling launches and then steps within each (a ratio that holds
across launches, not just within one). With 3 launches that interval is too narrow: in 600 simulated
layouts (launch spread 2.5%, step noise 5%, 38 steps) it missed the true ratio in 13% of them, against
5-7% with 5 or 10 launches. Use 5 or more where the answer is close to 1.

Peak memory cannot be told apart inside one process: vs_deepspeed.py measures it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_deepspeed as vs  # noqa: E402  (the shared layouts, model, data and DeepSpeed loop)


def build_meshfit(layout: str, steps: int) -> Any:
    """meshfit's Run for `layout` in this rank process, with its step guard (no faults, stop or checkpoints)."""
    import torch
    import torch.distributed as dist

    from meshfit.config import load_config
    from meshfit.train.dist import RankEnv
    from meshfit.train.guard import StepGuard
    from meshfit.train.run import build_run

    rank, world = dist.get_rank(), dist.get_world_size()
    run = build_run(load_config(None, vs.overrides(layout, steps)), RankEnv(rank, world, rank, torch.device("cpu")),
                    None)
    return run, StepGuard(run, faults=None, stop=None, checkpointer=None)


def worker(layout: str, steps: int) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from meshfit.data import TokenBatches, make_source
    from meshfit.memory.host_heap import keep_freed_blocks
    from meshfit.train.trainer import train_step

    torch.set_num_threads(1)
    # What `meshfit train` sets in each CPU rank; the process is shared, so DeepSpeed's steps run under it too.
    keep_freed_blocks()
    deepspeed.init_distributed(dist_backend="gloo")
    run, guard = build_meshfit(layout, steps)
    cfg_model = run.cfg.model.resolve()
    pipeline = vs.LAYOUTS[layout][1] is None
    dp_size, dp_rank = (1, 0) if pipeline else (dist.get_world_size(), dist.get_rank())
    engine = vs._build_engine(layout, run.cfg, cfg_model, dp_size)
    source = make_source("synthetic", path=None, vocab_size=cfg_model.vocab_size, seed=vs.SEED)
    batches = TokenBatches(source, seq_len=vs.SEQ_LEN, global_batch=vs.GLOBAL_BATCH, dp_rank=dp_rank,
                           dp_size=dp_size)
    times: dict[str, list[float]] = {"meshfit": [], "deepspeed": []}
    losses: dict[str, list[float]] = {"meshfit": [], "deepspeed": []}
    for step in range(steps):
        for name in ("meshfit", "deepspeed") if step % 2 == 0 else ("deepspeed", "meshfit"):
            dist.barrier()
            start = time.perf_counter()
            if name == "meshfit":
                loss = train_step(run, guard)["loss"]
            else:
                loss = vs._train_step(engine, batches, cfg_model.vocab_size, pipeline)
            times[name].append(time.perf_counter() - start)
            losses[name].append(loss)
    if dist.get_rank() == 0:
        print("@result " + json.dumps({"times": times, "losses": losses}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _interval(estimates: list[float], rounds: int) -> tuple[float, float]:
    estimates = sorted(estimates)
    return estimates[int(0.025 * rounds)], estimates[int(0.975 * rounds) - 1]


def bootstrap(launches: list[list[float]], rounds: int = 2000) -> tuple[float, float]:
    """95% interval of the median of per-launch median ratios: launches resampled, then steps in each.

    With one launch it is the plain bootstrap of that launch's median ratio."""
    rng = random.Random(0)
    estimates = []
    for _ in range(rounds):
        picked = rng.choices(launches, k=len(launches))
        estimates.append(statistics.median(statistics.median(rng.choices(r, k=len(r))) for r in picked))
    return _interval(estimates, rounds)


@dataclass
class Launch:
    """One launch of a layout: per steady step, the ratio meshfit / DeepSpeed and both times."""

    meshfit: list[float]
    deepspeed: list[float]
    dloss: float

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.meshfit, self.deepspeed, strict=True)]


def launch_from(times: dict[str, list[float]], losses: dict[str, list[float]]) -> Launch:
    steady = slice(vs.FIRST_STEADY - 1, None)
    dloss = max(abs(a - b) for a, b in zip(losses["meshfit"], losses["deepspeed"], strict=True))
    return Launch(times["meshfit"][steady], times["deepspeed"][steady], dloss)


def summarize(layout: str, launches: list[Launch], label: str = "") -> str:
    """One table row: median times and ratio of `launches` (one launch, or all of a layout pooled)."""
    low, high = bootstrap([launch.ratios for launch in launches])
    medians = [statistics.median(launch.ratios) for launch in launches]
    mf = statistics.median(statistics.median(launch.meshfit) for launch in launches)
    ds = statistics.median(statistics.median(launch.deepspeed) for launch in launches)
    steps = sum(len(launch.ratios) for launch in launches)
    dloss = max(launch.dloss for launch in launches)
    return (f"{layout + label:14s} {mf * 1e3:8.0f} {ds * 1e3:8.0f}   "
            f"{statistics.median(medians):6.3f} [{low:.3f}–{high:.3f}]   {steps:5d}   {dloss:.1e}")


def launch_worker(script: str, layout: str, steps: int) -> dict[str, Any]:
    """Run `script --worker` on 2 rank processes under torchrun; returns what rank 0 printed after "@result "."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(vs.NPROC),
           str(Path(script).resolve()), "--worker", "--layout", layout, "--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    marker = next((line for line in proc.stdout.splitlines() if line.startswith("@result ")), None)
    if proc.returncode != 0 or marker is None:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise SystemExit(f"{layout}: the run of {Path(script).name} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(marker.removeprefix("@result "))


def run_layout(layout: str, steps: int) -> Launch:
    result = launch_worker(__file__, layout, steps)
    return launch_from(result["times"], result["losses"])


def checked_layouts(parser: argparse.ArgumentParser, only: str, steps: int, allowed: list[str],
                    refused: dict[str, str] | None = None) -> list[str]:
    """The layouts named by --only (each once, in order), or a usage error; checks --steps too.
    `refused`: layouts this script cannot run, with the reason."""
    layouts = list(dict.fromkeys(name.strip() for name in only.split(",") if name.strip()))
    for name in layouts:
        if name not in allowed:
            why = (refused or {}).get(name, "unknown layout")
            parser.error(f"--only: {name}: {why}; choose from {', '.join(allowed)}")
    if steps <= vs.FIRST_STEADY:
        parser.error(f"--steps must be > {vs.FIRST_STEADY} (steps 1..{vs.FIRST_STEADY - 1} are warm-up)")
    return layouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per engine and layout (default 40)")
    parser.add_argument("--only", default=",".join(vs.LAYOUTS), help=f"subset of {','.join(vs.LAYOUTS)}")
    parser.add_argument("--launches", type=int, default=1,
                        help="launches per layout, layouts in rotation; pooled per layout at the end (default 1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.layout, args.steps)
        return
    vs.require_deepspeed(parser)
    layouts = checked_layouts(parser, args.only, args.steps, list(vs.LAYOUTS))
    if args.launches < 1:
        parser.error("--launches must be ≥ 1")
    print(f"meshfit / DeepSpeed step by step in the same processes: model {vs.PRESET}, {vs.NPROC} gloo ranks × 1 "
          f"thread, global batch {vs.GLOBAL_BATCH} × {vs.SEQ_LEN}, micro-batch {vs.MICRO}, fp32; steady steps "
          f"{vs.FIRST_STEADY}..{args.steps}")
    print(f"{'layout':14s} {'mf ms':>8s} {'ds ms':>8s}   {'ratio [95% interval]':>22s}   {'steps':>5s}   max |Δloss|")
    results: dict[str, list[Launch]] = {layout: [] for layout in layouts}
    for index in range(args.launches):
        for layout in layouts:
            results[layout].append(run_layout(layout, args.steps))
            label = f" #{index + 1}" if args.launches > 1 else ""
            print(summarize(layout, results[layout][-1:], label), flush=True)
    if args.launches > 1:
        print(f"pooled over {args.launches} launches: median of the launch medians, launches and steps resampled")
        for layout in layouts:
            print(summarize(layout, results[layout]), flush=True)


if __name__ == "__main__":
    main()
