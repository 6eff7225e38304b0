"""Step time, peak memory and loss of meshfit next to DeepSpeed at equal work on 2 CPU ranks (figures, not a test).

    .venv-peers/bin/python benchmarks/peers/vs_deepspeed.py [--repeats N] [--steps N] [--only ddp,zero1]

Both engines train meshfit's `small` preset (built by meshfit.models.build_model, initialized by
meshfit.models.init_weights with the same seed, fp32) on 2 gloo ranks with one intra-op thread per rank:
global batch 16 sequences × 128 tokens, micro-batches of 4 sequences (2 accumulation steps per rank), the
same synthetic token rows per data-parallel rank (meshfit.data.TokenBatches), meshfit's AdamW (plain
torch.optim.AdamW, fused), LR schedule and gradient clipping (meshfit.train.optim and the config defaults).

Layouts (meshfit settings / DeepSpeed counterpart):
  ddp    parallel.dp_replicate=2                        ZeRO stage 0
  zero1  parallel.dp_shard=2, parallel.zero_stage=1     ZeRO stage 1   (zero2, zero3 alike)
  pp     parallel.pp=2, pipeline.schedule=1f1b, 4 micro-batches   PipelineModule, 2 stages, ZeRO stage 0
         (the stages are meshfit's own split; their parameters are marked model-parallel so that DeepSpeed's
         clipping norm covers both stages, see MeshfitStage)

meshfit runs through its own command line (`python -m meshfit train --nproc 2 --set ...`, default settings
except that no checkpoint is written at the end, as DeepSpeed writes none); per-step times and losses come
from the run's metrics.jsonl. DeepSpeed runs this file under torchrun with `--deepspeed-worker`
(DS_ACCELERATOR=cpu, deepspeed.init_distributed(dist_backend='gloo')). Step time is the median of steps
3..N on rank 0 (data fetch to loss); peak RSS is VmHWM of every rank process, sampled from /proc until it
exits, the same for both; the loss difference is the largest |Δloss| over the steps. Each repeat runs the
two engines back to back per layout, alternating which goes first; the table gives ratios inside each pair.

DeepSpeed is a dependency of this benchmark only: nothing under src/ imports it. The environment, on a
CPU-only machine:

    python3 -m venv .venv-peers && . .venv-peers/bin/activate
    pip install torch==2.13.0
    pip install einops hjson msgpack ninja numpy 'packaging>=20.0' psutil py-cpuinfo 'pydantic>=2.0.0' tqdm wheel
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip install --no-build-isolation deepspeed==0.19.8
    pip install -e .

DeepSpeed's first start JIT-compiles a small communication op once (cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PRESET, SEED, GLOBAL_BATCH, SEQ_LEN, MICRO, NPROC = "small", 0, 16, 128, 4, 2
LAYOUTS: dict[str, tuple[list[str], int | None]] = {  # meshfit overrides, DeepSpeed ZeRO stage (None: pipeline)
    "ddp": (["parallel.dp_replicate=2", f"train.micro_batch={MICRO}"], 0),
    "zero1": (["parallel.dp_shard=2", "parallel.zero_stage=1", f"train.micro_batch={MICRO}"], 1),
    "zero2": (["parallel.dp_shard=2", "parallel.zero_stage=2", f"train.micro_batch={MICRO}"], 2),
    "zero3": (["parallel.dp_shard=2", "parallel.zero_stage=3", f"train.micro_batch={MICRO}"], 3),
    "pp": (["parallel.pp=2", "pipeline.schedule=1f1b", f"pipeline.microbatches={GLOBAL_BATCH // MICRO}"], None),
}
FIRST_STEADY = 3  # steps 1-2 build optimizer states and buckets


def overrides(layout: str, steps: int) -> list[str]:
    base = [f"model.preset={PRESET}", f"train.seed={SEED}", f"train.steps={steps}",
            f"train.global_batch={GLOBAL_BATCH}", f"train.seq_len={SEQ_LEN}", "train.precision=fp32",
            "checkpoint.at_end=false"]
    return base + LAYOUTS[layout][0]


# ---------------------------------------------------------------- measuring rank processes (parent side)

def _vmhwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakRSS(threading.Thread):
    """Samples VmHWM of every descendant whose command line holds `marker`, keyed by its RANK, until exit."""

    def __init__(self, proc: subprocess.Popen, marker: str, interval: float = 0.05):
        super().__init__(daemon=True)
        self.proc, self.marker, self.interval = proc, marker, interval
        self.peaks: dict[int, int] = {}
        self.ranks: dict[int, int] = {}  # pid -> rank

    def _sample(self) -> None:
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            try:
                if child.pid not in self.ranks:
                    if self.marker not in " ".join(child.cmdline()):
                        continue
                    self.ranks[child.pid] = int(child.environ().get("RANK", -1))
            except (psutil.Error, ValueError):
                continue
            hwm = _vmhwm(child.pid)
            if hwm is not None:
                rank = self.ranks[child.pid]
                self.peaks[rank] = max(self.peaks.get(rank, 0), hwm)

    def run(self) -> None:
        while self.proc.poll() is None:
            self._sample()
            time.sleep(self.interval)


def run_ranks(cmd: list[str], marker: str, log: Path, extra_env: dict[str, str]) -> dict[int, int]:
    """Run `cmd` to completion; returns peak RSS per rank. Raises with the log's tail when it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra_env}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        sampler = PeakRSS(proc, marker)
        sampler.start()
        proc.wait()
        sampler.join()
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"{' '.join(cmd[:4])} … exited with {proc.returncode}:\n{tail}")
    return sampler.peaks


