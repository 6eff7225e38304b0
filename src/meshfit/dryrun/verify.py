"""`meshfit verify`: a one-process dry run of the real training code of one layout at its real world size.

The run is meshfit's own training path (`build_run` and `measured_step`, the trackers used in training),
executed for ONE rank of the layout in this process:

- a fake process group (torch.testing._internal.distributed.fake_pg) of the layout's world size, whose
  collectives return at once without moving data;
- the device mesh, tensor parallelism and FSDP wrapping built on the meta device outside fake mode (they
  need real process groups and plain meta tensors); materialization, initialization, DDP and optimizer
  construction, and the training steps run under `FakeTensorMode(allow_non_fake_inputs=True)`, so tensors
  carry shapes, dtypes and storage sizes but no data;
- the data batches are real (small integer tensors), drawn outside fake mode.

The tracker therefore sees the allocations of the real step on that rank, and no host memory is spent on
them: an 8B model at 64 ranks needs about 0.5 GB of RSS. Loss values are fake and are not read back; the
metrics record of a real step (which gathers every rank's peak) is not produced. Where torch would read
data from peers or from tensors, `meshfit.dryrun.fake_world` answers for them.

Mixture-of-Experts routers route balanced in a dry run (fake_world.py): fake tensors hold no scores, and
expert parallelism's all-to-all dispatcher then takes its split sizes from the shapes (models/moe.py's
`balanced_counts`) rather than from a counts tensor; the fake group's `all_to_all_single` returns buffers of
the split sizes asked for, so the tracker sees the real run's received copies (balanced routing).

With offload the dry run counts as a GPU rank would: the host-resident shards are off the tally (a real
CPU rank counts them: there the host is its own memory; its record reports them as `offloaded`). So does
context parallelism's attention of a query chunk over a longer key prefix: a GPU's fused kernel runs it
without a mask, torch's CPU path materializes one (queries × keys) and keeps it (fake_world.py). A real
2-rank gloo run of `small` (fp32, seq 1024, cp=2) peaked at 83.7 and 84.8 MB, its dry run at 79.6 MB.

Agreement with real multi-process gloo runs of the tiny model (step peaks): identical bytes for DDP,
ZeRO-1/2/3, HSDP, TP + SP + loss parallel, activation checkpointing and offload (the real peak less its
`offloaded` bytes) in fp32, and for every layout at one rank in mixed precision. Two known differences,
both making the dry run lower: on gloo a reduce-scatter receives chunks the size of its input (parallel/host_reduce.py), and one reduced in the
background keeps its input, its chunks and the block's shard through the next block's backward (NCCL does
neither; CPU plans count both), which shows when the peak falls in backward; a real pipeline send holds its
tensor until it is waited for, while a fake send completes at once (1F1B and interleaved schedules: up to
one micro-batch's boundary activation, 0.2-1.4% on the tiny model).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from meshfit.config import Config, load_config
from meshfit.layout.layout import Layout, Workload
from meshfit.models import ModelConfig, get_preset
from meshfit.planner.planfile import check_trainable, plan_sections
from meshfit.util.units import fmt_bytes

COMPONENTS = ("params", "grads", "optim", "activations", "buffers", "total")


@dataclass
class VerifyResult:
    """The measured rank's memory at its step peak (bytes) and what the dry run cost."""

    measured: dict[str, int]  # params, grads, optim, activations, buffers, total
    rank: int  # the global rank measured (with pipelining, by default the most loaded pipeline rank)
    stage_ids: list[int] | None  # pipeline stages held by that rank (None without pipelining)
    wall_s: float
    max_rss_bytes: int  # peak resident memory of this process
    steps: int
    phase: str = ""  # the training phase at the peak ("forward", "backward", "optimizer step", ...)
    per_rank: dict[int, int] = field(default_factory=dict)  # total of every rank measured (pipeline ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"measured": dict(self.measured), "phase": self.phase, "rank": self.rank,
                "stage_ids": self.stage_ids, "wall_s": self.wall_s, "max_rss_bytes": self.max_rss_bytes,
                "steps": self.steps, "per_rank": dict(self.per_rank)}


def verify_config(model: ModelConfig | str, layout: Layout, workload: Workload) -> Config:
    """The meshfit Config that trains `layout` on `workload` (raises ValueError naming the field)."""
    layout.check()
    check_trainable(workload)
    resolved = get_preset(model) if isinstance(model, str) else model
    if resolved.family == "llama" and workload.dropout:
        raise ValueError(f"workload dropout={workload.dropout}: llama-family models have no dropout; use 0")
    if resolved.family == "gpt":
        resolved = replace(resolved, dropout=workload.dropout)
    sections = plan_sections(resolved, workload, layout)
    if workload.document_mask:  # synthetic documents: the chain's token 0 closes them
        sections["data"]["eos_id"] = 0
    # A fixed figure: the MFU estimate is not used, and measuring the CPU would cost time.
    sections["train"].update(device="cpu", peak_flops=1e12)
    return load_config(None, sections=sections)


