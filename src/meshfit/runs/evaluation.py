"""`meshfit eval`: a model's mean token loss on a token file, without training it.

The figure is training's validation loss (train/evaluate.py) over the file's first K windows of N + 1
tokens, in file order: the evaluated file is the run's held-out file (`data.val_path`), the K windows are
`train.eval_batches` global batches of it, and the model is laid out, loaded and run as training's ranks
do. Everything a user can get wrong is checked here, before any rank starts: the model (a Hugging Face
folder, a checkpoint, or a run directory's latest intact checkpoint), the file and its token ids, the
windows it holds, the model's positions, and the layout (through `resolve_run`, as `meshfit train` checks
it). No run directory is made, read for its lock, or written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshfit.config import Config, ConfigError, load_config
from meshfit.data import DataError, check_files, load_token_file
from meshfit.data.files import token_count, tokenize_text
from meshfit.data.windows import window_count
from meshfit.layout.layout import Layout, parse_assignments
from meshfit.layout.schedules import least_microbatches
from meshfit.models.config import ModelConfig
from meshfit.parallel.dims import ParallelDims
from meshfit.runs.export import find_checkpoint
from meshfit.train import checkpoint_store as store
from meshfit.train.checkpoint_store import CheckpointError
from meshfit.train.shape import RunShape, resolve_run

MODEL_HELP = ("a Hugging Face folder (config.json + *.safetensors, e.g. what `meshfit export` writes), a step-N "
              "checkpoint folder, a checkpoints folder or a run folder of `meshfit train`")
# Sequences per data-parallel rank in one evaluation batch when train.global_batch is not set: the loss is
# a sum over tokens, so the grouping changes only how much is in memory at once.
WINDOWS_PER_RANK = 8
# What the command decides itself; --set may not change it.
OWN_KEYS = {"train.seq_len": "--seq-len", "train.eval_batches": "--windows", "train.eval_every": "--windows",
            "data.val_path": "--data", "data.val_fraction": "--data"}
# Sections that belong to a training run, not to an evaluation.
RUN_SECTIONS = ("checkpoint", "metrics")


@dataclass(frozen=True)
class ModelSource:
    """The model MODEL names: its weights' files and its shape as saved."""

    kind: str  # "huggingface" or "checkpoint"
    path: Path  # the Hugging Face folder, or the checkpoint folder chosen
    model: ModelConfig
    step: int | None = None  # a checkpoint's step
    notes: list[str] = field(default_factory=list)  # e.g. a damaged checkpoint skipped for the one before


@dataclass(frozen=True)
class Evaluation:
    """A checked evaluation, ready to run: the config the ranks run and what it evaluates."""

    cfg: Config
    shape: RunShape
    source: ModelSource
    data: Path
    windows: int
    seq_len: int


def find_model(path: Path) -> ModelSource:
    """MODEL as a Hugging Face folder or a checkpoint; ConfigError naming what it is not."""
    from meshfit.models.hf import model_from_hf_config

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"MODEL {path} {'is a file' if path.exists() else 'does not exist'}; give {MODEL_HELP}")
    if (path / "config.json").is_file() and not (path / store.MARKER).exists():
        if not list(path.glob("*.safetensors")):
            raise ConfigError(f"MODEL {path} has a config.json but no *.safetensors weights; give {MODEL_HELP}")
        try:
            return ModelSource("huggingface", path, model_from_hf_config(path / "config.json"))
        except ValueError as exc:
            raise ConfigError(f"MODEL {exc}") from None
    one = (path / store.MARKER).is_file()
    if not one and not any(store.complete_checkpoints(root) for root in (path, path / "checkpoints")):
        raise ConfigError(f"MODEL {path} holds neither a Hugging Face model nor a complete checkpoint; give "
                          f"{MODEL_HELP}")
    notes: list[str] = []
    try:
        if one:  # one checkpoint: its files are checked here, and the ranks trust them
            folder, marker = path, store.verify(path)
        else:  # the latest intact one (find_checkpoint checks each one's files while choosing)
            folder = find_checkpoint(path, notes, ("evaluate", "evaluating"))
            marker = store.read_marker(folder)
    except CheckpointError as exc:
        raise ConfigError(f"MODEL {exc}") from None
    if not isinstance(marker.get("model_config"), dict):
        raise ConfigError(f"MODEL {folder / store.MARKER} has no model_config: the checkpoint's model is unknown")
    return ModelSource("checkpoint", folder, ModelConfig(**marker["model_config"]), marker.get("step"), notes)


def prepare(model_path: Path, data: Path, seq_len: int, windows: int, world: int, layout: str | None = None,
            overrides: list[str] | None = None) -> Evaluation:
    """Every check of an evaluation, before any rank starts; ConfigError naming the flag or file."""
    if windows < 1:
        raise ConfigError(f"--windows {windows}: give the number of windows to evaluate, at least 1")
    if seq_len < 1:
        raise ConfigError(f"--seq-len {seq_len}: give the tokens per window (less one), at least 1")
    overrides = [*_layout_overrides(layout), *_checked(overrides or [])]
    source = find_model(model_path)
    model = source.model
    if seq_len > model.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_seq_len={model.max_seq_len} (the positions "
                          f"it has); use --seq-len ≤ {model.max_seq_len}")
    sections = _sections(source, data, seq_len)
    cfg = load_config(None, overrides, sections)
    _check_data(cfg, data, seq_len, windows, model.vocab_size)
    dims = _dims(cfg, world)
    if source.kind == "checkpoint" and model.padded_vocab % dims.tp:
        raise ConfigError(f"MODEL {source.path}: its embedding has {model.padded_vocab} rows as saved, which "
                          f"parallel.tp={dims.tp} does not divide; evaluate it with a tp that divides "
                          f"{model.padded_vocab}, or evaluate its `meshfit export`, which any tp can split")
    sections["train"].update(_batches(cfg, dims, windows))
    cfg = load_config(None, overrides, sections)
    shape = resolve_run(cfg, world)  # the layout and the rest, as `meshfit train` checks them
    return Evaluation(cfg, shape, source, Path(data), windows, seq_len)


