"""Inject every fault meshfit handles, several times, and print injections, recoveries and recovery times.

    python benchmarks/correctness/fault_drill.py [--repeats 3] [--out runs/fault-drill]

Each fault runs on CPU gloo ranks with the tiny model. "Recovered" means what the fault calls for:
  kill         a rank is SIGKILLed at a random step under --max-restarts 1; the run restarts and its 30
               losses equal an uninterrupted run's. Time: the run's wall time minus an uninterrupted run's.
  kill-in-save the only rank is killed at a random point of a save (10 points); the next --resume picks a
               complete checkpoint and the final losses equal an uninterrupted run's. Time: resume launch →
               first step.
  damaged      the latest checkpoint is truncated / bit-flipped / loses its marker; --resume falls back to
               the previous one. Time: resume launch → first step.
  nan          NaN gradients on one rank: with stop, every rank stops at that step (then --resume goes
               on); with skip, the step is skipped. Time: launch of the resume → first step (stop only).
  sigterm      SIGTERM to the launcher mid-run: it saves and exits 0, --resume finishes with the same
               losses. Time: signal → exit.
  hang         one rank hangs (train.timeout_s=4): every rank exits non-zero. Time: last step → last exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

BASE = ["model.preset=tiny", "train.steps=30", "train.global_batch=8", "train.seq_len=64", "train.seed=7",
        "parallel.dp_replicate=2", "checkpoint.interval=2"]
SINGLE = ["model.preset=tiny", "train.steps=14", "train.global_batch=8", "train.seq_len=64", "train.seed=7",
          "checkpoint.interval=1"]


def train(run_dir: Path, overrides: list[str], *extra: str, fault: str = "", nproc: int | None = 2,
          timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "MESHFIT_FAULT"}
    if fault:
        env["MESHFIT_FAULT"] = fault
    cmd = [sys.executable, "-m", "meshfit", "train", "--run-dir", str(run_dir), *extra,
           *(["--nproc", str(nproc)] if nproc else []), *(x for o in overrides for x in ("--set", o))]
    start = time.time()
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout), start


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir)]


def first_step_after(run_dir: Path, start: float) -> float:
    return min(r["time"] for r in records(run_dir) if r["time"] >= start) - start


def drill_kill(root: Path, rng: random.Random, reference: list[float], ref_wall: float,
               repeats: int) -> list[tuple[bool, float]]:
    """Time to recover: the faulted run's wall time minus the uninterrupted run's (restart + redone steps)."""
    out = []
    for i in range(repeats):
        run_dir, step = root / f"kill{i}", rng.randint(3, 28)
        proc, start = train(run_dir, BASE, "--max-restarts", "1", fault=f"kill:rank={rng.randint(0, 1)}:step={step}")
        out.append((proc.returncode == 0 and losses(run_dir) == reference, time.time() - start - ref_wall))
    return out


def drill_kill_in_save(root: Path, rng: random.Random, single_ref: list[float]) -> list[tuple[bool, float]]:
    from meshfit.train import checkpoint_store as store

    ref_dir = root / "single-ref"
    train(ref_dir, SINGLE, nproc=None)
    save_s = max(json.loads((ref_dir / "result.json").read_text())["checkpoint_save_s"])
    run_dir, safe, recovery = root / "kill-in-save", [], []
    for i in range(10):
        latest = store.complete_checkpoints(run_dir / "checkpoints")
        step = int(latest[0].name.removeprefix("step-")) + 1 if latest else 1
        fault = f"kill-in-save:rank=0:step={step}:delay={rng.uniform(0, 1.2 * save_s):.4f}"
        proc, start = train(run_dir, SINGLE, *(["--resume"] if i else []), fault=fault, nproc=None)
        if i:  # this launch recovered from the previous kill: time to its first step (read before a trim)
            recovery.append(first_step_after(run_dir, start))
        chosen, _ = store.choose(run_dir / "checkpoints")
        safe.append(proc.returncode == -signal.SIGKILL and (chosen is None or (chosen / store.MARKER).exists()))
    _, final_start = train(run_dir, SINGLE, "--resume", nproc=None)
    recovery.append(first_step_after(run_dir, final_start))
    final_ok = losses(run_dir) == single_ref
    return [(ok and final_ok, t) for ok, t in zip(safe, recovery, strict=True)]


def drill_damaged(root: Path) -> list[tuple[bool, float]]:
    out = []
    for damage in ("truncate", "flip", "marker"):
        run_dir = root / f"damaged-{damage}"
        train(run_dir, [*SINGLE, "train.steps=6", "checkpoint.interval=2"], nproc=None)
        latest = run_dir / "checkpoints" / "step-00000006"
        shard = latest / "__0_0.distcp"
        if damage == "truncate":
            shard.write_bytes(shard.read_bytes()[:1000])
        elif damage == "flip":
            raw = bytearray(shard.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            shard.write_bytes(bytes(raw))
        else:
            (latest / "meshfit.json").write_text("{")
        proc, start = train(run_dir, [*SINGLE, "train.steps=8", "checkpoint.interval=2"], "--resume", nproc=None)
        result = json.loads((run_dir / "result.json").read_text()) if proc.returncode == 0 else {}
        out.append((result.get("start_step") == 4, first_step_after(run_dir, start) if result else 0.0))
    return out


def drill_nan(root: Path, reference: list[float]) -> list[tuple[bool, float]]:
    run_dir = root / "nan-stop"
    stop, _ = train(run_dir, BASE, fault="nan-grad:rank=1:step=9")
    stopped = stop.returncode == 1 and "at step 9 on rank 1" in stop.stderr
    resumed, start = train(run_dir, BASE, "--resume")
    out = [(stopped and resumed.returncode == 0 and losses(run_dir) == reference, first_step_after(run_dir, start))]
    skip_dir = root / "nan-skip"
    skip, _ = train(skip_dir, [*BASE, "train.on_nonfinite=skip"], fault="nan-grad:rank=0:step=9")
    skipped = json.loads((skip_dir / "result.json").read_text())["skipped_steps"] if skip.returncode == 0 else []
    return [*out, (skipped == [9], 0.0)]


def drill_sigterm(root: Path, reference: list[float], repeats: int) -> list[tuple[bool, float]]:
    out = []
    for i in range(repeats):
        run_dir = root / f"sigterm{i}"
        cmd = [sys.executable, "-m", "meshfit", "train", "--run-dir", str(run_dir), "--nproc", "2",
               *(x for o in BASE for x in ("--set", o))]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3 + 4 * i):
            time.sleep(0.05)
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        took = time.time() - sent
        resumed, _ = train(run_dir, BASE, "--resume")
        out.append((code == 0 and resumed.returncode == 0 and losses(run_dir) == reference, took))
    return out


def drill_hang(root: Path, repeats: int) -> list[tuple[bool, float]]:
    out = []
    for i in range(repeats):
        run_dir = root / f"hang{i}"
        proc, _ = train(run_dir, [*BASE, "train.timeout_s=4"], fault=f"hang:rank={i % 2}:step=4")
        end = time.time()
        last = max(r["time"] for r in records(run_dir))
        out.append((proc.returncode != 0 and len(list((run_dir / "failures").glob("rank*.json"))) == 2, end - last))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/fault-drill"))
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    rng = random.Random(0)
    _, ref_start = train(args.out / "ref", BASE)
    ref_wall = time.time() - ref_start
    reference = losses(args.out / "ref")
    train(args.out / "single", SINGLE, nproc=None)
    single_ref = losses(args.out / "single")
    drills = {
        "kill (restart)": lambda: drill_kill(args.out, rng, reference, ref_wall, args.repeats),
        "kill during save": lambda: drill_kill_in_save(args.out, rng, single_ref),
        "damaged checkpoint": lambda: drill_damaged(args.out),
        "NaN gradient (stop, skip)": lambda: drill_nan(args.out, reference),
        "SIGTERM": lambda: drill_sigterm(args.out, reference, args.repeats),
        "hung rank (timeout 4 s)": lambda: drill_hang(args.out, args.repeats),
    }
    table = Table(title="fault drill (CPU, gloo, tiny model)")
    for col in ("fault", "injections", "recovered", "time to recover (s)"):
        table.add_column(col)
    for name, drill in drills.items():
        results = drill()
        times = [t for ok, t in results if ok and t > 0]
        spread = f"{min(times):.1f}–{max(times):.1f}" if times else "–"
        table.add_row(name, str(len(results)), str(sum(ok for ok, _ in results)), spread)
        print(name, results, flush=True)
    Console().print(table)


if __name__ == "__main__":
    main()
