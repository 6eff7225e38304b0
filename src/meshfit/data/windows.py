"""One token array cut into windows, read in file order or in a seeded order per epoch.

A token array of ``n`` tokens holds ``W = (n - 1) // seq_len`` windows of ``seq_len + 1`` tokens that
start ``seq_len`` apart, so each token after the first is a target exactly once per pass; the last
``(n - 1) % seq_len`` tokens are never targets. Sequence ``k`` of the stream is in epoch ``e = k // W`` at
``i = k % W`` and reads window ``i`` (file order) or ``perm(seed, stream, e)[i]`` (shuffled, permutation.py):
every window once per epoch, each epoch in another order, with nothing held but the key.

A token array is anything 1-D with ``len()`` and numpy fancy indexing (``tokens[index_array]``): a numpy
array, a memory map (only the rows asked for are read), or a reader of a folder of token shards.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from meshfit.data.errors import DataError
from meshfit.data.permutation import IndexPermutation
from meshfit.data.shards import is_prepared

_SALT = 0x77696E646F77  # "window": the window order's key differs from a blend's
_CACHED_EPOCHS = 4


def resolve_shuffle(setting: bool | None, path: str | os.PathLike | None) -> bool:
    """data.shuffle for the data at `path`: as set, or when unset on for a prepared data folder and off
    for anything else (a file, a folder of text), whose order then stays the file order it always had."""
    if setting is not None:
        return setting
    return path is not None and is_prepared(path)


class TokenArray(Protocol):
    """What a data source gives: a 1-D sequence of token ids."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: Any) -> Any: ...


class Windows:
    """Sequence number → window of one token array (see the module's docstring)."""

    def __init__(self, tokens: TokenArray, seq_len: int, name: str, *, shuffle: bool = False, seed: int = 0,
                 stream: int = 0) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.count = count_windows(name, tokens, seq_len)
        self.shuffle = shuffle
        self._key = (seed, _SALT, stream)
        self._orders: OrderedDict[int, IndexPermutation] = OrderedDict()

    def window(self, sequences: np.ndarray) -> np.ndarray:
        """The window each sequence number reads."""
        epochs, offsets = np.divmod(np.asarray(sequences, dtype=np.int64), self.count)
        if not self.shuffle:
            return offsets
        out = np.empty_like(offsets)
        for e in np.unique(epochs):
            here = epochs == e
            out[here] = self._order(int(e))[offsets[here]]
        return out

    def rows(self, sequences: np.ndarray) -> np.ndarray:
        """``[len(sequences), seq_len + 1]`` tokens, in the array's dtype."""
        starts = self.window(sequences) * self.seq_len
        # Fancy indexing reads only these rows from a memmap.
        return np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)])

    def _order(self, epoch: int) -> IndexPermutation:
        if epoch not in self._orders:
            self._orders[epoch] = IndexPermutation(self.count, (*self._key, epoch))
            if len(self._orders) > _CACHED_EPOCHS:
                self._orders.popitem(last=False)
        return self._orders[epoch]


def count_windows(name: str, tokens: TokenArray, seq_len: int) -> int:
    """How many windows `tokens` holds; DataError naming `name` when it is not 1-D or shorter than one."""
    ndim = getattr(tokens, "ndim", 1)
    if ndim != 1:
        raise DataError(f"{name}: token array has shape {getattr(tokens, 'shape', '?')}; it must be 1-D")
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"{name}: has {len(tokens)} tokens; one sequence needs seq_len+1 = {seq_len + 1} "
            "(use more data or a shorter seq_len)"
        )
    return window_count(len(tokens), seq_len)


def window_count(tokens: int, seq_len: int) -> int:
    """How many windows of ``seq_len + 1`` tokens, starting ``seq_len`` apart, `tokens` tokens hold."""
    return max(0, (tokens - 1) // seq_len)