def _sections(source: ModelSource, data: Path, seq_len: int) -> dict[str, dict[str, Any]]:
    """The run config of an evaluation: the model as saved, the file as the held-out data."""
    model = {f.name: getattr(source.model, f.name) for f in dataclasses.fields(ModelConfig)}
    if source.kind == "huggingface":
        model["pad_vocab_to"] = None  # padded for the layout's tp, as a training run from these weights is
        model["init_from"] = str(source.path)
    path = str(data)
    kind = "tokens" if Path(data).suffix in (".npy", ".bin") else "text"
    return {"model": model, "data": {"source": kind, "path": path, "val_path": path},
            "train": {"seq_len": seq_len, "eval_every": 1, "steps": 1}}


def _checked(overrides: list[str]) -> list[str]:
    """--set items, less those the command decides (refused naming the flag that does)."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        section = key.partition(".")[0]
        if key in OWN_KEYS:
            raise ConfigError(f"--set {item!r}: {key} is what {OWN_KEYS[key]} gives; use {OWN_KEYS[key]}")
        if section == "model" and key != "model.attention":
            raise ConfigError(f"--set {item!r}: the model's shape and weights come from MODEL (only "
                              "model.attention, the attention kernel, can be chosen)")
        if section in RUN_SECTIONS:
            raise ConfigError(f"--set {item!r}: an evaluation writes no run, so {section}.* does not apply")
    return overrides


def _layout_overrides(text: str | None) -> list[str]:
    """--layout KEY=VAL,… (the keys of `meshfit plan`/`verify`'s --layout) as --set items."""
    if not text:
        return []
    try:
        values = parse_assignments(text, Layout, "--layout")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    section = {"schedule": "pipeline", "virtual_stages": "pipeline", "micro_batch": "train"}
    return [f"{section.get(key, 'parallel')}.{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in values.items()]


def _check_data(cfg: Config, data: Path, seq_len: int, windows: int, vocab_size: int) -> None:
    """The file exists and has the form of data.path; its ids fit the model; it holds the windows."""
    source = cfg.data
    if source.source == "text" and source.tokenizer == "bpe" and Path(source.path) == Path(data):
        raise ConfigError("data.tokenizer=bpe: give the text the model was trained on with --set data.path=… (a BPE "
                          "tokenizer is trained on it, as in training, and encodes --data)")
    try:
        check_files(source.source, data, seq_len, source.tokenizer, source.token_dtype, vocab_size)
        if source.source == "tokens":  # ids beyond the vocabulary: found here, not by the ranks
            load_token_file(data, vocab_size, source.token_dtype)
        count = token_count(source.source, data, source.tokenizer, source.token_dtype)
        if count is None:  # BPE text: its count is known once encoded by the training text's tokenizer
            count = len(tokenize_text(data, source.tokenizer, vocab_size, None, trained_on=source.path))
    except DataError as exc:
        raise ConfigError(f"--data {exc}") from None
    if count is not None and windows > window_count(count, seq_len):
        holds = window_count(count, seq_len)
        raise ConfigError(f"--windows {windows}: --data {data} holds {count} tokens, i.e. {holds} windows of "
                          f"--seq-len + 1 = {seq_len + 1} tokens; use --windows ≤ {holds}")


def _dims(cfg: Config, world: int) -> ParallelDims:
    p = cfg.parallel
    try:
        return ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.tp, p.pp, world, p.zero_stage, p.cp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _batches(cfg: Config, dims: ParallelDims, windows: int) -> dict[str, int]:
    """train.global_batch and train.eval_batches reading exactly `windows` windows: batches split evenly
    over the data-parallel ranks (and, pipelined, into enough micro-batches to fill the pipeline)."""
    if dims.pp > 1:  # the per-pipeline batch splits into pipeline.microbatches (≥ pp unless GPipe)
        unit = dims.dp * (cfg.pipeline.microbatches or least_microbatches(cfg.pipeline.schedule, dims.pp))
    else:
        unit = dims.dp * (cfg.train.micro_batch or 1)
    given = "global_batch" in cfg.train.model_fields_set
    if given:
        batch = cfg.train.global_batch
        if windows % batch:
            raise ConfigError(f"--windows {windows} is not a multiple of train.global_batch={batch}: the windows "
                              f"are read in whole batches; use --windows {_multiples(batch, windows)}")
        return {"global_batch": batch, "eval_batches": windows // batch}
    if windows % unit:
        per_rank = "pipeline micro-batches" if dims.pp > 1 else "windows of train.micro_batch"
        what = (f"the {dims.dp} data-parallel ranks" if unit == dims.dp else
                f"the {dims.dp} data-parallel rank{'s' if dims.dp > 1 else ''} × {unit // dims.dp} {per_rank}")
        raise ConfigError(f"--windows {windows} does not split evenly over {what}: use --windows "
                          f"{_multiples(unit, windows)}")
    most = max(unit, WINDOWS_PER_RANK * dims.dp)
    batch = max(b for b in range(unit, min(windows, most) + 1, unit) if windows % b == 0)
    return {"global_batch": batch, "eval_batches": windows // batch}


def _multiples(unit: int, near: int) -> str:
    below = near // unit * unit
    return f"{below} or {below + unit}" if below else str(unit)
