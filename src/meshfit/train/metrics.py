"""Per-step metrics: the JSON-lines file, console progress, optional TensorBoard events and trackers (W&B,
MLflow: trackers.py), and the MFU estimate.

MFU = tokens_per_s × flops_per_token / (world_size × peak_flops_per_device), where flops_per_token is
6 × (matmul parameters, including the output head) + 12 × n_layers × dim × seq_len (attention scores and
their weighted sum, forward and backward), the PaLM-paper convention. Recomputation is not counted.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch

from meshfit.train.trackers import Tracker, missing_message
from meshfit.util.units import fmt_bytes, fmt_duration


def measure_cpu_flops(size: int = 512, repeats: int = 5) -> float:
    """Achievable fp32 matmul FLOP/s of this process's threads: the CPU has no datasheet peak to use."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops(device: torch.device, configured: float | None) -> float | None:
    if configured:
        return configured
    if device.type == "cpu":
        return measure_cpu_flops()
    # The planner's GPU catalog holds the datasheet peaks (one table for planning and MFU).
    from meshfit.hardware.catalog import gpu_for_device

    gpu = gpu_for_device(torch.cuda.get_device_name(device))
    return gpu.bf16_flops if gpu else None


def mfu(tokens_per_s: float, flops_per_token: float, world_size: int, peak: float | None) -> float | None:
    if not peak:
        return None
    return tokens_per_s * flops_per_token / (world_size * peak)


def _keep_records_through(path: Path, step: int) -> None:
    """Keep the records of steps up to `step` (those a resumed run continues from); the later ones, which
    run again, move to metrics-superseded-<step>.jsonl beside it (nothing logged is deleted)."""
    if not path.exists():
        return
    kept, dropped = [], []
    for line in path.read_text().splitlines():
        try:
            (kept if json.loads(line).get("step", 0) <= step else dropped).append(line)
        except json.JSONDecodeError:
            dropped.append(line)  # a line cut short when a rank was killed mid-write
    if not dropped:
        return
    with open(path.parent / f"metrics-superseded-{step}.jsonl", "a") as shelf:
        shelf.write("".join(line + "\n" for line in dropped))
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


TENSORBOARD_DIR = "tensorboard"  # under the run directory; `tensorboard --logdir RUN_DIR/tensorboard`


def open_tensorboard(log_dir: Path, start_step: int = 0) -> Any:
    """A SummaryWriter for `log_dir`, imported only here: tensorboard is needed only when asked for.

    `start_step`: a resumed run hides the events of steps after it (they run again), as metrics.jsonl
    drops their records."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise RuntimeError(missing_message("tensorboard")) from None
    # TensorBoard hides earlier files' events from purge_step on: an attempt that died after logging
    # steps past its last checkpoint leaves them behind (from step 1 when it had none).
    return SummaryWriter(str(log_dir), purge_step=start_step + 1)


def tensorboard_scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The scalars of one step record, by TensorBoard tag (mfu only where a peak FLOP/s was known); the
    trackers (W&B, MLflow) log the same, under the same names."""
    scalars = {"train/loss": rec["loss"], "train/grad_norm": rec["grad_norm"], "train/lr": rec["lr"],
               "perf/tokens_per_s": rec["tokens_per_s"], "perf/step_time_s": rec["step_time_s"],
               "memory/peak_mem_bytes": rec["peak_mem_bytes"]}
    if rec.get("mfu") is not None:
        scalars["perf/mfu"] = rec["mfu"]
    if "val_loss" in rec:  # steps that ran an evaluation (train.eval_every)
        scalars["val/loss"] = rec["val_loss"]
    if "moe_aux_loss" in rec:  # Mixture-of-Experts models: load balance per layer (max / mean tokens)
        scalars["moe/aux_loss"] = rec["moe_aux_loss"]
        scalars["moe/dropped_tokens"] = rec["moe_dropped_tokens"]
        scalars["moe/max_load"] = max(rec["moe_load"])
        for layer, load in zip(rec["moe_layers"], rec["moe_load"], strict=True):
            scalars[f"moe/load/layer_{layer}"] = load
    # The most-loaded rank's breakdown at its peak: what decides whether the layout fits.
    worst = max(rec.get("mem") or [{}], key=lambda m: m.get("peak", 0))
    for key in ("params", "grads", "optim", "activations", "other"):
        if key in worst:
            scalars[f"memory/{key}_bytes"] = worst[key]
    return scalars


