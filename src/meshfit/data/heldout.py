"""Held-out data: the sequences a validation loss is computed on.

Four kinds, one per way of asking:

* a file of its own (``data.val_path``), read like the training file;
* the last share of the training tokens (``data.val_fraction``): the stream is cut once, training reads
  the tokens before the cut and never those after it;
* the last share of each source of a mixture (``val_fraction`` of a ``data.sources`` entry), read as one
  mixture of their own (``eval_mixture``);
* synthetic data: the same language (the same seeded chain), its sequences numbered from
  ``SYNTHETIC_FIRST`` on. Sequence ``g`` depends only on ``(seed, g)``, and training reads sequences
  ``0, 1, 2, …``, which would need 2^62 of them to reach the held-out ones.

An evaluation reads the first ``batches`` global batches of the held-out data, the same ones every time,
split over data-parallel ranks exactly as training batches are (loader.py), so that every evaluation of a
run, and every layout of it, averages the same tokens.

A held-out mixture is one blend block of all ``batches × global_batch`` sequences an evaluation reads:
source ``s`` provides exactly ``n_s`` of them, the largest-remainder rounding of that count times its
share of the weights (its first ``n_s`` in its window order). As every sequence holds ``seq_len`` targets,
the validation loss is ``Σ_s (n_s / N) · (mean loss over source s's sequences)``: the per-source losses
weighted as training weighs the sources, to within ``1 / N``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from meshfit.data.blend import block_counts
from meshfit.data.errors import DataError
from meshfit.data.loader import Source, TokenBatches
from meshfit.data.mixture import Mixture, Part
from meshfit.data.synthetic import MarkovSource
from meshfit.data.windows import TokenArray, window_count

SYNTHETIC_FIRST = 1 << 62


def split_tokens(tokens: TokenArray, fraction: float) -> tuple[TokenArray, TokenArray]:
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


def check_mixture_size(parts: Sequence[tuple[str, int, float]], seq_len: int, global_batch: int,
                       batches: int) -> None:
    """Each held-out source, given as (name, token count, weight), holds its share of the
    ``batches × global_batch`` sequences an evaluation reads; DataError naming the first that does not."""
    need = batches * global_batch
    counts = block_counts([weight for *_, weight in parts], need)
    for (name, count, weight), share in zip(parts, counts, strict=True):
        if share == 0:
            raise DataError(f"{name}: its weight {weight:g} gives it 0 of the train.eval_batches × "
                            f"train.global_batch = {batches} × {global_batch} = {need} held-out sequences; raise "
                            "train.eval_batches so that every held-out source has a share")
        windows = max(0, (count - 1) // seq_len)
        if windows < share:
            raise DataError(f"{name}: holds {count} tokens, i.e. {windows} sequences of train.seq_len + 1 = "
                            f"{seq_len + 1} tokens; an evaluation reads {share} of them (its share of the {need} "
                            "held-out sequences); hold out more of it, or lower train.eval_batches")


def eval_mixture(parts: Sequence[Part], global_batch: int, batches: int, seq_len: int) -> Mixture:
    """The held-out parts of a mixture as what an evaluation reads: one block of all its sequences."""
    check_mixture_size([(p.name, len(p.tokens), p.weight) for p in parts], seq_len, global_batch, batches)
    return Mixture(tuple(parts), block=batches * global_batch)


def held_out_batches(source: Source, *, seq_len: int, global_batch: int, dp_rank: int, dp_size: int,
                     batches: int, name: str, shuffle: bool = False, seed: int = 0) -> HeldOut:
    """This rank's reader of the held-out data; DataError when it holds fewer than `batches` global
    batches (a mixture: checked by `eval_mixture`). `shuffle`: a token array's window order, as training's."""
    if not isinstance(source, (MarkovSource, Mixture)):
        check_size(name, len(source), seq_len, global_batch, batches)
    first = SYNTHETIC_FIRST if isinstance(source, MarkovSource) else 0
    reader = TokenBatches(source, seq_len=seq_len, global_batch=global_batch, dp_rank=dp_rank, dp_size=dp_size,
                          name=name, shuffle=shuffle, seed=seed)
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
