"""Held-out data: the sequences a validation loss is computed on.

Three kinds, one per way of asking:

* a file of its own (``data.val_path``), read like the training file;
* the last share of the training tokens (``data.val_fraction``): the stream is cut once, training reads
  the tokens before the cut and never those after it;
* synthetic data: the same language (the same seeded chain), its sequences numbered from
  ``SYNTHETIC_FIRST`` on. Sequence ``g`` depends only on ``(seed, g)``, and training reads sequences
  ``0, 1, 2, …``, which would need 2^62 of them to reach the held-out ones.

An evaluation reads the first ``batches`` global batches of the held-out data, the same ones every time,
split over data-parallel ranks exactly as training batches are (loader.py), so that every evaluation of a
run, and every layout of it, averages the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from meshfit.data.errors import DataError
from meshfit.data.loader import TokenBatches, window_count
from meshfit.data.synthetic import MarkovSource

SYNTHETIC_FIRST = 1 << 62


def split_tokens(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training part, held-out part): the held-out part is the last ⌊n · fraction⌋ tokens. Slices of a
    memory map stay memory maps: nothing is read."""
    cut = len(tokens) - held_tokens(len(tokens), fraction)
    return tokens[:cut], tokens[cut:]


def held_tokens(count: int, fraction: float) -> int:
    """How many of `count` tokens `fraction` holds out."""
    return int(count * fraction)


def check_size(name: str, count: int, seq_len: int, global_batch: int, batches: int) -> None:
    """`count` held-out tokens hold `batches` global batches of sequences (``seq_len + 1`` tokens, starting
    ``seq_len`` apart, as loader.py cuts them); DataError naming `name` and what would fit otherwise."""
    windows = window_count(count, seq_len)
    need = batches * global_batch
    if windows >= need:
        return
    fits = windows // global_batch
    fix = (f"lower train.eval_batches to ≤ {fits}, or use more held-out data" if fits else
           f"use at least {global_batch * seq_len + 1} held-out tokens (one global batch), or a smaller "
           "train.global_batch or train.seq_len")
    raise DataError(f"{name}: holds {count} tokens, i.e. {windows} sequences of train.seq_len + 1 = {seq_len + 1} "
                    f"tokens; train.eval_batches × train.global_batch = {batches} × {global_batch} = {need} are "
                    f"needed; {fix}")


def held_out_batches(source: MarkovSource | np.ndarray, *, seq_len: int, global_batch: int, dp_rank: int,
                     dp_size: int, batches: int, name: str) -> HeldOut:
    """This rank's reader of the held-out data; DataError when it holds fewer than `batches` global
    batches."""
    if not isinstance(source, MarkovSource):
        check_size(name, len(source), seq_len, global_batch, batches)
    first = SYNTHETIC_FIRST if isinstance(source, MarkovSource) else 0
    reader = TokenBatches(source, seq_len=seq_len, global_batch=global_batch, dp_rank=dp_rank, dp_size=dp_size,
                          name=name)
    return HeldOut(reader, first, batches)


class HeldOut:
    """The same `batches` global batches, this rank's rows of them, at every evaluation."""

    def __init__(self, reader: TokenBatches, first: int, batches: int) -> None:
        self.reader = reader
        self.first = first
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.reader.sequences_consumed = self.first  # from the start, whatever an earlier pass read
        for _ in range(self.batches):
            yield self.reader.next_batch()
