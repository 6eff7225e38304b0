"""`meshfit export`: the model weights of any checkpoint as Hugging Face-style safetensors + config.json.

Works in one process whatever layout saved the checkpoint: DCP's metadata gives every tensor's full
shape, and loading without a process group assembles the shards.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshfit.models.config import ModelConfig
from meshfit.runs import hf_shards
from meshfit.train import checkpoint_reader
from meshfit.train import checkpoint_store as store
from meshfit.train.checkpoint_store import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What an export writes (shards matched by hf_shards.SHARD): an --out holding any is not written over
# unless asked, and then the earlier export's files go, so that no stale shard stays beside the new ones.
OUT_FILES = (hf_shards.INDEX, "config.json")
# The tokenizer files transformers reads from a model folder, copied from the run's tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")
DEFAULT_MAX_SHARD = 5 * 10**9  # transformers' default shard size (5GB)


def find_checkpoint(path: Path, notes: list[str] | None = None, use: tuple[str, str] = ("export", "exporting")
                    ) -> Path:
    """A checkpoint folder from: itself, a checkpoints folder, or a run folder (the latest intact one).

    A damaged checkpoint of a checkpoints or run folder is skipped for the one before it; `notes` gets a
    line naming what was skipped and why (the command's own words, not a Python warning). `use`: what the
    command does with it, as a verb and its -ing form, for those words."""
    path = Path(path)
    if (path / store.MARKER).is_file():
        return path
    for root in (path, path / "checkpoints"):
        problems = []
        for folder in store.complete_checkpoints(root):
            try:
                store.verify(folder)
            except CheckpointError as exc:
                problems.append(str(exc))
                continue
            if notes is not None:
                notes += [f"note: skipped a damaged checkpoint ({p}); {use[1]} the one before it, {folder}"
                          for p in problems]
            return folder
        if problems:
            raise CheckpointError(f"{path}: no intact checkpoint to {use[0]}; every complete one is damaged:\n  "
                                  + "\n  ".join(problems))
    what = "does not exist" if not path.exists() else "is a file" if path.is_file() else "holds no complete checkpoint"
    raise CheckpointError(f"{path} {what}: give a step-N checkpoint folder, a checkpoints folder or a run folder "
                          "of `meshfit train`")


def check_out(out_dir: Path, overwrite: bool = False) -> None:
    """--out can be written, and nothing there would be silently replaced (unless `overwrite`)."""
    from meshfit.config import ConfigError
    from meshfit.train.preflight import check_location

    check_location(out_dir, "--out")
    existing = _earlier_export(Path(out_dir))
    if existing and not overwrite:
        raise ConfigError(f"--out {out_dir} already holds {' and '.join(existing)} (an earlier export?): replace "
                          f"{'it' if len(existing) == 1 else 'them'} with --overwrite, or choose another --out")


def _earlier_export(out_dir: Path) -> list[str]:
    if not out_dir.is_dir():
        return []
    return sorted(p.name for p in out_dir.iterdir()
                  if p.name in (*OUT_FILES, *TOKENIZER_FILES) or hf_shards.SHARD.match(p.name))


def read_model(folder: Path) -> tuple[dict[str, torch.Tensor], ModelConfig, dict]:
    """Full model weights (plain names) of a checkpoint, its model config and its marker."""
    marker = store.verify(folder)
    if not isinstance(marker.get("model_config"), dict):
        raise CheckpointError(f"{folder / store.MARKER} has no model_config: the checkpoint's model is unknown")
    metadata = checkpoint_reader.read_metadata(folder)  # through the allow-list: nothing in it runs
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
        checkpoint_reader.load(state, folder, no_dist=True)
    weights = {key.removeprefix("model."): value for key, value in state.items()}
    return weights, ModelConfig(**marker["model_config"]), marker


def _shapes(folder: Path) -> tuple[dict[str, torch.Size], dict[str, torch.dtype]]:
    metadata = checkpoint_reader.read_metadata(folder)  # through the allow-list: nothing in it runs
    model = {key.removeprefix("model."): meta for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    return {k: m.size for k, m in model.items()}, {k: m.properties.dtype for k, m in model.items()}


def tokenizer_files(folder: Path, cfg: ModelConfig) -> tuple[list[Path], str]:
    """The tokenizer files of the run that saved checkpoint `folder`, and a note saying where they come
    from (or why there are none): the BPE the run trained on its text (kept in its run folder), else the
    tokenizer beside the weights its run started from (model.init_from)."""
    import yaml

    run_dir = folder.parent.parent  # RUN/checkpoints/step-N
    trained = sorted(run_dir.glob(f"bpe-{cfg.vocab_size}-*/tokenizer.json"))
    if trained:
        return [trained[-1]], f"the BPE tokenizer the run trained ({trained[-1]})"
    try:
        init_from = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("model", {}).get("init_from")
    except (OSError, yaml.YAMLError, AttributeError):
        init_from = None
    files = [Path(init_from) / n for n in TOKENIZER_FILES if init_from and (Path(init_from) / n).is_file()]
    if files:
        return files, f"the tokenizer of model.init_from ({init_from})"
    return [], ("no tokenizer files: the run read token files or used the byte tokenizer (token id = UTF-8 byte), "
                "which has none")


def export(checkpoint: Path, out_dir: Path, dtype: str = "fp32", overwrite: bool = False,
           notes: list[str] | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD) -> list[Path]:
    """Write the checkpoint's model into out_dir as Hugging Face safetensors shards (an index when there is
    more than one), config.json and the run's tokenizer files; returns the files. Raises ConfigError for a
    bad --out and CheckpointError for a path without an intact checkpoint, before anything is written.

    The files are written into a folder inside out_dir and moved into place once all are written: a failed
    export leaves an earlier one as it was."""
    check_out(out_dir, overwrite)
    folder = find_checkpoint(checkpoint, notes)
    marker = store.verify(folder)
    if not isinstance(marker.get("model_config"), dict):
        raise CheckpointError(f"{folder / store.MARKER} has no model_config: the checkpoint's model is unknown")
    model_cfg = ModelConfig(**marker["model_config"])
    shapes, dtypes = _shapes(folder)
    tokenizer, where = tokenizer_files(folder, model_cfg)
    if notes is not None:
        notes.append(f"note: {where}" if not tokenizer else f"note: tokenizer files from {where}")
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out_dir))
    try:
        # Rows added for tensor parallelism are not part of the model: the export has the real vocabulary.
        files = hf_shards.write_shards(folder, shapes, dtypes, model_cfg, staging, DTYPES[dtype], max_shard_bytes)
        files += [Path(shutil.copy2(f, staging / f.name)) for f in tokenizer]
        earlier = _earlier_export(out_dir)
        for file in files:  # a rename within one folder: each file appears whole
            os.replace(file, out_dir / file.name)
        for name in set(earlier) - {f.name for f in files}:  # an earlier export's stale shards
            (out_dir / name).unlink()
        return [out_dir / f.name for f in files]
    finally:
        shutil.rmtree(staging, ignore_errors=True)
