"""Prepared token shards (what `meshfit prepare` writes) and their reader.

A prepared folder holds ``meshfit-data.json`` and, per shard, ``shard-NNNNN.tokens`` (the token ids of its
documents one after another, each closed by EOS, raw in ``dtype``) and ``shard-NNNNN.offsets`` (int64:
where each document starts, then the token count). The metadata records the tokenizer (its sha256,
vocabulary, BOS and EOS), the dtype, the token and document counts and the largest id, so a run checks
the ids against the model from the metadata instead of scanning every token, and each shard's size
against its counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from meshfit.data.errors import DataError

METADATA = "meshfit-data.json"
FORMAT = "meshfit-token-shards"
VERSION = 1


def shard_files(index: int) -> tuple[str, str]:
    return f"shard-{index:05d}.tokens", f"shard-{index:05d}.offsets"


def mask_file(index: int) -> str:
    """Prompt/response data (`meshfit prepare --prompt-field/--response-field`): one byte per token, 1 where
    the loss counts the token as a target (the response and its EOS), 0 on the prompt."""
    return f"shard-{index:05d}.mask"


def is_prepared(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / METADATA).is_file()


def read_metadata(folder: str | Path) -> dict[str, Any]:
    """The folder's metadata, checked against its files' sizes; DataError naming the file otherwise."""
    folder = Path(folder)
    path = folder / METADATA
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot be read ({exc}); prepare the folder again with `meshfit prepare`") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(f"{path}: not the metadata of `meshfit prepare` (format {FORMAT} version {VERSION})")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for shard in meta["shards"]:
        expected_sizes = [(shard["tokens"], shard["n_tokens"] * itemsize),
                          (shard["offsets"], (shard["n_documents"] + 1) * 8)]
        if meta.get("loss_mask"):
            expected_sizes.append((shard["mask"], shard["n_tokens"]))
        for name, expected in expected_sizes:
            size = (folder / name).stat().st_size if (folder / name).is_file() else None
            if size != expected:
                found = "is missing" if size is None else f"holds {size} bytes"
                raise DataError(f"{folder / name} {found}, but {METADATA} says {expected} bytes: the shards and their "
                                "metadata disagree (a copy cut short?); prepare the folder again")
    return meta


class PreparedTokens:
    """The tokens of a prepared folder as one 1-D array: ``len()`` and integer-array indexing (any shape),
    reading only the rows asked for from the memory-mapped shards; slices give views.

    A folder with a loss mask (prompt/response data) gives each token the loss does not count as a target
    as ``-(id + 1)`` (int64): the mask travels through every reader of windows (shuffling, mixtures,
    held-out data) with the ids, and `split_counted` turns it back into ids and a mask."""

    ndim = 1

    def __init__(self, folder: str | Path, start: int = 0, stop: int | None = None,
                 meta: dict[str, Any] | None = None) -> None:
        self.folder = Path(folder)
        self.meta = meta if meta is not None else read_metadata(self.folder)
        self.dtype = np.dtype(self.meta["dtype"])
        self.parts = [np.memmap(self.folder / s["tokens"], dtype=self.dtype, mode="r")
                      if s["n_tokens"] else np.zeros(0, self.dtype) for s in self.meta["shards"]]
        self.masks = None
        if self.meta.get("loss_mask"):
            self.masks = [np.memmap(self.folder / s["mask"], dtype=np.uint8, mode="r")
                          if s["n_tokens"] else np.zeros(0, np.uint8) for s in self.meta["shards"]]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self.start, self.stop = start, self.meta["tokens"] if stop is None else stop
        self.filename = str(self.folder)

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    @property
    def max_id(self) -> int:
        return int(self.meta["max_id"])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            begin, end, step = index.indices(len(self))
            if step != 1:
                raise IndexError("prepared tokens take slices with step 1")
            return PreparedTokens(self.folder, self.start + begin, self.start + max(begin, end), self.meta)
        positions = np.asarray(index, dtype=np.int64) + self.start
        if positions.size and (positions.min() < self.start or positions.max() >= self.stop):
            raise IndexError(f"token position out of range 0..{len(self) - 1}")
        flat = positions.reshape(-1)
        shard = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype if self.masks is None else np.int64)
        for s in np.unique(shard):
            rows = shard == s
            at = flat[rows] - self.starts[s]
            out[rows] = self.parts[s][at]
            if self.masks is not None:
                out[rows] = np.where(self.masks[s][at] == 1, out[rows], -out[rows] - 1)
        return out.reshape(positions.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError("prepared tokens are read by index; converting them whole would read every shard")


def split_counted(tokens: Any) -> tuple[Any, Any]:
    """(ids, counted) of rows read from prepared tokens (numpy or torch): `counted` is None when nothing
    is masked."""
    negative = tokens < 0
    if not negative.any():
        return tokens, None
    return (-tokens - 1) * negative + tokens * ~negative, ~negative


def files_of(folder: str | Path) -> list[Path]:
    """The metadata and every shard file: what identifies the data (data/fingerprint.py)."""
    folder = Path(folder)
    meta = read_metadata(folder)
    return [folder / METADATA] + [folder / n for s in meta["shards"]
                                  for n in (s["tokens"], s["offsets"], *([s["mask"]] if "mask" in s else []))]