def measured_ranks(layout: Layout) -> list[int]:
    """The global ranks whose memory `verify_layout` measures by default.

    Without pipelining: rank 0; data and tensor-parallel ranks hold equal shares (every stage shards
    element by element). With pipelining the pipeline ranks
    differ (the first keeps the most micro-batches in flight and the embedding, the last the head, the
    logits and the loss), so each pipeline coordinate is measured at data/tensor coordinate 0: global rank
    k · (world / pp) in meshfit's mesh order (pp, dp_replicate, dp_shard, cp, tp). Each holds 1/pp of the
    layers, so together they cost about one dry run of the whole model.
    """
    return [k * (layout.world_size // layout.pp) for k in range(layout.pp)]


def verify_layout(model: ModelConfig | str, layout: Layout, workload: Workload, *, steps: int = 2,
                  rank: int | None = None, progress: Callable[[str], None] | None = None) -> VerifyResult:
    """Dry-run `steps` optimizer steps of `layout` on `workload` and measure the most loaded rank's peak.

    `rank`: measure this global rank only; by default the ranks of `measured_ranks` (one without
    pipelining) and report the one with the highest total. `progress` receives one line per stage of work.

    `measured` is the step peak of the tracker used in training, folded like `fold_snapshot`: params
    (sharded and gathered), grads (with reduce-scatter buffers), optim, activations (with temporaries and
    inputs), buffers (the fold's `other`: RoPE tables, DDP buckets) and total
    (the tally at the peak). It is the highest peak of steps 2..steps, with that step's breakdown (the
    latest step on ties): step 1 has no optimizer states yet during backward. With steps=1 it is step 1.
    DDP re-creates its gradient buckets in step 2, where the tracker counts the new ones as activations;
    DDP layouts run at least 3 steps (unless steps=1), so that a steady step is measured too.
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be ≥ 1 (2 or more measure a steady step)")
    cfg = verify_config(model, layout, workload)
    world = layout.world_size
    if rank is not None and not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in 0..{world - 1} (world size {world})")
    if layout.zero_stage == 0 and layout.dp > 1 and steps >= 2:
        steps = max(steps, 3)
    say = progress or (lambda _msg: None)
    start = time.perf_counter()
    best: tuple[dict[str, int], int, list[int] | None, str] | None = None
    per_rank: dict[int, int] = {}
    for measured_rank in [rank] if rank is not None else measured_ranks(layout):
        measured, stage_ids, phase = _steady_peak(_dry_run(cfg, world, measured_rank, steps, say, start))
        per_rank[measured_rank] = measured["total"]
        if best is None or measured["total"] > best[0]["total"]:
            best = (measured, measured_rank, stage_ids, phase)
    assert best is not None
    return VerifyResult(measured=best[0], rank=best[1], stage_ids=best[2], wall_s=time.perf_counter() - start,
                        max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, steps=steps,
                        phase=best[3], per_rank=per_rank)


def _dry_run(cfg: Config, world: int, rank: int, steps: int, say: Callable[[str], None],
             start: float) -> list[dict[str, Any]]:
    """Per-step tracker peaks (with the stages held) of `rank` in a fake world of `world` ranks."""
    import torch

    from meshfit.dryrun.fake_world import fake_world, stand_in_for_peers
    from meshfit.train.dist import RankEnv
    from meshfit.train.run import build_run
    from meshfit.train.shape import resolve_run
    from meshfit.train.trainer import measured_step

    resolve_run(cfg, world)  # configuration errors before anything is built
    with fake_world(world, rank) as fake:
        say(f"[{time.perf_counter() - start:6.1f}s] rank {rank}/{world}: building on fake tensors")
        env = RankEnv(rank=rank, world_size=world, local_rank=0, device=torch.device("cpu"))
        # The mesh and the layout (TP, FSDP on meta) are built outside fake mode; allocations inside it.
        run = build_run(cfg, env, None, materialize=lambda: fake)
        run.tracker.stand_in_for_gpu()  # offloaded shards leave the tally, as they leave a GPU's memory
        stand_in_for_peers(run)
        say(f"[{time.perf_counter() - start:6.1f}s] rank {rank}/{world}: built")
        peaks = []
        for step in range(1, steps + 1):
            inputs, targets = run.batches.next_batch()  # real token ids: the data source runs numpy
            with fake:
                measured_step(run, inputs, targets)  # losses stay fake: nothing is read back
            peak = run.tracker.peak()
            peak["stages"] = run.pipe.stage_ids if run.pipe else None
            peaks.append(peak)
            say(f"[{time.perf_counter() - start:6.1f}s] rank {rank}/{world}: step {step}/{steps} peak "
                f"{fmt_bytes(peak['peak'])}")
        return peaks


def _steady_peak(peaks: list[dict[str, Any]]) -> tuple[dict[str, int], list[int] | None, str]:
    steady = peaks[1:] or peaks
    best = max(reversed(steady), key=lambda p: p["peak"])  # ties: the latest step (settled buffers)
    measured = {name: int(best[name]) for name in ("params", "grads", "optim", "activations")}
    measured["buffers"] = int(best["other"])
    measured["total"] = int(best["peak"])
    return measured, best["stages"], best["phase"]
