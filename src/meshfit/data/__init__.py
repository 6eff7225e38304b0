"""Training data: deterministic, resumable, rank-partitioned token batches.

Typical use::

    source = make_source(cfg.data.source, path=cfg.data.path, vocab_size=V, seed=seed)
    batches = TokenBatches(source, seq_len=T, global_batch=B, dp_rank=r, dp_size=n, name=cfg.data.path)
    inputs, targets = batches.next_batch()

A weighted mixture of token arrays is a ``Mixture`` of ``Part``s, read by ``TokenBatches`` the same way;
``shuffle=True`` reads a token array's windows in a seeded order per epoch.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from meshfit.data.errors import DataError
from meshfit.data.files import check_files, load_token_file, tokenize_text, write_token_file
from meshfit.data.mixture import Mixture, Part

if TYPE_CHECKING:
    from meshfit.data.loader import TokenBatches
    from meshfit.data.synthetic import MarkovSource

# Imported on first use: they import torch, which the config (and with it `meshfit plan`) does not need.
_LAZY = {"TokenBatches": "meshfit.data.loader", "MarkovSource": "meshfit.data.synthetic"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshfit.data' has no attribute {name!r}")

__all__ = [
    "DataError",
    "MarkovSource",
    "Mixture",
    "Part",
    "TokenBatches",
    "check_files",
    "load_token_file",
    "make_source",
    "tokenize_text",
    "write_token_file",
]

SOURCES = ("synthetic", "text", "tokens")


def make_source(
    source: str,
    *,
    path: str | os.PathLike | None,
    vocab_size: int,
    seed: int,
    tokenizer: str = "byte",
    cache_dir: str | os.PathLike | None = None,
    token_dtype: str | None = None,
    trained_on: str | os.PathLike | None = None,
) -> MarkovSource | np.ndarray:
    """Build what ``TokenBatches`` reads from the ``data.*`` settings.

    ``synthetic`` ignores ``path``; ``text`` and ``tokens`` require it. ``seed``
    only affects the synthetic language. ``trained_on``: BPE text is encoded with the tokenizer of that
    text (held-out text, see ``tokenize_text``).
    """
    if source not in SOURCES:
        raise ValueError(f"data.source={source!r} is not valid; choose one of {', '.join(SOURCES)}")
    if source == "synthetic":
        from meshfit.data.synthetic import MarkovSource

        return MarkovSource(vocab_size, seed)
    if path is None:
        what = "a UTF-8 .txt file or a directory of .txt files" if source == "text" else "a .npy or .bin token file"
        raise ValueError(f"data.path is required when data.source={source!r}: give {what}")
    if source == "text":
        return tokenize_text(path, tokenizer, vocab_size, cache_dir, trained_on)
    return load_token_file(path, vocab_size, dtype=token_dtype)
