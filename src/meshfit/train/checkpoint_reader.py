"""Reading a checkpoint without running code from it.

torch.distributed.checkpoint (DCP) keeps a checkpoint's index in `.metadata`, a pickle that its
FileSystemReader loads with `pickle.load`, and the non-tensor entries (schedule, data position, optimizer
hyper-parameters) as `torch.load(..., weights_only=False)` blobs: a crafted file runs any code it names.
Checkpoints travel between people and machines, so meshfit reads both through allow-lists instead:

* `.metadata` with `AllowListUnpickler`, which resolves only the classes DCP's index is made of
  (`torch.distributed.checkpoint.metadata`'s dataclasses, its storage records, `torch.Size`, dtypes,
  layouts and paths); anything else is refused naming the file and the object;
* every other entry with torch's weights-only loader (`torch.load(weights_only=True)`), as DCP already reads
  tensors.

The SHA-256 sums in a checkpoint's `meshfit.json` detect damage, not tampering: whoever can write the folder
can rewrite them. What protects a reader is that nothing in a checkpoint is executed.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from meshfit.train.checkpoint_store import CheckpointError

METADATA = ".metadata"

# (module, name) pairs DCP's index pickles, as torch 2.11–2.13 write them.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided"), from a fixed table
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file names an object outside the allow-list: refused, never loaded and never skipped
    for an earlier checkpoint as if it were merely damaged."""


class AllowListUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only `_ALLOWED` and torch's dtypes; `path` names the file in errors."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"checkpoint file {self.path} names {module}.{name}, which a checkpoint index "
                               "never holds: refused without loading it (a checkpoint must not run code); "
                               "use a checkpoint meshfit wrote")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(f"checkpoint file {self.path} holds a persistent reference, which a checkpoint "
                               "index never holds: refused without loading it")


def read_metadata(folder: Path) -> Metadata:
    """A checkpoint folder's DCP index, read through the allow-list."""
    path = Path(folder) / METADATA
    try:
        with open(path, "rb") as handle:
            metadata = AllowListUnpickler(handle, path).load()
    except UnsafeCheckpoint:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError) as exc:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint file {path} is not a checkpoint index (it holds a "
                              f"{type(metadata).__name__})")
    return metadata


class CheckedReader(FileSystemReader):
    """FileSystemReader whose index is read through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank indexes: meshfit never writes them
            raise CheckpointError(f"checkpoint {self.path} has per-rank indexes, which meshfit does not write")
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor entries with torch's weights-only loader."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(f"checkpoint entry {read_item.dest_index.fqn} holds an object torch's "
                                   f"weights-only loader refuses: {str(exc).splitlines()[0]}") from None
        # DefaultLoadPlanner places the entry (flattened names and all) but reads its stream without the
        # allow-list: hand it the entry as loaded here, written again, so that it can hold nothing else.
        again = io.BytesIO()
        torch.save(loaded, again)
        again.seek(0)
        super().load_bytes(read_item, again)


def load(state: dict[str, Any], folder: Path, no_dist: bool = False) -> None:
    """dcp.load of `state` from `folder`, through the allow-lists."""
    dcp.load(state, storage_reader=CheckedReader(str(folder)), planner=WeightsOnlyLoadPlanner(),
             no_dist=no_dist)
