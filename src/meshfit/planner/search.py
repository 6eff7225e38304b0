"""Enumerate every layout meshfit can run on a cluster, predict memory and step time, rank what fits.

A candidate is a :class:`Layout` with its memory estimate (most-loaded rank), its step time and whether
it fits the device's usable memory. Fitting candidates rank by throughput; those that do not fit rank by
how close they come, so the table can say why the fastest ideas fail.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from meshfit.hardware.catalog import CPU, Cluster
from meshfit.layout.layout import Layout, Workload
from meshfit.layout.model_fit import expert_parallel_error, moe_layout_error, pipeline_model_error
from meshfit.layout.recompute import AC_MODES
from meshfit.layout.schedules import (
    SCHEDULES,
    fixed_virtual_stages,
    least_microbatches,
    split_backward_error,
    split_backward_recompute_error,
)
from meshfit.models.config import ModelConfig, num_params
from meshfit.planner.memory.estimate import COMPONENTS, MemoryEstimate, estimate_memory, usable_bytes
from meshfit.planner.timing.basis import time_basis
from meshfit.planner.timing.estimate import StepTime, step_time
from meshfit.util.units import fmt_bytes

# Fewest tokens of a sequence a context-parallel rank is planned with. Context parallelism answers sequences
# whose activations one rank cannot hold; cutting them shorter only adds per-block gathers, and the bound
# keeps the search the size it was up to 16K-token sequences (cp multiplies every other choice, pipelines
# included). A bound on the search, not a measured break-even; `--layout cp=…` plans any degree.
MIN_CP_TOKENS = 8192
_NAMES = {"params": "weights", "grads": "gradients", "optim": "optimizer states", "activations": "activations",
          "buffers": "buffers"}


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    time: StepTime
    fits: bool
    usable: float  # bytes the device lets tensors use

    @property
    def why(self) -> str:
        return why_not(self.memory, self.usable)

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout.to_dict(), "description": self.layout.describe(), "fits": self.fits,
                "memory": {**self.memory.as_dict(), "at_rest": self.memory.at_rest_dict()},
                "peak_phase": self.memory.phase,
                "step_time_s": self.time.total_s, "tokens_per_s": self.time.tokens_per_s, "mfu": self.time.mfu,
                "time": {k: getattr(self.time, k) for k in ("compute_s", "recompute_s", "elementwise_s", "tp_comm_s",
                                                            "cp_comm_s", "ep_comm_s", "dp_comm_s", "pp_comm_s",
                                                            "bubble_s", "offload_s", "optimizer_s")},
                "why": self.why}


@dataclass
class Plan:
    model: ModelConfig
    model_name: str
    workload: Workload
    cluster: Cluster
    candidates: list[Candidate] = field(default_factory=list)  # fitting by throughput, then the rest

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates and self.candidates[0].fits else None

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        gpu = self.cluster.gpu
        basis = time_basis(gpu, self.workload.compiled)
        chosen = self.candidates if top is None else self.candidates[:top]
        return {
            "model": {"name": self.model_name, "params": num_params(self.model), **self.model.__dict__},
            "cluster": {"gpu": gpu.name, "nodes": self.cluster.nodes, "gpus_per_node": self.cluster.gpus_per_node,
                        "world_size": self.cluster.world_size, "memory_bytes": gpu.memory_bytes,
                        "usable_bytes": int(usable_bytes(gpu)),
                        "rates": "measured" if gpu.profile is not None else "datasheet",
                        "time_basis": basis.label, "time_error": basis.error, "time_lacks": list(basis.lacks),
                        "time_rests_on": list(basis.rests_on)},
            "workload": self.workload.__dict__,
            "evaluated": len(self.candidates), "fitting": len(self.fitting),
            "candidates": [c.to_json() for c in chosen],
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _cp_degrees(workload: Workload, ranks: int, tp: int) -> list[int]:
    """Context-parallel degrees among ``ranks`` (the ranks tensor parallelism leaves): each must cut the
    sequence into 2·cp equal chunks, leave sequence parallelism a whole split, and keep at least
    MIN_CP_TOKENS tokens per rank."""
    seq = workload.seq_len
    return [c for c in _divisors(ranks) if c == 1 or (seq % (2 * c) == 0 and seq // c >= MIN_CP_TOKENS
                                                       and (seq // c) % tp == 0)]


def _tp_degrees(model: ModelConfig, world: int, per_node: int) -> list[int]:
    # Tensor parallelism stays inside a node (its collectives run every layer) and must split the heads,
    # key/value heads and MLP width evenly, as training requires (the vocabulary is padded instead).
    sizes = (model.n_heads, model.n_kv_heads, model.ffn_hidden)
    return [t for t in _divisors(math.gcd(world, per_node)) if all(s % t == 0 for s in sizes)]


def _pipelines(model: ModelConfig, pp: int, micro: int) -> Iterator[tuple[str, int]]:
    """(schedule, virtual stages) pairs that torch can run with ``micro`` micro-batches per step."""
    if pp == 1:
        yield "1f1b", 1
        return
    for schedule in SCHEDULES:
        fixed = fixed_virtual_stages(schedule)
        for virtual in ((fixed,) if fixed is not None else (2, 4)):
            if pipeline_model_error(model, pp, virtual):
                continue  # tied embeddings, or fewer layers than stages (layout/model_fit.py)
            if micro < least_microbatches(schedule, pp):
                continue  # the pipeline would never fill
            if schedule == "dualpipev" and micro < 2 * pp:
                continue
            if fixed is None:
                rounds = max(1, micro // pp)
                if micro % rounds:
                    continue
            yield schedule, virtual


def _data_parallel(dp: int, cp: int = 1) -> Iterator[tuple[int, int, int]]:
    """(dp_replicate, dp_shard, zero_stage) choices for ``dp`` data-parallel ranks (any tp and pp) beside
    ``cp`` context-parallel ones, over which ZeRO shards as well."""
    if dp == 1:
        yield 1, 1, 0
        # FSDP on one rank only matters with offload; over cp ranks every stage shards.
        yield from ((1, 1, stage) for stage in ((1, 2, 3) if cp > 1 else (3,)))
        return
    yield dp, 1, 0  # DDP (replicas of tensor-parallel weights with tp > 1)
    for stage in (1, 2, 3):
        yield 1, dp, stage
    for shard in _divisors(dp)[1:-1]:  # HSDP: shard within groups, replicate across them
        yield dp // shard, shard, 3


def _ep_degrees(model: ModelConfig, shard: int, stage: int, offload: bool) -> list[int]:
    """Expert-parallel degrees for ``shard`` = dp_shard × cp ranks: the divisors of ``shard`` that divide the
    expert count (layout/model_fit.py's expert_parallel_error); 1 alone for dense models."""
    if not model.moe or stage == 0:
        return [1]
    return [e for e in _divisors(shard) if expert_parallel_error(model, e, shard, offload) is None]


def enumerate_layouts(model: ModelConfig, workload: Workload, cluster: Cluster, *,
                      activation_checkpointing: str | None = None, micro_batch: int | None = None
                      ) -> Iterator[Layout]:
    """Every layout of ``cluster.world_size`` ranks that meshfit can train for this model and workload."""
    world = cluster.world_size
    # CPU ranks keep everything in host memory already: offloading to it moves nothing.
    offloads = cluster.gpu.name != CPU
    acs = (activation_checkpointing,) if activation_checkpointing else AC_MODES
    if not activation_checkpointing and workload.attention == "flash":
        # The fused kernel keeps only its statistics: recomputing its core saves nothing and costs time.
        acs = tuple(mode for mode in acs if mode != "attention")
    for tp in _tp_degrees(model, world, cluster.gpus_per_node):
        for cp in _cp_degrees(workload, world // tp, tp):
            sps = (False, True) if tp > 1 and workload.seq_len // cp % tp == 0 else (False,)
            for pp in (p for p in _divisors(world // (tp * cp)) if p <= model.n_layers):
                if moe_layout_error(model, tp, pp, cp):
                    continue
                yield from _layouts(model, workload, world // (tp * cp * pp), tp, cp, pp, sps, acs, offloads,
                                    micro_batch)


def _layouts(model: ModelConfig, workload: Workload, dp: int, tp: int, cp: int, pp: int, sps: tuple[bool, ...],
             acs: tuple[str, ...], offloads: bool, micro_batch: int | None) -> Iterator[Layout]:
    if workload.global_batch % dp:
        return
    local = workload.global_batch // dp
    mbs = (micro_batch,) if micro_batch else [b for b in _divisors(local) if b <= 64]
    for mb, (schedule, virtual) in ((mb, pipe) for mb in mbs if local % mb == 0
                                    for pipe in _pipelines(model, pp, local // mb)):
        for rep, shard, stage in _data_parallel(dp, cp):
            if stage == 0 and cp > 1 and (tp > 1 or workload.precision != "fp32"):
                continue  # replicas over cp ranks run as DDP only (layout/rules.py)
            if split_backward_error(schedule, stage, rep * cp > 1, workload.precision != "fp32"):
                continue  # (layout/schedules.py)
            for offload in ((False, True) if stage >= 2 and offloads else (False,)):
                if shard * cp == 1 and stage == 3 and not offload:
                    continue
                for ac in acs:
                    if split_backward_recompute_error(schedule, ac):
                        continue
                    for sp, ep in ((sp, ep) for sp in sps for ep in _ep_degrees(model, shard * cp, stage, offload)):
                        yield Layout(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=stage,
                                     offload=offload, activation_checkpointing=ac, sp=sp, loss_parallel=sp,
                                     schedule=schedule, virtual_stages=virtual, micro_batch=mb)


def why_not(memory: MemoryEstimate, usable: float) -> str:
    """Why a layout does not fit (or how much room it leaves), with the component that dominates."""
    parts = memory.as_dict()
    top = max(COMPONENTS, key=lambda k: parts[k])
    if memory.total <= usable:
        return f"fits: {fmt_bytes(memory.total)} of {fmt_bytes(usable)} usable"
    return (f"needs {fmt_bytes(memory.total)} > {fmt_bytes(usable)} usable (peak at {memory.phase}); largest part: "
            f"{_NAMES[top]} {fmt_bytes(parts[top])}")


def evaluate(model: ModelConfig, layout: Layout, workload: Workload, cluster: Cluster) -> Candidate:
    """Memory, time and fit of one layout; raises ValueError when it cannot run on this cluster."""
    from meshfit.parallel.context_parallel import cp_degree_error
    from meshfit.parallel.tensor_parallel import tp_degree_error

    layout.check()
    error = cp_degree_error(layout.cp, workload.seq_len) if layout.cp > 1 else None
    error = error or (tp_degree_error(model, layout.tp, workload.seq_len // layout.cp, layout.sp)
                      if layout.tp > 1 else None)
    if error:
        raise ValueError(error.replace("parallel.", "layout ").replace("train.seq_len", "seq_len"))
    time = step_time(model, layout, workload, cluster)
    memory = estimate_memory(model, layout, workload, backend(cluster))
    usable = usable_bytes(cluster.gpu)
    return Candidate(layout, memory, time, memory.total <= usable, usable)


def backend(cluster: Cluster) -> str:
    """The collectives' backend `meshfit train` uses on this cluster's devices."""
    return "gloo" if cluster.gpu.name == CPU else "nccl"


def search(model: ModelConfig, workload: Workload, cluster: Cluster, *, model_name: str = "custom",
           activation_checkpointing: str | None = None, micro_batch: int | None = None) -> Plan:
    """Evaluate every layout and rank them: fitting ones by tokens/s, then the others by memory."""
    workload.check()
    usable = usable_bytes(cluster.gpu)
    candidates = []
    for layout in enumerate_layouts(model, workload, cluster, activation_checkpointing=activation_checkpointing,
                                    micro_batch=micro_batch):
        try:
            time = step_time(model, layout, workload, cluster)
        except ValueError:
            continue
        memory = estimate_memory(model, layout, workload, backend(cluster))
        candidates.append(Candidate(layout, memory, time, memory.total <= usable, usable))
    candidates.sort(key=lambda c: (not c.fits, -c.time.tokens_per_s if c.fits else c.memory.total))
    return Plan(model=model, model_name=model_name, workload=workload, cluster=cluster, candidates=candidates)
