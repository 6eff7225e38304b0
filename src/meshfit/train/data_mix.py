"""data.sources: a weighted mixture of token sources (data/blend.py), checked before any rank starts and
built in the ranks.

Each entry's path is read as data.path would be, with the data section's source, tokenizer and
token_dtype; its `val_fraction` holds out the last share of its tokens. The held-out data of a mixture is
data.val_path, or else the held-out shares of the sources that have one, blended with their weights
(data/heldout.py says what the validation loss then is).
"""

from __future__ import annotations

import os
from pathlib import Path

from meshfit.config import Config, ConfigError
from meshfit.data import DataError, check_files, make_source
from meshfit.data.blend import block_counts, sufficient_block
from meshfit.data.files import token_count
from meshfit.data.heldout import check_mixture_size, eval_mixture, held_tokens, split_tokens
from meshfit.data.loader import Source
from meshfit.data.mixture import Mixture, Part
from meshfit.data.windows import resolve_shuffle

WHAT = {"text": "a UTF-8 .txt file or a folder of them", "tokens": "a .npy or .bin token file"}


def check_mixture(cfg: Config) -> None:
    """ConfigError naming the field when data.sources cannot work: settings that exclude it, a missing
    or unreadable source, a weight that gets no share of a block, a held-out share too small."""
    data = cfg.data
    if data.path:
        raise ConfigError("data.path and data.sources are both set: give one file or folder as data.path, or "
                          "list every source (that one included) in data.sources")
    if data.source == "synthetic":
        raise ConfigError("data.sources needs data.source=tokens or text (data.source=synthetic reads no files)")
    if data.tokenizer == "bpe" and data.source == "text":
        raise ConfigError("data.sources with data.tokenizer=bpe: a BPE tokenizer is trained on one text, so the "
                          "sources' ids would not agree; use data.tokenizer=byte, or token files")
    if data.val_fraction:
        raise ConfigError("data.val_fraction holds out a share of data.path; with data.sources give each source "
                          "its own val_fraction (e.g. {path: a.npy, weight: 1, val_fraction: 0.05})")
    for i, entry in enumerate(data.sources):
        _check_source(cfg, i, entry.path)
    counts = block_counts([entry.weight for entry in data.sources], data.mix_block)
    if counts.min() < 1:
        i = int(counts.argmin())
        raise ConfigError(f"data.sources[{i}].weight={data.sources[i].weight:g} gives that source 0 of every "
                          f"data.mix_block={data.mix_block} sequences; raise data.mix_block to ≥ "
                          f"{sufficient_block([e.weight for e in data.sources])} or raise its weight")
    _check_held_out(cfg)


def _check_source(cfg: Config, i: int, path: str) -> None:
    data, field = cfg.data, f"data.sources[{i}].path"
    if not Path(path).exists():
        raise ConfigError(f"{field}={path!r} does not exist; give {WHAT[data.source]}")
    try:
        check_files(data.source, path, cfg.train.seq_len, data.tokenizer, data.token_dtype)
    except DataError as exc:
        raise ConfigError(f"{field}: {exc}") from None


def _check_held_out(cfg: Config) -> None:
    data, train = cfg.data, cfg.train
    shares = [(i, e) for i, e in enumerate(data.sources) if e.val_fraction]
    if data.val_path and shares:
        raise ConfigError(f"data.val_path and data.sources[{shares[0][0]}].val_fraction are both set: hold out "
                          "either a file of its own or shares of the sources, not both")
    if train.eval_every and not (data.val_path or shares):
        raise ConfigError(f"train.eval_every={train.eval_every} needs held-out data: set data.val_path, or a "
                          "val_fraction on the sources to hold out (e.g. {path: a.npy, weight: 1, val_fraction: "
                          "0.05})")
    held = []
    for i, entry in shares:
        count = token_count(data.source, entry.path, data.tokenizer, data.token_dtype)
        kept = held_tokens(count, entry.val_fraction)
        if count - kept < train.seq_len + 1:
            raise ConfigError(f"data.sources[{i}].val_fraction={entry.val_fraction:g} leaves {count - kept} of its "
                              f"{count} tokens for training; one sequence needs train.seq_len + 1 = "
                              f"{train.seq_len + 1}: lower it or use more data")
        held.append((_held_name(i, entry.val_fraction, kept, entry.path), kept, entry.weight))
    if train.eval_every and held:
        try:
            check_mixture_size(held, train.seq_len, train.global_batch, train.eval_batches)
        except DataError as exc:
            raise ConfigError(str(exc)) from None


def _held_name(i: int, fraction: float, count: int, path: str) -> str:
    return f"data.sources[{i}].val_fraction={fraction:g} (the last {count} tokens of {path})"


def mixture_sources(cfg: Config, vocab_size: int,
                    cache_dir: str | os.PathLike | None) -> tuple[Mixture, Source | None]:
    """(the training mixture, the held-out data or None). The training parts do not depend on
    train.eval_every: turning evaluation on or off never changes what a run trains on."""
    data, train = cfg.data, cfg.train
    parts, held = [], []
    for i, entry in enumerate(data.sources):
        tokens = make_source(data.source, path=entry.path, vocab_size=vocab_size, seed=train.seed,
                             tokenizer=data.tokenizer, token_dtype=data.token_dtype, cache_dir=cache_dir)
        shuffle = resolve_shuffle(data.shuffle, entry.path)
        if entry.val_fraction:
            tokens, out = split_tokens(tokens, entry.val_fraction)
            held.append(Part(out, entry.weight, _held_name(i, entry.val_fraction, len(out), entry.path), shuffle))
        parts.append(Part(tokens, entry.weight, entry.path, shuffle))
    mixture = Mixture(tuple(parts), data.mix_block)
    if not train.eval_every:
        return mixture, None
    if data.val_path:
        return mixture, make_source(data.source, path=data.val_path, vocab_size=vocab_size, seed=train.seed,
                                    tokenizer=data.tokenizer, token_dtype=data.token_dtype, cache_dir=cache_dir)
    return mixture, eval_mixture(held, train.global_batch, train.eval_batches, train.seq_len)
