"""`meshfit export`: the model weights of any checkpoint as Hugging Face-style safetensors + config.json.

Works in one process whatever layout saved the checkpoint: DCP's metadata gives every tensor's full
shape, and loading without a process group assembles the shards.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshfit.models.config import ModelConfig
from meshfit.models.hf_weights import save_hf
from meshfit.models.init import strip_padding
from meshfit.train import checkpoint_store as store
from meshfit.train.checkpoint_store import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def find_checkpoint(path: Path) -> Path:
    """A checkpoint folder from: itself, a checkpoints folder, or a run folder (the latest intact one)."""
    path = Path(path)
    if (path / store.MARKER).is_file():
        return path
    for root in (path, path / "checkpoints"):
        if store.step_folders(root):
            folder, _ = store.choose(root)
            if folder is not None:
                return folder
    raise CheckpointError(f"{path}: no complete checkpoint there (give a step-N folder, a checkpoints folder "
                          "or a run folder)")


def read_model(folder: Path) -> tuple[dict[str, torch.Tensor], ModelConfig, dict]:
    """Full model weights (plain names) of a checkpoint, its model config and its marker."""
    marker = store.verify(folder)
    reader = FileSystemReader(str(folder))
    metadata = reader.read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
        dcp.load(state, storage_reader=reader, no_dist=True)
    weights = {key.removeprefix("model."): value for key, value in state.items()}
    return weights, ModelConfig(**marker["model_config"]), marker


def export(checkpoint: Path, out_dir: Path, dtype: str = "fp32") -> list[Path]:
    """Write out_dir/model.safetensors and out_dir/config.json; returns the files."""
    folder = find_checkpoint(checkpoint)
    weights, model_cfg, _ = read_model(folder)
    # Rows added for tensor parallelism are not part of the model: the export has the real vocabulary.
    return save_hf(strip_padding(weights, model_cfg), model_cfg, out_dir, DTYPES[dtype])