def run_meshfit(layout: str, steps: int, tmp: Path) -> dict[str, Any]:
    run_dir = tmp / f"meshfit-{layout}"
    # Every repeat starts a fresh run in the same directory.
    cmd = [sys.executable, "-m", "meshfit", "train", "--nproc", str(NPROC), "--run-dir", str(run_dir), "--overwrite"]
    for item in overrides(layout, steps):
        cmd += ["--set", item]
    peaks = run_ranks(cmd, "meshfit.train.worker", tmp / f"meshfit-{layout}.log", {})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {"times": [r["step_time_s"] for r in records], "losses": [r["loss"] for r in records], "rss": peaks}


def run_deepspeed(layout: str, steps: int, tmp: Path) -> dict[str, Any]:
    out = tmp / f"deepspeed-{layout}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC),
           str(Path(__file__).resolve()), "--deepspeed-worker", "--layout", layout, "--steps", str(steps),
           "--out", str(out)]
    peaks = run_ranks(cmd, "--deepspeed-worker", tmp / f"deepspeed-{layout}.log", {"DS_ACCELERATOR": "cpu"})
    return {**json.loads(out.read_text()), "rss": peaks}


# ---------------------------------------------------------------- DeepSpeed worker (one rank under torchrun)

def _stage_class():  # defined lazily: the parent process never imports torch
    import torch
    from torch import nn

    from meshfit.models import build_model, init_weights
    from meshfit.parallel.pipeline_parallel import cut_stage

    class MeshfitStage(nn.Module):
        """One pipeline stage cut from meshfit's model exactly as meshfit cuts it (same layers, same init)."""

        def __init__(self, model_cfg: Any, layer_ids: tuple[int, ...], first: bool, last: bool):
            super().__init__()
            self.model = cut_stage(build_model(model_cfg, "meta"), layer_ids, first, last)
            self.model.to_empty(device="cpu")
            init_weights(self.model, SEED, model_cfg)  # names inside self.model are the full model's
            # DeepSpeed's fp32 clipping under a PipelineModule skips, on every pipeline rank but the first,
            # parameters not marked model-parallel: its norm then misses the second stage's gradients and
            # the losses part from meshfit's after step 2. Marked, each stage's gradients count once.
            for p in self.parameters():
                p.model_parallel = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

    return MeshfitStage


