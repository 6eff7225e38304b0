"""What a training run reports: each step's metrics record (every rank's memory, compiling) and the
run's result, and the files rank 0 keeps in the run directory (config.yaml, result.json)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from meshfit.config import Config
from meshfit.parallel.compile import compiled_blocks
from meshfit.train.metrics import mfu
from meshfit.train.steady import steady_records
from meshfit.train.vote import Tally


def compile_fields(run: Any, record: dict[str, Any], seconds: float, any_rank: bool) -> None:
    """A compiled run's step says whether its blocks ran eagerly (under the memory tracker, which
    torch.compile does not support) and how long this rank spent compiling in it."""
    if any(m.get("measured") == "tracker" for m in record["mem"]):
        record["blocks"] = "eager"
    for mem in record["mem"]:  # a breakdown, measured or carried over, is an eager step's
        if mem.get("measured") in ("tracker", "carried"):
            mem["breakdown_blocks"] = "eager"
    if any_rank and run.meter is not None:  # every rank alike: tracked steps gather from all of them
        run.meter.compiled()
    if seconds > 0:
        record["compile_s"] = seconds
        if run.env.rank == 0:
            print(f"compiled {compiled_blocks(run.model)} blocks in {seconds:.1f} s (step {run.step}, rank 0; "
                  "left out of step-time figures)", flush=True)


def step_record(run: Any, tally: Tally, grad_norm: float, lr: float, elapsed: float) -> dict[str, Any]:
    extra = {"stages": run.pipe.stage_ids} if run.pipe is not None else {}
    per_rank, retracked = run.meter.records(run.env.world_size, extra, tally.counters)
    tokens = run.cfg.train.global_batch * run.cfg.train.seq_len
    tps = tokens / elapsed
    record = {
        "step": run.step, "time": time.time(), "loss": tally.loss, "grad_norm": grad_norm, "lr": lr,
        "tokens_per_s": tps, "step_time_s": elapsed,
        "mfu": mfu(tps, run.flops_per_token, run.env.world_size, run.peak_flops),
        "peak_mem_bytes": max(m["peak"] for m in per_rank), "mem": per_rank,
    }
    if run.moe_counts is not None:  # tokens per expert, dropped tokens, the auxiliary loss
        record.update(run.moe_counts.record())
    if retracked:
        record["retracked"] = True  # memory grew after tracking stopped: this step was measured again
    return record


def summarize(run: Any) -> dict[str, Any]:
    """Run-level result: this launch's losses, the highest per-rank peak of any step, and the last step's
    breakdown.

    The breakdown comes from the last step because the first steps are not yet steady: optimizer states
    appear during step 1 and DDP rebuilds its gradient buckets once in step 2.
    """
    history = run.history
    return {
        "layout": run.shape.dims.describe(), "zero_stage": run.shape.zero_stage,
        "world_size": run.env.world_size, "steps": len(history), "start_step": run.start_step,
        "end_step": run.step,
        "final_loss": history[-1]["loss"] if history else None, "losses": [r["loss"] for r in history],
        "grad_norms": [r["grad_norm"] for r in history],
        "skipped_steps": [r["step"] for r in history if r.get("skipped")],
        "val_losses": [{"step": r["step"], "val_loss": r["val_loss"]} for r in history if "val_loss" in r],
        "peak_mem_bytes": max((r["peak_mem_bytes"] for r in history), default=0),
        "mem": history[-1]["mem"] if history else [],
        "mean_step_time_s": _mean([r["step_time_s"] for r in steady_records(history)]),
        **({"compile_s": sum(r.get("compile_s", 0.0) for r in history)} if run.cfg.train.compile else {}),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def begin_run(cfg: Config, run_dir: Path, start_step: int) -> None:
    """config.yaml is the config of the launch that trains now; a launch that changed it keeps the one
    before as config-step-<N>.yaml (N: the step it continued from), so no setting is lost."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path, text = run_dir / "config.yaml", cfg.to_yaml()
    if path.is_file() and path.read_text() != text:
        keep, n = run_dir / f"config-step-{start_step}.yaml", 1
        while keep.exists():  # resumed from this step before: keep every config that trained
            n += 1
            keep = run_dir / f"config-step-{start_step}-{n}.yaml"
        path.rename(keep)
    path.write_text(text)


def write_result(run_dir: Path, result: dict[str, Any]) -> None:
    result = {**result, "finished_at": time.time()}
    tmp = run_dir / ".result.json.tmp"
    try:
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(run_dir / "result.json")  # never a half-written result
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk: no empty leftover beside the previous result
        raise
