"""`meshfit export`: the model weights of any checkpoint as Hugging Face-style safetensors + config.json.

Works in one process whatever layout saved the checkpoint: DCP's metadata gives every tensor's full
shape, and loading without a process group assembles the shards.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshfit.models.config import ModelConfig
from meshfit.models.hf_weights import save_hf
from meshfit.models.init import strip_padding
from meshfit.train import checkpoint_reader
from meshfit.train import checkpoint_store as store
from meshfit.train.checkpoint_store import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OUT_FILES = ("model.safetensors", "config.json")  # what save_hf writes


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
    existing = [name for name in OUT_FILES if (Path(out_dir) / name).exists()]
    if existing and not overwrite:
        raise ConfigError(f"--out {out_dir} already holds {' and '.join(existing)} (an earlier export?): replace "
                          f"{'it' if len(existing) == 1 else 'them'} with --overwrite, or choose another --out")


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


def export(checkpoint: Path, out_dir: Path, dtype: str = "fp32", overwrite: bool = False,
           notes: list[str] | None = None) -> list[Path]:
    """Write out_dir/model.safetensors and out_dir/config.json; returns the files. Raises ConfigError for a
    bad --out and CheckpointError for a path without an intact checkpoint, before anything is written."""
    check_out(out_dir, overwrite)
    folder = find_checkpoint(checkpoint, notes)
    weights, model_cfg, _ = read_model(folder)
    # Rows added for tensor parallelism are not part of the model: the export has the real vocabulary.
    return save_hf(strip_padding(weights, model_cfg), model_cfg, out_dir, DTYPES[dtype])