def progress_bar(console: Any = None) -> Any:
    """The terminal's progress line: step, elapsed time and ETA first, then the step's figures, which alone
    are cut (with an ellipsis) when the terminal is too narrow for all of it (at 100 columns all fits)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Column
    from rich.text import Text

    class Figures(ProgressColumn):
        def render(self, task: Any) -> Text:  # its own Text decides: one line, cut at the end
            return Text(task.fields.get("info", ""), no_wrap=True, overflow="ellipsis")

    # rich narrows the columns that may wrap when the line is too long: only the figures may.
    def fixed() -> Column:
        return Column(no_wrap=True)

    # Elapsed time ticks during a long step too, so a slow step is visibly still running.
    return Progress(BarColumn(bar_width=6, table_column=fixed()),
                    MofNCompleteColumn(table_column=fixed()), TimeElapsedColumn(table_column=fixed()),
                    TextColumn("eta", table_column=fixed()), TimeRemainingColumn(table_column=fixed()),
                    Figures(table_column=Column()), console=console)


class MetricsLog:
    """Rank 0's view: appends one JSON object per optimizer step and prints progress.

    A rich progress bar when stdout is a terminal; plain log lines otherwise (files, CI, torchrun logs).
    """

    def __init__(self, path: Path | None, total_steps: int, log_every: int = 1, enabled: bool = True,
                 start_step: int = 0, tensorboard: bool = False, trackers: Sequence[Tracker] = ()):
        """`start_step`: the step a resumed run continues from. Records of later steps (logged by an
        attempt that died before its next checkpoint) are dropped: those steps run again.
        `tensorboard`: also write event files to `path`'s folder / tensorboard (metrics.tensorboard).
        `trackers`: opened W&B / MLflow runs (trackers.open_trackers) that get each step's scalars; closed
        with this log."""
        self.enabled = enabled
        self.log_every = log_every
        self.trackers = list(trackers)
        # Opened first: a missing tensorboard package fails before metrics.jsonl is touched.
        self.writer = (open_tensorboard(path.parent / TENSORBOARD_DIR, start_step)
                       if (enabled and path and tensorboard) else None)
        if enabled and path:
            _keep_records_through(path, start_step)
        self.file = path.open("a") if (enabled and path) else None
        self.progress = None
        self.total_steps = total_steps
        self.step_times: list[float] = []  # this launch's steps, for the ETA
        if enabled and sys.stdout.isatty():
            self.progress = progress_bar()
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
            self.progress.start()

    def record(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.file:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        scalars = tensorboard_scalars(rec) if (self.writer is not None or self.trackers) else {}
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, rec["step"], walltime=rec.get("time"))
            self.writer.flush()  # as metrics.jsonl: a killed run keeps every step it logged
        for tracker in self.trackers:
            tracker.log(rec["step"], scalars, rec.get("time"))
        fields = [f"loss {rec['loss']:.4f}", f"gnorm {rec['grad_norm']:.3f}", f"lr {rec['lr']:.1e}",
                  f"{rec['tokens_per_s']:.0f} tok/s", f"peak {fmt_bytes(rec['peak_mem_bytes'])}"]
        if "val_loss" in rec:
            fields.append(f"val {rec['val_loss']:.4f}")
        if not rec.get("compile_s"):  # a step that compiled says nothing of the steps to come
            self.step_times.append(rec["step_time_s"])
        if self.progress is not None:
            self.progress.update(self.task, advance=1, info=" ".join(fields))
        elif rec["step"] % self.log_every == 0 or rec["step"] == self.total_steps or "val_loss" in rec:
            print(f"step {rec['step']:>5}/{self.total_steps} | {' | '.join(fields)} | eta {self.eta(rec['step'])}",
                  flush=True)

    def eta(self, step: int) -> str:
        """Time left at this launch's mean step time (the first step, which warms up, left out when there
        are others)."""
        times = self.step_times[1:] or self.step_times
        if not times:
            return "?"
        return fmt_duration(max(0, self.total_steps - step) * sum(times) / len(times))

    def close(self, ok: bool = True) -> None:
        """`ok`: the loop ended without an error (a tracker's run is marked finished, else failed)."""
        if self.progress is not None:
            self.progress.stop()
        if self.file:
            self.file.close()
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers:  # last: the run's own files are closed whatever a tracker does
            tracker.close(ok)
