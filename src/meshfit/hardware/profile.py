"""Hardware profile: what `meshfit calibrate` measured on a machine, in place of datasheet peaks.

A profile is a JSON file (format below) that `meshfit plan --hardware FILE` reads. Every rate is what
one rank reached while all ranks of the calibration worked at once (on a CPU the ranks share the cores,
as training's ranks do), so the planner uses it as is: no efficiency factor on top.

    {
      "format": "meshfit-hardware-profile/1",
      "device": "cpu" | "cuda", "device_name": "...", "backend": "gloo" | "nccl",
      "ranks": 2, "threads_per_rank": 1, "dim": 512, "memory_bytes": null | bytes of one device,
      "matmul_flops": {"fp32": FLOP/s, "bf16": FLOP/s},        # x @ W at transformer shapes
      "attention_flops": {"fp32": FLOP/s, "bf16": FLOP/s},     # fused causal attention, forward + backward,
                                                              # counted as 12·s·h FLOPs per token (as planned)
      "model_flops": {"fp32": FLOP/s, "bf16": FLOP/s}, "seq": 256,  # optional (calibrate --model): the model's
                                                              # own forward + loss + backward at dim and seq
      "op_s": {"fp32": s, "bf16": s},                         # optional (--model): seconds per dispatched
                                                              # operator; model_flops is then the per-token
                                                              # rate without it (older profiles: with it)
      "tp_flops": {"2": {"plain": {"flops": {"fp32": .., "bf16": ..}, "block_call_s": {"fp32": s, ..}},
                         "sp": {...}}},                       # optional (--model, N ≥ 2): the same blocks
                                                              # tensor-parallel over t ranks (calibrate_tp.py)
      "elementwise_bytes_per_s": bytes/s,                     # the fused AdamW step's reads + writes
      "collectives": {"2": {"all_reduce": {"bus_bytes_per_s": .., "latency_s": ..},
                            "all_gather": {...}, "reduce_scatter": {...}, "send_recv": {...}}, "4": ...},
      "collective_times": {"2": {"all_gather": {"131072": s, ...}, ...}},  # optional (--model, N ≥ 2): seconds
                                                              # per call at the model's layouts' message sizes
      "compiled_launches": {"none": {"launches": 34, "heavy": 23}, "full": ...},  # optional (--model): kernels
                                                              # one compiled block launches, forward + backward,
                                                              # and its matmul/attention operators (eager count)
      "overlap": 0..1,                                        # share of a collective hidden by compute
      "host_device_bytes_per_s": null | bytes/s,              # pinned copies (CUDA only)
      "torch": "2.13.0", "created": "2026-12-03T16:00:00Z", "seconds": 41.2
    }

Bus bandwidth is nccl-tests' convention: all-reduce moves 2(n−1)/n of the buffer per rank, all-gather and
reduce-scatter (n−1)/n of the whole buffer, send/recv the buffer; latency is the per-hop cost of a small
message (a ring all-reduce has 2(n−1) hops, all-gather and reduce-scatter n−1, send/recv one). The
bandwidth/latency line is what the time model falls back on beyond ``collective_times``' sizes (and for
profiles without them; planner/timing/comms.py `collective_s`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from meshfit.layout.recompute import COUNTED_POLICIES
from meshfit.util.jsonfile import read_json_object

FORMAT = "meshfit-hardware-profile/1"


# Tensor-parallel measurements: without sequence parallelism, and with sequence and loss parallelism.
TP_VARIANTS = ("plain", "sp")


def dtype_key(precision: str) -> str:
    """The measured dtype of a planner precision: "fp32" computes in fp32, "mixed"/"bf16" in bf16."""
    return "fp32" if precision == "fp32" else "bf16"


class Link(BaseModel):
    """Bus bandwidth and per-hop latency of one collective over one group size."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    bus_bytes_per_s: float = Field(gt=0)
    latency_s: float = Field(ge=0)


