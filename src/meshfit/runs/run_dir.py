"""The values `meshfit show` reads from a run directory, validated in one place.

A step record of metrics.jsonl, result.json and config.yaml are each checked against a model of the
fields the table and the plots use, before anything is printed or plotted: a wrong value is then one
error naming the file, the line and the field, never a traceback half-way through the plots. Fields
show does not read are left alone (extra="allow"), so files of older and newer runs still load.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

from meshfit.util.jsonfile import read_json_object
from meshfit.util.paths import PathError, read_text

# Keys every step record has carried since metrics.jsonl exists; the table and plots need them.
REQUIRED_KEYS = ("step", "loss", "tokens_per_s", "step_time_s", "peak_mem_bytes")
# Memory categories of a rank's breakdown at its peak (they add up to `peak`), in plotting order.
MEM_CATEGORIES = ("params", "grads", "optim", "activations", "other", "offloaded", "peak")


class ShowError(ValueError):
    """Bad input for `meshfit show`: the message names the path and what was expected."""


def shown(value: Any) -> str:
    """A value as the error names it: short, and in the file's own terms."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "…'"


def _checked(ok: Callable[[Any], bool], expected: str, optional: bool = False) -> BeforeValidator:
    """A validator that passes a value `ok` accepts (and null when `optional`), else says `expected`."""
    def check(value: Any) -> Any:
        if (value is None and optional) or (value is not None and ok(value)):
            return value
        raise ValueError(f"expected {expected}, got {shown(value)}")
    return BeforeValidator(check)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _mapping(value: Any) -> Any:
    if value is None:  # `train:` with nothing under it
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"expected a section of key: value entries, got {shown(value)}")
    return value


def _rank_objects(value: Any) -> Any:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of one object per rank, got {shown(value)}")
    for rank, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise ValueError(f"expected a list of one object per rank, got {shown(entry)} for rank {rank}")
    return value


Number = Annotated[float, _checked(_is_number, "a number")]
OptionalNumber = Annotated[float | None, _checked(_is_number, "a number or null", optional=True)]
Bytes = Annotated[float, _checked(lambda v: _is_number(v) and v >= 0, "a number of bytes ≥ 0")]
Step = Annotated[int, _checked(lambda v: _is_int(v) and v >= 0, "a whole step number ≥ 0")]
Text = Annotated[str | None, _checked(lambda v: isinstance(v, str), "a string", optional=True)]
Flag = Annotated[bool | None, _checked(lambda v: isinstance(v, bool), "true or false", optional=True)]
Ranks = Annotated[int | None, _checked(lambda v: _is_int(v) and v >= 1, "a whole number of ranks ≥ 1", True)]
Stage = Annotated[int | None, _checked(lambda v: _is_int(v) and 0 <= v <= 3, "a ZeRO stage 0, 1, 2 or 3", True)]
Degree = Annotated[int | None, _checked(lambda v: _is_int(v) and (v >= 1 or v == -1),
                                        "a whole degree ≥ 1, or -1 (the rest of the ranks)", True)]
StepCount = Annotated[int | None, _checked(lambda v: _is_int(v) and v >= 1, "a whole number of steps ≥ 1", True)]

_OPEN = ConfigDict(extra="allow")

# A category absent from a rank's breakdown is 0 in the plots; a present one must be a byte count.
RankMem = create_model("RankMem", __config__=_OPEN, measured=(Text, None),
                       **{category: (Bytes, None) for category in MEM_CATEGORIES})


class StepRecord(BaseModel):
    """One line of metrics.jsonl."""

    model_config = _OPEN
    step: Step
    loss: Number
    tokens_per_s: Number
    step_time_s: Number
    peak_mem_bytes: Bytes
    mfu: OptionalNumber = None
    val_loss: OptionalNumber = None  # only on steps that ran an evaluation (train.eval_every)
    mem: Annotated[list[RankMem], BeforeValidator(_rank_objects)] = Field(default_factory=list)


class Result(BaseModel):
    """result.json."""

    model_config = _OPEN
    world_size: Ranks = None
    layout: Text = None
    zero_stage: Stage = None
    status: Text = None


class _Train(BaseModel):
    model_config = _OPEN
    steps: StepCount = None
    precision: Text = None


class _Parallel(BaseModel):
    model_config = _OPEN
    pp: Degree = None
    dp_replicate: Degree = None
    dp_shard: Degree = None
    cp: Degree = None
    tp: Degree = None
    zero_stage: Stage = None
    activation_checkpointing: Text = None
    mixed_precision: Flag = None
    sp: Flag = None
    offload: Flag = None


class _Pipeline(BaseModel):
    model_config = _OPEN
    schedule: Text = None


class RunConfig(BaseModel):
    """config.yaml: the sections show reads (names the layout and the planned steps)."""

    model_config = _OPEN
    train: Annotated[_Train, BeforeValidator(_mapping)] = Field(default_factory=_Train)
    parallel: Annotated[_Parallel, BeforeValidator(_mapping)] = Field(default_factory=_Parallel)
    pipeline: Annotated[_Pipeline, BeforeValidator(_mapping)] = Field(default_factory=_Pipeline)


def problem(model: type[BaseModel], doc: dict[str, Any]) -> str | None:
    """What is wrong with `doc` as a `model`, in one phrase naming the field ("mem[1].peak: expected a
    number of bytes ≥ 0, got 'big'"), or None when it is valid."""
    try:
        model.model_validate(doc)
    except ValidationError as exc:
        errors = exc.errors()
        missing = [_where(e["loc"]) for e in errors if e["type"] == "missing"]
        if missing:
            return f"missing {', '.join(missing)}"
        first = errors[0]
        if first["type"] == "value_error":
            return f"{_where(first['loc'])}: {first['msg'].removeprefix('Value error, ')}"
        return f"{_where(first['loc'])}: invalid value {shown(first.get('input'))}"  # not expected: every
        # field above has its own check
    return None


def _where(loc: tuple[int | str, ...]) -> str:
    """("mem", 1, "peak") -> "mem[1].peak"."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def read_result(path: Path) -> dict[str, Any] | None:
    """The run's result.json, validated; None when there is none (a run still going, or killed)."""
    if not path.exists():
        return None
    try:
        data = read_json_object(path, "result file (the run's result object)")
    except ValueError as exc:  # PathError included
        raise ShowError(str(exc)) from None
    wrong = problem(Result, data)
    if wrong:
        raise ShowError(f"{path}: {wrong}")
    return data


def read_config(path: Path) -> dict[str, Any]:
    """The run's config.yaml, validated; {} when there is none."""
    if not path.exists():
        return {}  # written by every launch; only hand-made folders lack it, and it only names the layout
    try:
        data = yaml.safe_load(read_text(path, "run config"))
    except PathError as exc:
        raise ShowError(str(exc)) from None
    except yaml.YAMLError as exc:
        raise ShowError(f"{path} cannot be read as YAML ({exc}): expected the run's resolved config") from None
    if data is None:
        return {}
    wrong = (f"expected the run's resolved config (sections model, parallel, train …), got {shown(data)}"
             if not isinstance(data, dict) else problem(RunConfig, data))
    if wrong:
        raise ShowError(f"{path}: {wrong}")
    return data