def _ds_config(stage: int, accum: int, clip: float) -> dict[str, Any]:
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": accum, "gradient_clipping": clip,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def _build_engine(layout: str, cfg: Any, model_cfg: Any, dp_size: int) -> Any:
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from meshfit.models import build_model, init_weights
    from meshfit.models.loss import lm_loss
    from meshfit.parallel.pipeline_parallel import plan_stages
    from meshfit.train.optim import build_optimizer, build_scheduler

    torch.manual_seed(SEED)
    stage = LAYOUTS[layout][1]
    if stage is None:
        plan = plan_stages(model_cfg, SEQ_LEN, NPROC, 1, cfg.pipeline.schedule, None)
        Stage, last = _stage_class(), plan.n_stages - 1
        specs = [LayerSpec(Stage, model_cfg, ids, sid == 0, sid == last) for sid, ids in enumerate(plan.layers)]
        model = PipelineModule(specs, num_stages=NPROC, partition_method="uniform",
                               loss_fn=lambda logits, y: lm_loss(logits, y, model_cfg.vocab_size))
        stage, accum = 0, GLOBAL_BATCH // MICRO
    else:
        model = build_model(model_cfg, "meta")
        model.to_empty(device="cpu")
        init_weights(model, SEED, model_cfg)
        accum = GLOBAL_BATCH // dp_size // MICRO
    optimizer = build_optimizer(model, cfg.train)  # plain torch.optim.AdamW(fused=True), meshfit's groups
    assert type(optimizer) is torch.optim.AdamW
    scheduler = build_scheduler(optimizer, cfg.train)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=_ds_config(stage, accum, cfg.train.grad_clip))
    return engine


def _train_step(engine: Any, batches: Any, vocab: int, pipeline: bool) -> float:
    import torch
    import torch.distributed as dist

    from meshfit.models.loss import lm_loss

    inputs, targets = batches.next_batch()
    pairs = list(zip(inputs.split(MICRO), targets.split(MICRO), strict=True))
    if pipeline:
        return float(engine.train_batch(iter(pairs)))
    losses = []
    for x, y in pairs:
        loss = lm_loss(engine(x), y, vocab)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    mean = torch.stack(losses).mean()
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def deepspeed_worker(layout: str, steps: int, out: Path) -> None:
    import logging

    import torch

    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import logger

    from meshfit.config import load_config
    from meshfit.data import TokenBatches, make_source

    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config(None, overrides(layout, steps))
    model_cfg = cfg.model.resolve()
    pipeline = LAYOUTS[layout][1] is None
    dp_size, dp_rank = (1, 0) if pipeline else (dist.get_world_size(), dist.get_rank())
    engine = _build_engine(layout, cfg, model_cfg, dp_size)
    source = make_source("synthetic", path=None, vocab_size=model_cfg.vocab_size, seed=SEED)
    batches = TokenBatches(source, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, dp_rank=dp_rank, dp_size=dp_size)
    times, losses, lrs = [], [], []
    for _ in range(steps):
        lrs.append(engine.get_lr()[0])
        start = time.perf_counter()
        losses.append(_train_step(engine, batches, model_cfg.vocab_size, pipeline))
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"times": times, "losses": losses, "lrs": lrs, "threads": torch.get_num_threads()}))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- comparison (parent side)

def compare(mf: dict[str, Any], ds: dict[str, Any]) -> dict[str, float]:
    steady = slice(FIRST_STEADY - 1, None)
    mf_t, ds_t = statistics.median(mf["times"][steady]), statistics.median(ds["times"][steady])
    mf_rss, ds_rss = max(mf["rss"].values(), default=0), max(ds["rss"].values(), default=0)
    dloss = max(abs(a - b) for a, b in zip(mf["losses"], ds["losses"], strict=True))
    return {"time_ratio": mf_t / ds_t, "mf_ms": mf_t * 1e3, "ds_ms": ds_t * 1e3, "mf_rss": mf_rss,
            "ds_rss": ds_rss, "rss_ratio": mf_rss / ds_rss if ds_rss else float("nan"), "dloss": dloss,
            "mf_ranks": len(mf["rss"]), "ds_ranks": len(ds["rss"])}


def run_pair(layout: str, steps: int, tmp: Path, meshfit_first: bool) -> tuple[dict[str, float], dict[str, float]]:
    walls: dict[str, float] = {}
    results: dict[str, dict[str, Any]] = {}
    for engine in (["meshfit", "deepspeed"] if meshfit_first else ["deepspeed", "meshfit"]):
        start = time.perf_counter()
        results[engine] = (run_meshfit if engine == "meshfit" else run_deepspeed)(layout, steps, tmp)
        walls[engine] = time.perf_counter() - start
    return compare(results["meshfit"], results["deepspeed"]), walls