class Rates(BaseModel):
    """One measured rate per compute dtype."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    fp32: float = Field(gt=0)
    bf16: float = Field(gt=0)


class Seconds(BaseModel):
    """One measured time per compute dtype (may be 0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    fp32: float = Field(ge=0)
    bf16: float = Field(ge=0)


class TPRates(BaseModel):
    """The model's blocks trained tensor-parallel: FLOP/s per rank (by flops_per_token / t per token) and a
    fixed cost per block and micro-batch (DTensor dispatch, collective latencies); with both the
    layout's collectives are in them."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    flops: Rates
    block_call_s: Seconds


class CompiledLaunches(BaseModel):
    """Kernels one torch.compile'd block launches in forward + backward (generated and extern kernels), and
    the matmul/attention operators the same block dispatches eagerly: their ratio carries over to other
    models' blocks (planner/timing/op_count.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    launches: float = Field(gt=0)
    heavy: float = Field(gt=0)


class GroupLinks(BaseModel):
    """The collectives of one group size."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    all_reduce: Link
    all_gather: Link
    reduce_scatter: Link
    send_recv: Link


COLLECTIVE_OPS = tuple(GroupLinks.model_fields)
# Seconds per call by message bytes (the whole gathered / reduced buffer; send/recv: one message).
SecondsBySize = dict[Annotated[int, Field(ge=1)], Annotated[float, Field(gt=0)]]


class HardwareProfile(BaseModel):
    """One machine's measured rates (see the module notes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: Literal["meshfit-hardware-profile/1"] = FORMAT
    device: Literal["cpu", "cuda"]
    device_name: str
    backend: Literal["gloo", "nccl"]
    ranks: int = Field(ge=1)
    threads_per_rank: int = Field(ge=1)
    dim: int = Field(default=0, ge=0)  # the hidden size the matmuls and attention were measured at
    memory_bytes: int | None = Field(default=None, gt=0)
    matmul_flops: Rates
    attention_flops: Rates
    # meshfit's own model (its first blocks, embeddings, head, loss) trained at `dim` and `seq`: FLOP/s by
    # flops_per_token's count, so element-wise work and per-operator overhead are in it. Optional.
    model_flops: Rates | None = None
    seq: int = Field(default=0, ge=0)
    # Seconds per dispatched operator (planner/timing/op_count.py), fitted with model_flops from two batch sizes: the
    # time the larger batch does not add. None in profiles written before it was measured, or without --model.
    op_s: Seconds | None = None
    # The same blocks tensor-parallel over t ranks ("plain", or "sp" with sequence and loss parallelism):
    # unsplit element-wise work, DTensor dispatch and the activations' collectives are in them. Optional.
    tp_flops: dict[Annotated[int, Field(ge=2)], dict[Literal[TP_VARIANTS], TPRates]] = {}
    elementwise_bytes_per_s: float = Field(gt=0)
    collectives: dict[int, GroupLinks] = {}
    # Collectives timed at the message sizes the calibrated model's layouts send (calibrate --model, N ≥ 2):
    # {group size: {op: {bytes: seconds}}}. Empty in older profiles: the line above then serves every size.
    collective_times: dict[Annotated[int, Field(ge=2)], dict[Literal[COLLECTIVE_OPS], SecondsBySize]] = {}
    # A compiled block's launches per recompute policy (calibrate --model). Empty: assumed (op_count.py).
    compiled_launches: dict[Literal[COUNTED_POLICIES], CompiledLaunches] = {}
    overlap: float = Field(default=0.0, ge=0, le=1)
    host_device_bytes_per_s: float | None = Field(default=None, gt=0)
    torch: str = ""
    created: str = ""
    seconds: float = 0.0

    def flops(self, precision: str, attention: bool = False) -> float:
        """Measured FLOP/s for a planner precision ("fp32" computes in fp32, "mixed"/"bf16" in bf16): the
        model's training rate when calibrated with one (attention included), else the matmul or attention
        kernel rate."""
        key = dtype_key(precision)
        if self.model_flops is not None:
            return getattr(self.model_flops, key)
        return getattr(self.attention_flops if attention else self.matmul_flops, key)

    def op_seconds(self, precision: str) -> float | None:
        """Measured seconds per dispatched operator, None when not measured."""
        return None if self.op_s is None else getattr(self.op_s, dtype_key(precision))

    def lacks(self) -> list[str]:
        """What the time model falls back on for want of a measurement: one phrase each."""
        out = []
        if self.model_flops is None:
            out.append("the model's own training rate (kernel rates and generic element-wise traffic instead; "
                       "calibrate with --model)")
        if self.op_s is None:
            out.append("the cost per dispatched operator (not charged; calibrate with --model)")
        if self.model_flops is not None and not self.tp_flops and self.ranks > 1:
            out.append("tensor-parallel rates")
        if not self.collectives:
            out.append("collectives (calibrated on one rank)")
        elif not self.collective_times:
            out.append("collectives timed at the layouts' message sizes (a bandwidth/latency line through two "
                       "sizes instead; calibrate with --model)")
        return out

    def tp_rate(self, precision: str, tp: int, sp: bool) -> tuple[float, float] | None:
        """(FLOP/s per rank, seconds per block and micro-batch) measured for a tensor-parallel rank
        (tp_flops), None when not measured."""
        rates = self.tp_flops.get(tp, {}).get(TP_VARIANTS[sp])
        if rates is None:
            return None
        key = dtype_key(precision)
        return getattr(rates.flops, key), getattr(rates.block_call_s, key)

    def measured_sizes(self, size: int, op: str) -> tuple[int, dict[int, float]]:
        """(group size, {bytes: seconds}) of ``op`` timed at message sizes, from the group size ``link`` reads
        for ``size``; an empty dict when none were timed."""
        nearest = self._nearest_group(size)
        return nearest, self.collective_times.get(nearest, {}).get(op, {})

    def launches_per_heavy(self) -> dict[str, float]:
        """Measured launches per matmul/attention operator of a compiled block, by recompute policy (empty
        when not measured)."""
        return {policy: e.launches / e.heavy for policy, e in self.compiled_launches.items()}

    def _nearest_group(self, size: int) -> int:
        if not self.collectives:
            raise ValueError("the hardware profile has no collective measurements (calibrated on one rank); "
                             "run `meshfit calibrate --nproc N` with N ≥ 2")
        return min(self.collectives, key=lambda n: (abs(n - size), -n))

    def link(self, size: int, op: str) -> tuple[float, float]:
        """(bus bytes/s, latency per hop) of ``op`` over ``size`` ranks: the measured group size, else the
        nearest measured one (groups larger than the calibration's keep its largest group's rates)."""
        entry: Link = getattr(self.collectives[self._nearest_group(size)], op)
        return entry.bus_bytes_per_s, entry.latency_s


def load_profile(path: str | Path) -> HardwareProfile:
    """The profile in ``path``; ValueError naming the file and the first bad field."""
    doc = read_json_object(path, "hardware profile", "write one with `meshfit calibrate --out FILE`")
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a meshfit hardware profile (expected \"format\": \"{FORMAT}\"; "
                         "write one with `meshfit calibrate --out FILE`)")
    try:
        return HardwareProfile.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"{path}: {where}: {err['msg']}") from None


def save_profile(profile: HardwareProfile, path: str | Path) -> None:
    Path(path).write_text(profile.model_dump_json(indent=2) + "\n")
