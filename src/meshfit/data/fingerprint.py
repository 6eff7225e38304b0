"""What a run trains on, as a checkpoint records it: source, files, their bytes and a content fingerprint,
tokenizer. A resume compares it with the data it is given, since a saved data position means nothing in
other data (train/preflight.py).

The fingerprint is SHA-256 of every file's name, size and content. Above FULL_HASH_BYTES of data in all it
hashes SAMPLES evenly spaced blocks of SAMPLE_BYTES of each file instead (plus every size): hashing a
terabyte corpus at each start would take longer than many runs' first hour. Such a fingerprint catches
any change of size and any edit that touches a sampled block, not every byte changed in place;
`identity["fingerprint"]` starts with the kind it is ("sha256:" or "sha256-sampled:").
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from meshfit.data.files import _text_files
from meshfit.data.shards import files_of, is_prepared
from meshfit.data.tokenizer import is_tokenizer_folder, load_tokenizer
from meshfit.data.windows import resolve_shuffle

FULL_HASH_BYTES = 1 << 30
SAMPLES = 256
SAMPLE_BYTES = 1 << 20
_ABSENT = {"shuffle": False}  # what an identity without the key means


def data_files(source: str, path: str | os.PathLike) -> list[Path]:
    """The files a data source reads, as the loaders list them."""
    if source == "tokens" and is_prepared(path):
        return files_of(path)
    return _text_files(Path(path)) if source == "text" else [Path(path)]


def _sampled(handle: Any, size: int, digest: Any) -> None:
    if size <= SAMPLES * SAMPLE_BYTES:
        digest.update(handle.read())
        return
    for i in range(SAMPLES):
        handle.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
        digest.update(handle.read(SAMPLE_BYTES))


def fingerprint(files: list[Path]) -> tuple[str, str]:
    """(kind, hex digest) of the files' names, sizes and contents; kind is "sha256" or "sha256-sampled"."""
    sizes = [file.stat().st_size for file in files]
    full = sum(sizes) <= FULL_HASH_BYTES
    digest = hashlib.sha256()
    for file, size in zip(files, sizes, strict=True):
        digest.update(file.name.encode() + b"\0" + size.to_bytes(8, "little"))
        with open(file, "rb") as handle:
            if full:
                for block in iter(lambda: handle.read(1 << 24), b""):
                    digest.update(block)
            else:
                _sampled(handle, size, digest)
    return ("sha256" if full else "sha256-sampled"), digest.hexdigest()


def tokenizer_identity(tokenizer: str) -> str:
    """byte, bpe, or a tokenizer folder by its contents (the same files elsewhere are the same tokenizer)."""
    if tokenizer in ("byte", "bpe") or not is_tokenizer_folder(tokenizer):
        return tokenizer
    return f"sha256:{load_tokenizer(tokenizer).digest}"


def data_identity(data: Any, seed: int | None = None) -> dict[str, Any]:
    """The identity of a config's data section (synthetic data: its source alone; the seed is train's). A
    seeded order (data.shuffle, data.sources) adds `seed`, train.seed, which chooses it."""
    if data.source == "synthetic":
        return {"source": "synthetic"}
    if data.sources is not None:
        return _mixture_identity(data, seed)
    identity = {"source": data.source, **_files_identity(data.source, data.path),
                "tokenizer": tokenizer_identity(data.tokenizer), "token_dtype": data.token_dtype}
    if resolve_shuffle(data.shuffle, data.path):  # absent when off: file order, as before the setting existed
        identity |= {"shuffle": True, "seed": seed}
    return identity


def _files_identity(source: str, path: str) -> dict[str, Any]:
    files = data_files(source, path)
    kind, digest = fingerprint(files)
    return {"path": str(Path(path).resolve()), "files": len(files),
            "bytes": sum(file.stat().st_size for file in files), "fingerprint": f"{kind}:{digest}"}


def _mixture_identity(data: Any, seed: int | None) -> dict[str, Any]:
    """Flat, so that a difference names the source and what changed in it (`sources[1].weight`)."""
    identity = {"source": data.source, "tokenizer": tokenizer_identity(data.tokenizer), "token_dtype": data.token_dtype,
                "sources": len(data.sources), "mix_block": data.mix_block, "seed": seed}
    for i, entry in enumerate(data.sources):
        part = {**_files_identity(data.source, entry.path), "weight": entry.weight,
                "val_fraction": entry.val_fraction, "shuffle": resolve_shuffle(data.shuffle, entry.path)}
        identity |= {f"sources[{i}].{key}": value for key, value in part.items()}
    return identity


def identity_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`data.key: saved …, now …` for each part of the identity that differs (contents by fingerprint)."""
    lines = []
    for key in dict.fromkeys([*saved, *now]):
        before, after = saved.get(key, _ABSENT.get(key)), now.get(key, _ABSENT.get(key))
        if before != after:
            what = key.replace("fingerprint", "contents (fingerprint)")
            lines.append(f"data {what}: saved {_short(before)}, now {_short(after)}")
    return lines


def _short(value: Any) -> str:
    return f"{value[:value.index(':') + 13]}…" if isinstance(value, str) and value.startswith("sha256") else repr(value)
