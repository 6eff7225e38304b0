"""The layout object shared by `meshfit plan`, `meshfit verify` and `meshfit train --plan`.

A layout is data: the degrees of each parallel dimension, how data-parallel state is kept, the pipeline
schedule and the micro-batch. Its keys are the keys of the `parallel` and `pipeline` config sections (plus
`micro_batch` from `train`), so a plan can be printed, diffed, written to JSON and run as it is.
The workload (sequence length, global batch, precision, optimizer, attention kind, dropout) is the other
half of a plan: what is trained, independent of how it is laid out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from meshfit.layout.data_parallel_kind import DEFAULT_MAX_UNIT_PARAMS
from meshfit.layout.precision import OPTIMIZERS, PRECISIONS
from meshfit.layout.recompute import AC_MODES
from meshfit.layout.rules import default_zero_stage, layout_error
from meshfit.layout.schedules import SCHEDULES, default_virtual_stages
from meshfit.models.config import ATTENTIONS
from meshfit.util.did_you_mean import did_you_mean


@dataclass(frozen=True)
class Layout:
    """How a model is laid out over ``world_size`` ranks (keys as in the config's parallel/pipeline sections).

    ``micro_batch`` is the sequences one rank runs per forward pass. Without pipelining the rank's batch
    (global batch / dp) is split into accumulation steps of ``micro_batch``; with pipelining it is split into
    ``local batch / micro_batch`` pipeline micro-batches. ``cp`` ranks split each sequence (context
    parallelism) and read the same sequences: the data-parallel degree ``dp`` does not include them.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # Expert parallelism: each Mixture-of-Experts block's routed experts split over ep of the dp_shard × cp
    # ranks (it takes no ranks of its own; parallel/expert_parallel.py).
    ep: int = 1
    zero_stage: int = 0
    offload: bool = False
    activation_checkpointing: str = "none"
    sp: bool = False
    loss_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch: int = 1
    reduce_dtype: str = "fp32"  # mixed precision, stages 2/3: "fp32", or "compute" (bf16), as the config
    max_unit_params: int = DEFAULT_MAX_UNIT_PARAMS  # FSDP units: a larger block is split (parallel/fsdp_units.py)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Ranks FSDP/ZeRO shard model states over: dp_shard × cp (context-parallel ranks hold the same
        weights, so they shard them too)."""
        return self.dp_shard * self.cp

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def check(self) -> None:
        """Raise ValueError naming the field when the layout cannot run (independent of the model)."""
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "virtual_stages", "micro_batch", "max_unit_params"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"layout {name}={value!r} must be a positive integer")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"layout zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.reduce_dtype not in ("fp32", "compute"):
            raise ValueError(f"layout reduce_dtype={self.reduce_dtype!r}; valid: fp32, compute")
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(f"layout activation_checkpointing={self.activation_checkpointing!r}; "
                             f"valid: {', '.join(AC_MODES)}")
        error = layout_error(dp_shard=self.dp_shard, dp_replicate=self.dp_replicate, tp=self.tp, pp=self.pp,
                             zero_stage=self.zero_stage,
                             offload=self.offload, sp=self.sp, loss_parallel=self.loss_parallel,
                             schedule=self.schedule, virtual_stages=self.virtual_stages, cp=self.cp, ep=self.ep,
                             activation_checkpointing=self.activation_checkpointing, config_names=False)
        if error:
            raise ValueError(error)

    def describe(self) -> str:
        """Short human name, e.g. ``zero3 dp_shard=64 · tp=8+sp · pp=4 1f1b · ac=full · mb=1``."""
        parts = []
        if self.dp > 1:
            kind = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[self.zero_stage]
            if self.dp_replicate > 1 and self.dp_shard > 1:
                kind = f"hsdp-z{self.zero_stage} {self.dp_replicate}×{self.dp_shard}"
            else:
                kind += f" dp={self.dp}"
            parts.append(kind)
        if self.dp == 1 and self.cp > 1:  # data-parallel state over the cp ranks alone
            parts.append({0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[self.zero_stage])
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + ("+sp" if self.sp else "") + ("+lp" if self.loss_parallel else ""))
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp={self.pp} {self.schedule}{v}")
        if self.offload:
            parts.append("offload")
        if self.reduce_dtype != "fp32":
            parts.append(f"reduce={self.reduce_dtype}")
        if self.activation_checkpointing != "none":
            parts.append(f"ac={self.activation_checkpointing}")
        parts.append(f"mb={self.micro_batch}")
        return " · ".join(parts) if parts else "single rank"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown layout key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(known))}")
        layout = cls(**data)
        layout.check()
        return layout

    def config_sections(self, global_batch: int) -> dict[str, dict[str, Any]]:
        """The config sections (typed values, the trainer's own field names) that make `meshfit train` run
        exactly this layout."""
        parallel = {k: getattr(self, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "zero_stage",
                                                  "offload", "sp", "loss_parallel", "activation_checkpointing",
                                                  "reduce_dtype", "max_unit_params")}
        if self.pp > 1:
            local = global_batch // self.dp
            pipeline = {"schedule": self.schedule, "virtual_stages": self.virtual_stages,
                        "microbatches": max(1, local // self.micro_batch)}
            return {"parallel": parallel, "pipeline": pipeline, "train": {"micro_batch": None}}
        return {"parallel": parallel, "train": {"micro_batch": self.micro_batch}}


def _convert(kind: str, raw: str) -> Any:
    if kind.endswith(" | None"):  # an optional field: null (or none) unsets it
        if raw.lower() in ("null", "none"):
            return None
        kind = kind.removesuffix(" | None")
    if kind == "bool":
        if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError
        return raw.lower() in ("true", "1", "yes")
    return int(raw) if kind == "int" else float(raw) if kind == "float" else raw


def parse_assignments(text: str, cls: type, flag: str) -> dict[str, Any]:
    """``KEY=VAL,KEY=VAL`` for the fields of dataclass ``cls``, each converted to its field's type;
    ValueError naming ``flag``, the item and what would be valid."""
    values: dict[str, Any] = {}
    types = {f.name: f.type for f in fields(cls)}  # annotations are strings here ("int", "bool", …)
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        key, raw = key.strip().replace("-", "_"), raw.strip()
        if not sep or not raw or key not in types:
            unknown = f"unknown key {key!r}; {did_you_mean(key, types)}" if sep and key not in types else ""
            raise ValueError(f"{flag} item {item!r}: {unknown}write KEY=VALUE with KEY one of {', '.join(types)}")
        kind = types[key]
        try:
            values[key] = _convert(kind, raw)
        except ValueError:
            base = kind.removesuffix(" | None")
            expected = _KINDS.get(base, base) + (" or null" if base != kind else "")
            raise ValueError(f"{flag} {key}={raw!r}: expected {expected}") from None
    return values


_KINDS = {"int": "an integer", "float": "a number", "bool": "true/false", "str": "a name"}


def parse_layout(text: str, base: Layout | None = None) -> Layout:
    """``KEY=VAL,KEY=VAL`` (keys of :class:`Layout`) on top of ``base``; raises ValueError naming the key."""
    values = parse_assignments(text, Layout, "--layout")
    layout = replace(base or Layout(), **values)
    if "zero_stage" not in values and layout.zero_stage == 0:
        layout = replace(layout, zero_stage=default_zero_stage(layout.dp_shard, layout.cp))  # the config's default
    if "virtual_stages" not in values and layout.pp > 1:
        layout = replace(layout, virtual_stages=default_virtual_stages(layout.schedule)
                         if layout.schedule in SCHEDULES else 1)
    layout.check()
    return layout


@dataclass(frozen=True)
class Workload:
    """What one optimizer step trains: ``global_batch`` sequences of ``seq_len`` tokens.

    precision: "fp32"; "mixed" = 16-bit compute copies with fp32 master weights, gradients reductions and
    optimizer states (meshfit's mixed precision); "bf16" = pure bf16 weights, gradients and states.
    attention: "eager" stores the attention scores; "flash" (fused SDPA) keeps only its output and a
    log-sum-exp. dropout: the model's dropout probability (GPT family; 0 = no masks kept). compiled: the
    blocks run under torch.compile (train.compile), which fuses their element-wise kernels (planner/timing/estimate.py).
    document_mask: packed documents kept apart (data.document_mask): each micro-batch's attention mask is
    kept for backward (models/mask_kernel.py).
    """

    seq_len: int
    global_batch: int
    precision: str = "mixed"
    optimizer: str = "adamw"
    attention: str = "flash"
    dropout: float = 0.0
    compiled: bool = False
    document_mask: bool = False
    # Mixture-of-Experts: the most-loaded rank's routed copies over the balanced share (1.0: balanced
    # routing, as published MoE benchmarks force it and as the dry run routes).
    moe_imbalance: float = 1.0

    def check(self) -> None:
        for name in ("seq_len", "global_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name, valid in (("precision", PRECISIONS), ("optimizer", OPTIMIZERS), ("attention", ATTENTIONS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}={getattr(self, name)!r}; valid: {', '.join(valid)}")
        if isinstance(self.moe_imbalance, bool) or not isinstance(self.moe_imbalance, (int, float)) \
                or not self.moe_imbalance >= 1.0:
            raise ValueError(f"moe_imbalance={self.moe_imbalance!r} must be a number ≥ 1 (1: balanced routing; "
                             "F: the most-loaded rank's routed tokens are F times the balanced share)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch
