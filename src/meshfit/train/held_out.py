"""The data.* and train.eval_* settings turned into training and held-out data (data/heldout.py).

`check_held_out` runs before any rank starts (train/shape.py), so a bad setting or a held-out file too
short for train.eval_batches is one error naming the field; the ranks then build the same data with
`data_sources` and `held_out_reader`.
"""

from __future__ import annotations

import os

from meshfit.config import Config, ConfigError
from meshfit.data import DataError, MarkovSource, check_files, make_source
from meshfit.data.files import token_count
from meshfit.data.heldout import HeldOut, check_size, held_out_batches, held_tokens, split_tokens
from meshfit.data.loader import Source
from meshfit.data.mixture import Mixture
from meshfit.data.windows import resolve_shuffle
from meshfit.train.data_mix import mixture_sources


def check_held_out(cfg: Config) -> None:
    """ConfigError when the held-out settings cannot work (data.path itself is checked by shape.py)."""
    data, train = cfg.data, cfg.train
    if data.source == "synthetic":
        for key in ("val_path", "val_fraction"):
            if getattr(data, key):
                raise ConfigError(f"data.{key} does not apply to data.source=synthetic: its held-out data is a "
                                  f"stream of the same synthetic language that training never reads; leave "
                                  f"data.{key} unset")
        return
    if data.sources is not None:  # the sources' held-out shares: data_mix.check_mixture
        if data.val_path:
            _held_file(cfg)
        return
    if data.val_path and data.val_fraction:
        raise ConfigError("data.val_path and data.val_fraction are both set: hold out either a file of its own "
                          "or the last share of data.path, not both")
    if train.eval_every and not (data.val_path or data.val_fraction):
        raise ConfigError(f"train.eval_every={train.eval_every} needs held-out data with data.source={data.source}: "
                          "set data.val_path (a file like data.path) or data.val_fraction (e.g. 0.05: the last "
                          "5% of data.path's tokens, then not trained on)")
    if data.val_path:
        _held_file(cfg)
    elif data.val_fraction:
        try:
            _check_share(cfg)
        except DataError as exc:
            raise ConfigError(str(exc)) from None


def _held_file(cfg: Config) -> None:
    try:
        _check_file(cfg)
    except DataError as exc:
        raise ConfigError(str(exc)) from None


def _check_file(cfg: Config) -> None:
    data, train = cfg.data, cfg.train
    try:
        check_files(data.source, data.val_path, train.seq_len, data.tokenizer, data.token_dtype, own_bpe=False)
    except DataError as exc:
        raise DataError(f"data.val_path: {exc}") from None
    count = token_count(data.source, data.val_path, data.tokenizer, data.token_dtype)
    if train.eval_every and count is not None:
        check_size(f"data.val_path {data.val_path}", count, train.seq_len, train.global_batch, train.eval_batches)


def _check_share(cfg: Config) -> None:
    data, train = cfg.data, cfg.train
    count = token_count(data.source, data.path, data.tokenizer, data.token_dtype)
    if count is None:  # BPE text: known once the tokenizer is trained, in the ranks
        return
    held = held_tokens(count, data.val_fraction)
    if count - held < train.seq_len + 1:
        raise DataError(f"data.val_fraction={data.val_fraction:g} leaves {count - held} of data.path's {count} "
                        f"tokens for training; one sequence needs train.seq_len + 1 = {train.seq_len + 1}: lower "
                        "data.val_fraction or use more data")
    if train.eval_every:
        name = f"data.val_fraction={data.val_fraction:g} (the last {held} of data.path's {count} tokens)"
        check_size(name, held, train.seq_len, train.global_batch, train.eval_batches)


def data_sources(cfg: Config, vocab_size: int, cache_dir: str | os.PathLike | None) -> tuple[Source, Source | None]:
    """(what training reads, the held-out data or None). The training part does not depend on
    train.eval_every: turning evaluation on or off never changes what a run trains on."""
    data, seed = cfg.data, cfg.train.seed
    if data.sources is not None:
        return mixture_sources(cfg, vocab_size, cache_dir)
    source = make_source(data.source, path=data.path, vocab_size=vocab_size, seed=seed, tokenizer=data.tokenizer,
                         token_dtype=data.token_dtype, cache_dir=cache_dir)
    if isinstance(source, MarkovSource):
        return source, source if cfg.train.eval_every else None
    if data.val_fraction:
        train_part, held = split_tokens(source, data.val_fraction)
        return train_part, held if cfg.train.eval_every else None
    if not (data.val_path and cfg.train.eval_every):
        return source, None
    held = make_source(data.source, path=data.val_path, vocab_size=vocab_size, seed=seed, tokenizer=data.tokenizer,
                       token_dtype=data.token_dtype, cache_dir=cache_dir, trained_on=data.path)
    return source, held


def data_name(cfg: Config) -> str | None:
    """What errors and the data state call the training data: data.path (tokenized text is an in-memory
    array, which would otherwise be "token array"), or the mixture's sources."""
    if cfg.data.sources is not None:
        return f"data.sources ({', '.join(entry.path for entry in cfg.data.sources)})"
    return cfg.data.path if cfg.data.source != "synthetic" else None


def window_order(cfg: Config, path: str | None) -> bool:
    """Whether the token array read from `path` is read shuffled (a mixture's sources carry their own)."""
    return cfg.data.source != "synthetic" and resolve_shuffle(cfg.data.shuffle, path)


def held_out_reader(cfg: Config, held: Source | None, dp_rank: int, dp_size: int) -> HeldOut | None:
    """This rank's reader of the held-out batches (None when the run does not evaluate)."""
    if held is None:
        return None
    data, train = cfg.data, cfg.train
    if isinstance(held, MarkovSource):
        name = f"held-out stream of {held!r}"
    elif isinstance(held, Mixture):
        name = "the held-out shares of data.sources"
    elif data.val_path:
        name = f"data.val_path {data.val_path}"
    else:
        name = f"data.val_fraction={data.val_fraction:g} (the last {len(held)} tokens of data.path)"
    return held_out_batches(held, seq_len=train.seq_len, global_batch=train.global_batch, dp_rank=dp_rank,
                            dp_size=dp_size, batches=train.eval_batches, name=name,
                            shuffle=window_order(cfg, data.val_path or data.path), seed=train.seed)
