"""Which source each global sequence of a weighted mixture comes from, computed from the sequence number.

The stream is cut into blocks of ``block`` sequences. In every block source ``s`` gets
``n_s`` = the largest-remainder rounding of ``block · w_s`` sequences (``w`` the weights divided by their
sum), so ``Σ n_s = block`` and ``|n_s − block · w_s| < 1``; where in the block they sit is a seeded
permutation of the block's slots (permutation.py) with key ``(seed, block number)``: slot ``p`` belongs to
the source whose range ``[c_s, c_s + n_s)`` holds it.

Global sequence ``g`` lies in block ``b = g // block`` at position ``j = g % block``. If it is the r-th
sequence of source ``s`` in that block (counting positions in order), it is that source's sequence
``k = b · n_s + r``: each source is read in its own order, without gaps or repeats, at exactly ``n_s``
sequences per block. Nothing depends on anything but (seed, weights, block, g), so the position of a
mixture is still one integer (loader.py), valid under any data-parallel size. One block's table costs
O(block); the last two are kept.

Realized shares: over whole blocks exactly ``n_s / block``; within a block, a prefix of positions holds a
hypergeometric sample (drawn without replacement), whose spread is at most a binomial draw's.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from meshfit.data.permutation import IndexPermutation

DEFAULT_BLOCK = 1000
_SALT = 0x626C656E64  # "blend": the block order's key differs from any window order's
_CACHED_BLOCKS = 2  # a batch rarely spans more; a table is 16 bytes per sequence of the block


def normalized(weights: Sequence[float]) -> np.ndarray:
    """The weights as shares summing to 1; ValueError unless each is finite and > 0."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError("a mixture needs at least one weight")
    bad = [i for i, x in enumerate(w) if not (math.isfinite(x) and x > 0)]
    if bad:
        raise ValueError(f"weight {w[bad[0]]!r} of source {bad[0]} is not valid: weights are finite numbers > 0")
    return w / w.sum()


def block_counts(weights: Sequence[float], block: int) -> np.ndarray:
    """Sequences of each source per block: the largest-remainder rounding of ``block · share`` (ties go to
    the earlier source)."""
    quota = normalized(weights) * block
    counts = np.floor(quota).astype(np.int64)
    short = block - int(counts.sum())
    order = np.argsort(-(quota - counts), kind="stable")
    counts[order[:short]] += 1
    return counts


def sufficient_block(weights: Sequence[float]) -> int:
    """A block in which every source gets at least one sequence: ⌈Σw / min w⌉ (then ⌊block · share⌋ ≥ 1 for
    each; the remainders may make a smaller one do too)."""
    normalized(weights)  # refuses weights that are not finite and > 0
    return math.ceil(math.fsum(weights) / min(weights))


class Blend:
    """Global sequence number → (source, that source's sequence number)."""

    def __init__(self, weights: Sequence[float], block: int, seed: int) -> None:
        if block < 1:
            raise ValueError(f"a blend block needs ≥ 1 sequence (got {block})")
        self.block = block
        self.seed = seed
        self.counts = block_counts(weights, block)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])
        self._tables: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def locate(self, sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, sequence of that source) for each global sequence number."""
        g = np.asarray(sequences, dtype=np.int64)
        blocks, positions = np.divmod(g, self.block)
        source = np.empty_like(g)
        index = np.empty_like(g)
        for b in np.unique(blocks):
            here = blocks == b
            src, rank = self._table(int(b))
            source[here] = src[positions[here]]
            index[here] = b * self.counts[source[here]] + rank[positions[here]]
        return source, index

    def consumed(self, sequences: int) -> np.ndarray:
        """How many sequences of each source the first `sequences` global sequences read."""
        whole, rest = divmod(sequences, self.block)
        src, _ = self._table(whole)
        return whole * self.counts + np.bincount(src[:rest], minlength=len(self.counts))

    def _table(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block `b`'s source of each position, and each position's rank among its source's."""
        if b in self._tables:
            self._tables.move_to_end(b)
            return self._tables[b]
        slots = IndexPermutation(self.block, (self.seed, _SALT, b))[np.arange(self.block)]
        src = np.searchsorted(self.starts, slots, side="right") - 1
        order = np.argsort(src, kind="stable")  # positions grouped by source, in order within each
        rank = np.empty(self.block, dtype=np.int64)
        rank[order] = np.arange(self.block) - self.starts[src[order]]
        self._tables[b] = (src, rank)
        if len(self._tables) > _CACHED_BLOCKS:
            self._tables.popitem(last=False)
        return src, rank