def report(pairs: dict[str, list[dict[str, float]]], walls: dict[str, list[dict[str, float]]], steps: int) -> None:
    mib = 1 << 20
    print(f"\nmeshfit / DeepSpeed, model {PRESET}, {NPROC} gloo ranks × 1 thread, global batch {GLOBAL_BATCH} × "
          f"{SEQ_LEN} tokens, micro-batch {MICRO}, fp32; step time = median of steps {FIRST_STEADY}..{steps} "
          f"on rank 0, ratio inside each pair")
    print(f"{'layout':7s} {'pairs':>5s} {'step-time ratio median [min–max]':>34s} {'peak RSS MiB mf / ds':>21s} "
          f"{'RSS ratio':>9s} {'max |Δloss|':>11s} {'wall s mf / ds':>15s}")
    for layout, rows in pairs.items():
        ratios = [r["time_ratio"] for r in rows]
        rss = f"{statistics.median(r['mf_rss'] for r in rows) / mib:.0f} / " \
              f"{statistics.median(r['ds_rss'] for r in rows) / mib:.0f}"
        wall = f"{statistics.median(w['meshfit'] for w in walls[layout]):.0f} / " \
               f"{statistics.median(w['deepspeed'] for w in walls[layout]):.0f}"
        print(f"{layout:7s} {len(rows):5d} {statistics.median(ratios):>15.2f} [{min(ratios):.2f}–{max(ratios):.2f}]"
              f"{'':>7s} {rss:>21s} {statistics.median(r['rss_ratio'] for r in rows):>9.2f} "
              f"{max(r['dloss'] for r in rows):>11.2e} {wall:>15s}")
        if any(r["mf_ranks"] != NPROC or r["ds_ranks"] != NPROC for r in rows):
            print(f"        note: RSS sampled on fewer than {NPROC} ranks in some runs")


def require_deepspeed(parser: argparse.ArgumentParser) -> None:
    """A clear error, not a rank traceback, when this Python has no DeepSpeed."""
    if importlib.util.find_spec("deepspeed") is None:
        parser.error(f"DeepSpeed is not installed for {sys.executable}: create the benchmark environment with "
                     "the recipe at the top of benchmarks/peers/vs_deepspeed.py (.venv-peers) and run this with its python")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="pairs per layout (default 3)")
    parser.add_argument("--steps", type=int, default=20,
                        help=f"optimizer steps per run, ≥ {FIRST_STEADY} (default 20)")
    parser.add_argument("--only", default=",".join(LAYOUTS), help=f"comma-separated subset of {','.join(LAYOUTS)}")
    parser.add_argument("--deepspeed-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.deepspeed_worker:
        deepspeed_worker(args.layout, args.steps, args.out)
        return
    require_deepspeed(parser)
    layouts = [name.strip() for name in args.only.split(",") if name.strip()]
    if unknown := [name for name in layouts if name not in LAYOUTS]:
        parser.error(f"--only: unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    if args.steps < FIRST_STEADY:
        parser.error(f"--steps must be ≥ {FIRST_STEADY} (steps 1..{FIRST_STEADY - 1} are warm-up)")
    pairs: dict[str, list[dict[str, float]]] = {name: [] for name in layouts}
    walls: dict[str, list[dict[str, float]]] = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory(prefix="vs-deepspeed-") as tmp:
        for repeat in range(args.repeats):
            for i, layout in enumerate(layouts):
                meshfit_first = (repeat + i) % 2 == 0
                row, wall = run_pair(layout, args.steps, Path(tmp), meshfit_first)
                pairs[layout].append(row)
                walls[layout].append(wall)
                print(f"repeat {repeat + 1} {layout:6s} ({'meshfit' if meshfit_first else 'deepspeed'} first): "
                      f"{row['mf_ms']:.0f} / {row['ds_ms']:.0f} ms = {row['time_ratio']:.2f}, "
                      f"|Δloss| ≤ {row['dloss']:.1e}", flush=True)
    report(pairs, walls, args.steps)


if __name__ == "__main__":
    main()
