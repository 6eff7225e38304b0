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

from meshfit.data.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".parquet")
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


def _jsonl(file: Path, field: str) -> Iterator[tuple[str, str, float]]:
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
            if not isinstance(record, dict) or field not in record:
                keys = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{file}{where}: no field {field!r} (found: {keys}); choose the text's key with --field")
            if not isinstance(record[field], str):
                raise DataError(f"{file}{where}: field {field!r} holds {type(record[field]).__name__}, not text")
            yield where, record[field], len(raw)


def _parquet(file: Path, field: str) -> Iterator[tuple[str, str, float]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{file}: reading parquet needs pyarrow: pip install 'meshfit[parquet]'") from None
    try:
        table = pq.ParquetFile(file)
    except Exception as exc:  # pyarrow's own error types
        raise DataError(f"{file}: cannot be read as parquet ({exc})") from None
    if field not in table.schema_arrow.names:
        raise DataError(f"{file}: no column {field!r} (columns: {', '.join(table.schema_arrow.names[:8])}); "
                        "choose the text's column with --field")
    row, per_row = 0, file.stat().st_size / max(1, table.metadata.num_rows)
    for batch in table.iter_batches(batch_size=_PARQUET_BATCH, columns=[field]):
        for value in batch.column(0).to_pylist():
            row += 1
            if not isinstance(value, str):
                raise DataError(f"{file}, row {row}: column {field!r} holds {type(value).__name__}, not text")
            yield f", row {row}", value, per_row


def read_documents(files: list[Path], field: str = "text", skip_empty: bool = False,
                   counts: Counts | None = None) -> Iterator[str]:
    """Every document's text, in order. `counts` (if given) is updated as documents are read."""
    counts = counts if counts is not None else Counts()
    for file in files:
        done = counts.bytes + file.stat().st_size
        if file.suffix == ".txt":
            records: Iterator[tuple[str, str, float]] = iter([("", _text(file, "", file.read_bytes()), 0)])
        elif file.suffix == ".jsonl":
            records = _jsonl(file, field)
        else:
            records = _parquet(file, field)
        for where, text, nbytes in records:
            counts.bytes += nbytes
            if not text.strip():
                if not skip_empty:
                    raise DataError(f"{file}{where}: empty document; drop it, or pass --skip-empty to skip such "
                                    "documents (they are counted)")
                counts.skipped_empty += 1
                continue
            counts.documents += 1
            yield text
        counts.bytes = done
