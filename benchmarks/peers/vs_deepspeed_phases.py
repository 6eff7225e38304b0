"""Where a step's time goes in meshfit and in DeepSpeed, phase by phase, inside the same two processes.

    .venv-peers/bin/python benchmarks/peers/vs_deepspeed_phases.py [--steps N] [--only ddp,zero1]

Built and alternated as in vs_deepspeed_interleaved.py (same model, data, optimizer and layout, a barrier
before every step). For each micro-batch it times the forward (the model's call, from its forward pre-hook
to its forward hook, the engine's hooks included) and what follows it up to the next phase (loss, backward and
the engine's bookkeeping after it); then the optimizer phase (meshfit: the gradient norm, the step's one
small collective, the guard, clipping, AdamW, zeroing; DeepSpeed: its `engine.step()` calls, including the
collectives it runs at the accumulation boundary) and the rest of the step (data and the metrics record;
DeepSpeed's loop: data and its loss mean).
Per layout and engine it prints the median of each phase over the steady steps, in ms, on rank 0.

The pipeline has no per-micro-batch phases to split this way: there the phases are the schedule (every
forward and backward of the rank's stage, with their sends and receives), the optimizer phase (DeepSpeed:
its `OptimizerStep` instruction) and the rest, on both ranks, as each runs another stage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_deepspeed as vs  # noqa: E402
import vs_deepspeed_interleaved as vi  # noqa: E402

LAYOUTS = list(vs.LAYOUTS)


class Clock:
    """Time marks of one step: `mark(name)` starts phase `name` (and ends the one before)."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def around(self, fn: Any, start: str, end: str | None = None) -> Any:
        """`fn` marking phase `start` when called (and `end` when it returns, if given)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.mark(start)
            result = fn(*args, **kwargs)
            if end is not None:
                self.mark(end)
            return result

        return timed

    def phases(self) -> dict[str, float]:
        """Milliseconds per phase, phases of the same name numbered in order (fwd1, bwd1, fwd2, ...)."""
        out: dict[str, float] = {}
        seen: dict[str, int] = {}
        for (name, start), (_, end) in zip(self.marks, self.marks[1:], strict=False):
            if name == "end":
                break
            seen[name] = seen.get(name, 0) + 1
            key = f"{name}{seen[name]}" if name in ("fwd", "bwd") else name
            out[key] = out.get(key, 0.0) + (end - start) * 1e3
        return out


class ForwardTimer:
    """Marks the start and end of a model's forward on a Clock, outside the engine's own forward hooks.

    Its pre-hook must run before FSDP2's pre-forward (the root's all-gather belongs to the forward) and its
    hook after FSDP2's post-forward. Others reorder a module's hooks (torch's FSDP memory tracker, which
    meshfit runs in its first steps, puts FSDP2's hooks back in front when it exits), so `arm()` registers
    both again before every step.
    """

    def __init__(self, model: Any, clock: Clock) -> None:
        self.model, self.clock, self.handles = model, clock, []

    def arm(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = [
            self.model.register_forward_pre_hook(lambda *_: self.clock.mark("fwd"), prepend=True),
            self.model.register_forward_hook(lambda *_: self.clock.mark("bwd")),  # loss and backward follow
        ]


def worker(layout: str, steps: int) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from meshfit.data import TokenBatches, make_source
    from meshfit.memory.host_heap import keep_freed_blocks
    from meshfit.models.loss import lm_loss
    from meshfit.train import trainer

    torch.set_num_threads(1)
    keep_freed_blocks()
    deepspeed.init_distributed(dist_backend="gloo")
    pipeline = vs.LAYOUTS[layout][1] is None
    run, guard = vi.build_meshfit(layout, steps)
    model_cfg = run.cfg.model.resolve()
    dp_size, dp_rank = (1, 0) if pipeline else (dist.get_world_size(), dist.get_rank())
    engine = vs._build_engine(layout, run.cfg, model_cfg, dp_size)
    batches = TokenBatches(make_source("synthetic", path=None, vocab_size=model_cfg.vocab_size, seed=vs.SEED),
                           seq_len=vs.SEQ_LEN, global_batch=vs.GLOBAL_BATCH, dp_rank=dp_rank, dp_size=dp_size)
    clock = Clock()
    if pipeline:
        _mark_pipeline_phases(trainer, engine, clock)
        timers = {}
    else:
        timers = {"meshfit": ForwardTimer(run.model, clock), "deepspeed": ForwardTimer(engine.module, clock)}
    trainer._optimizer_step = clock.around(trainer._optimizer_step, "step", "rest")

    def deepspeed_step() -> None:
        if pipeline:
            vs._train_step(engine, batches, model_cfg.vocab_size, pipeline=True)
            return
        inputs, targets = batches.next_batch()
        losses = []
        for x, y in zip(inputs.split(vs.MICRO), targets.split(vs.MICRO), strict=True):
            loss = lm_loss(engine(x), y, model_cfg.vocab_size)
            engine.backward(loss)
            clock.mark("step")
            engine.step()
            clock.mark("rest")
            losses.append(loss.detach())
        mean = torch.stack(losses).mean()
        dist.all_reduce(mean)
        float(mean)

    phases: dict[str, list[dict[str, float]]] = {"meshfit": [], "deepspeed": []}
    for step in range(steps):
        for name in ("meshfit", "deepspeed") if step % 2 == 0 else ("deepspeed", "meshfit"):
            if name in timers:
                timers[name].arm()
            dist.barrier()
            clock.marks.clear()
            clock.mark("rest")
            trainer.train_step(run, guard) if name == "meshfit" else deepspeed_step()
            clock.mark("end")
            phases[name].append(clock.phases())
    every_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, phases)
    if dist.get_rank() == 0:
        print("@result " + json.dumps(every_rank if pipeline else every_rank[:1]), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _mark_pipeline_phases(trainer: Any, engine: Any, clock: Clock) -> None:
    """Pipeline phases: meshfit's `pipeline_step`, DeepSpeed's `_exec_schedule` up to its `OptimizerStep`
    instruction (the schedule's last), then that instruction."""
    from deepspeed.runtime.pipe.schedule import OptimizerStep

    trainer.pipeline_step = clock.around(trainer.pipeline_step, "sched")
    engine._exec_schedule = clock.around(engine._exec_schedule, "sched")
    # The engine looks instructions up in this class-level table on every step.
    timed = clock.around(engine._INSTRUCTION_MAP[OptimizerStep], "step", "rest")
    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, OptimizerStep: timed}


def _order(key: str) -> tuple[int, int, int]:
    """fwd1, bwd1, fwd2, bwd2, ... (or the pipeline's sched), step, rest."""
    if key in ("step", "rest"):
        return (1, key == "rest", 0)
    if key == "sched":
        return (0, 0, 0)
    return (0, int(key[3:]), key.startswith("bwd"))


def table(layout: str, ranks: list[dict[str, list[dict[str, float]]]]) -> str:
    lines = [f"== {layout}"]
    for rank, phases in enumerate(ranks):
        for name, steps in phases.items():
            steady = steps[vs.FIRST_STEADY - 1:]
            # Micro-batches in order, then the optimizer phase and the rest (DeepSpeed's first step() call
            # comes right after the first backward).
            keys = sorted({key for step in steady for key in step}, key=_order)
            medians = {key: statistics.median(step.get(key, 0.0) for step in steady) for key in keys}
            total = statistics.median(sum(step.values()) for step in steady)
            who = f"{name} rank {rank}" if len(ranks) > 1 else name
            lines.append(f"  {who:16s} total {total:6.1f}   " + "  ".join(f"{k} {v:.1f}" for k, v in medians.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per engine and layout (default 30)")
    parser.add_argument("--only", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)}")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.layout, args.steps)
        return
    vs.require_deepspeed(parser)
    layouts = vi.checked_layouts(parser, args.only, args.steps, LAYOUTS)
    print(f"median ms per phase over steps {vs.FIRST_STEADY}..{args.steps}, rank 0 "
          "(fwdN: forward of micro-batch N; bwdN: its loss and backward; step: optimizer phase; rest: the others; "
          "pipeline: sched is the schedule, on both ranks)")
    for layout in layouts:
        print(table(layout, vi.launch_worker(__file__, layout, args.steps)), flush=True)


if __name__ == "__main__":
    main()
