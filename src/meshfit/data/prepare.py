"""`meshfit prepare`: a corpus tokenized once into token shards (data/shards.py) that runs read directly.

Documents stream from the inputs in order (data/documents.py) in batches; ``workers`` processes tokenize
the batches (at most two per worker in flight, so memory stays bounded whatever the corpus size) and the
results are written in input order. Shards are cut at the first document boundary past ``shard_tokens``:
the files depend on the documents alone, never on the worker count. Everything is written into a staging
folder beside ``out`` and renamed into place at the end; a failure or Ctrl-C removes it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from meshfit.data.documents import Counts, input_files, read_documents
from meshfit.data.errors import DataError
from meshfit.data.shards import FORMAT, METADATA, VERSION, mask_file, shard_files
from meshfit.data.tokenizer import Pretrained, load_tokenizer

DEFAULT_SHARD_TOKENS = 1 << 28  # 256M tokens: 512 MB files at uint16
BATCH_CHARS = 1 << 20  # characters of text per task: large enough to amortize a task, small for memory

_worker_tokenizer: Pretrained | None = None


def _init_worker(folder: str) -> None:
    global _worker_tokenizer  # one tokenizer per worker process, loaded once
    _worker_tokenizer = load_tokenizer(folder)


def _encode(texts: list[Any]) -> list[Any]:
    assert _worker_tokenizer is not None
    return _encode_with(_worker_tokenizer, texts)


def _encode_with(tokenizer: Pretrained, texts: list[Any]) -> list[Any]:
    """Documents' ids; (prompt, response) pairs give (ids, counted) each."""
    if texts and isinstance(texts[0], tuple):
        return tokenizer.encode_pairs(texts)
    return tokenizer.encode(texts)


def _batches(documents: Iterator[Any]) -> Iterator[list[Any]]:
    batch, chars = [], 0
    for text in documents:
        batch.append(text)
        chars += sum(map(len, text)) if isinstance(text, tuple) else len(text)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encoded(batches: Iterator[list[Any]], tokenizer: Pretrained, workers: int) -> Iterator[list[Any]]:
    """Each batch's ids, in order: in this process with one worker, else in a pool of `workers`."""
    if workers == 1:
        for batch in batches:
            yield _encode_with(tokenizer, batch)
        return
    with mp.get_context("spawn").Pool(workers, _init_worker, (str(tokenizer.folder),)) as pool:
        flight: deque = deque()
        for batch in batches:
            flight.append(pool.apply_async(_encode, (batch,)))
            if len(flight) >= 2 * workers:
                yield flight.popleft().get()
        while flight:
            yield flight.popleft().get()


class _ShardWriter:
    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, masked: bool = False) -> None:
        self.folder, self.dtype, self.shard_tokens, self.masked = folder, dtype, shard_tokens, masked
        self.shards: list[dict[str, Any]] = []
        self.max_id = -1
        self._open()

    def _open(self) -> None:
        tokens, offsets = shard_files(len(self.shards))
        self.shards.append({"tokens": tokens, "offsets": offsets, "n_tokens": 0, "n_documents": 0})
        self.handle = open(self.folder / tokens, "wb")
        if self.masked:
            self.shards[-1]["mask"] = mask_file(len(self.shards) - 1)
            self.mask_handle = open(self.folder / self.shards[-1]["mask"], "wb")
        self.offsets = [0]

    def add(self, ids: np.ndarray, counted: np.ndarray | None = None) -> None:
        shard = self.shards[-1]
        if shard["n_tokens"] >= self.shard_tokens:
            self._close()
            self._open()
            shard = self.shards[-1]
        self.handle.write(ids.astype(self.dtype, copy=False).tobytes())
        if counted is not None:
            self.mask_handle.write(counted.tobytes())
        shard["n_tokens"] += len(ids)
        shard["n_documents"] += 1
        self.offsets.append(shard["n_tokens"])
        self.max_id = max(self.max_id, int(ids.max()))

    def _close(self) -> None:
        self.handle.close()
        if self.masked:
            self.mask_handle.close()
        np.asarray(self.offsets, dtype=np.int64).tofile(self.folder / self.shards[-1]["offsets"])

    def finish(self) -> None:
        self._close()


def _metadata(writer: _ShardWriter, tokenizer: Pretrained, files: list[Path], field: str | tuple[str, str],
              counts: Counts) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "dtype": writer.dtype.name,
            "tokens": sum(s["n_tokens"] for s in writer.shards), "documents": counts.documents,
            "skipped_empty_documents": counts.skipped_empty, "max_id": writer.max_id,
            "tokenizer": tokenizer.describe(), "field": field, "loss_mask": writer.masked,
            "inputs": [{"path": str(f), "bytes": f.stat().st_size} for f in files], "shards": writer.shards}


def check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise DataError(f"--out {out} already exists and is not empty: choose another folder, or replace it "
                        "with --overwrite")


def prepare(inputs: list[Path], tokenizer_folder: Path, out: Path, field: str | tuple[str, str] = "text",
            workers: int = 1,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, skip_empty: bool = False, overwrite: bool = False,
            on_progress: Callable[[Counts], None] | None = None) -> dict[str, Any]:
    """Tokenize `inputs` into shards in `out`; returns the metadata. DataError for bad input, before
    `out` is touched (a bad document found part way leaves `out` as it was). `field` a (prompt, response)
    pair: supervised fine-tuning data, whose prompt tokens are stored as not counted by the loss."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism, in every process
    files = input_files(inputs)
    tokenizer = load_tokenizer(tokenizer_folder, "--tokenizer")
    check_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.prepare-", dir=out.parent))
    try:
        dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
        masked = not isinstance(field, str)
        writer, counts = _ShardWriter(staging, dtype, shard_tokens, masked), Counts()
        for ids_of_batch in _encoded(_batches(read_documents(files, field, skip_empty, counts)), tokenizer, workers):
            for encoded in ids_of_batch:
                ids, counted = encoded if masked else (encoded, None)
                writer.add(ids, counted)
            if on_progress is not None:
                on_progress(counts)
        writer.finish()
        if counts.documents == 0:
            raise DataError(f"{', '.join(map(str, inputs))}: no documents to prepare")
        meta = _metadata(writer, tokenizer, files, field, counts)
        (staging / METADATA).write_text(json.dumps(meta, indent=1) + "\n")
        _replace(staging, out)
        return meta
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace(staging: Path, out: Path) -> None:
    """Move the finished folder to `out`; an earlier folder there (--overwrite) goes only once it is in."""
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / "data")
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out)
