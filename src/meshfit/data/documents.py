"""Documents of a corpus, streamed in a fixed order from text, JSONL and parquet files.

A ``.txt`` file is one document; a ``.jsonl`` file holds one JSON object per line and a parquet file one
row per document, the text in ``field``. Folders are read recursively, files in sorted path order. Every
bad document names its file and line (or row): a line that is not JSON, an object without the field, a
value that is not text, an empty document (unless skipped), text that is not UTF-8.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshfit.data.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".parquet")
# The option that names the fields, for the messages: one text field, or a prompt and a response.
_FLAG = {False: "--field", True: "--prompt-field / --response-field"}
_PARQUET_BATCH = 1024  # rows read at a time: a parquet file larger than memory streams through


@dataclass
class Counts:
    """What was read: documents given out, and empty ones skipped (with ``skip_empty``)."""

    documents: int = 0
    skipped_empty: int = 0
    bytes: float = 0  # input bytes read so far (for progress)


def input_files(paths: list[Path]) -> list[Path]:
    """The files the inputs name, in order; DataError for a missing path or a folder without corpus files."""
    files: list[Path] = []
    for path in paths:
        if path.is_file():
            if path.suffix not in SUFFIXES:
                raise DataError(f"{path}: unknown input format {path.suffix!r}; valid: {', '.join(SUFFIXES)}")
            files.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise DataError(f"{path}: the folder holds no {', '.join(SUFFIXES)} files")
            files += found
        else:
            raise DataError(f"{path}: no such file or folder")
    return files


def _text(file: Path, where: str, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{file}{where}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def _jsonl(file: Path, fields: tuple[str, ...]) -> Iterator[tuple[str, tuple[str, ...], float]]:
    with open(file, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            where = f", line {number}"
            line = _text(file, where, raw)
            if not line.strip():
                continue  # a blank line between records
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{file}{where}: not JSON ({exc.msg}, column {exc.colno})") from None
            for field in fields:
                if not isinstance(record, dict) or field not in record:
                    keys = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else type(record).__name__
                    raise DataError(f"{file}{where}: no field {field!r} (found: {keys}); choose the text's key with "
                                    f"{_FLAG[len(fields) > 1]}")
                if not isinstance(record[field], str):
                    raise DataError(f"{file}{where}: field {field!r} holds {type(record[field]).__name__}, not text")
            yield where, tuple(record[field] for field in fields), len(raw)


def _parquet(file: Path, fields: tuple[str, ...]) -> Iterator[tuple[str, tuple[str, ...], float]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{file}: reading parquet needs pyarrow: pip install 'meshfit[parquet]'") from None
    try:
        table = pq.ParquetFile(file)
    except Exception as exc:  # pyarrow's own error types
        raise DataError(f"{file}: cannot be read as parquet ({exc})") from None
    for field in fields:
        if field not in table.schema_arrow.names:
            raise DataError(f"{file}: no column {field!r} (columns: {', '.join(table.schema_arrow.names[:8])}); "
                            f"choose the text's column with {_FLAG[len(fields) > 1]}")
    row, per_row = 0, file.stat().st_size / max(1, table.metadata.num_rows)
    for batch in table.iter_batches(batch_size=_PARQUET_BATCH, columns=list(fields)):
        for values in zip(*(batch.column(i).to_pylist() for i in range(len(fields))), strict=True):
            row += 1
            for field, value in zip(fields, values, strict=True):
                if not isinstance(value, str):
                    raise DataError(f"{file}, row {row}: column {field!r} holds {type(value).__name__}, not text")
            yield f", row {row}", tuple(values), per_row


def read_documents(files: list[Path], field: str | tuple[str, str] = "text", skip_empty: bool = False,
                   counts: Counts | None = None) -> Iterator[Any]:
    """Every document's text, in order; with two fields (prompt, response) each document's pair of texts.
    `counts` (if given) is updated as documents are read."""
    counts = counts if counts is not None else Counts()
    fields = (field,) if isinstance(field, str) else tuple(field)
    for file in files:
        done = counts.bytes + file.stat().st_size
        if file.suffix == ".txt":
            if len(fields) > 1:
                raise DataError(f"{file}: a text file holds one text, not a prompt and a response; give the pairs as "
                                ".jsonl or .parquet")
            records: Iterator[tuple[str, tuple[str, ...], float]] = iter(
                [("", (_text(file, "", file.read_bytes()),), 0)])
        elif file.suffix == ".jsonl":
            records = _jsonl(file, fields)
        else:
            records = _parquet(file, fields)
        for where, texts, nbytes in records:
            counts.bytes += nbytes
            text = texts[-1]  # a pair is empty when its response is: nothing of it would be trained on
            if not text.strip():
                if not skip_empty:
                    raise DataError(f"{file}{where}: empty document; drop it, or pass --skip-empty to skip such "
                                    "documents (they are counted)")
                counts.skipped_empty += 1
                continue
            counts.documents += 1
            yield texts[0] if len(texts) == 1 else texts
        counts.bytes = done
