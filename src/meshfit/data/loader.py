"""Deterministic, resumable, data-parallel batches of token sequences.

Sample model: global sequence ``g`` holds ``seq_len + 1`` tokens (inputs are
``[:-1]``, targets ``[1:]``). Training step ``k`` consumes global sequences
``[k * global_batch, (k + 1) * global_batch)``, and data-parallel rank ``r``
takes the contiguous rows ``[r * local, (r + 1) * local)`` of that range,
``local = global_batch // dp_size``.

A token array's sequence ``g`` is its ``g``-th window (windows.py: in file
order, or in a seeded order per epoch with ``shuffle``). A ``Mixture``'s
sequence ``g`` is sequence ``k`` of source ``s``, both computed from ``g``
(blend.py). A ``MarkovSource`` provides sequence ``g`` directly.

The position is a count of global sequences, so a checkpoint resumes on the
same data under any ``dp_size`` that divides ``global_batch``.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from meshfit.data.blend import Blend
from meshfit.data.boundaries import IGNORE
from meshfit.data.errors import DataError
from meshfit.data.mixture import Mixture
from meshfit.data.shards import split_counted
from meshfit.data.synthetic import MarkovSource
from meshfit.data.windows import TokenArray, Windows

Source = MarkovSource | Mixture | TokenArray


class TokenBatches:
    """The batches one data-parallel rank trains on, step after step."""

    def __init__(
        self,
        source: Source,
        *,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        name: str | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        # `name` is what error messages call the data; memmaps from
        # load_token_file already carry their file name. `shuffle` and `seed`:
        # a token array's window order (a mixture's sources carry their own).
        self.file = name or _default_name(source)
        _check_shape(self.file, seq_len, global_batch, dp_rank, dp_size)
        if isinstance(source, (list, tuple, torch.Tensor)):
            source = np.asarray(source)  # lists and CPU tensors; arrays, memmaps and shard readers stay as given
        self.source = source
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.local_batch = global_batch // dp_size
        self.sequences_consumed = 0
        self.streams: list[Windows] = []
        self.blend: Blend | None = None
        if isinstance(source, Mixture):
            self.streams = [Windows(part.tokens, seq_len, part.name, shuffle=part.shuffle, seed=seed, stream=i)
                            for i, part in enumerate(source.parts)]
            self.blend = Blend(source.weights, source.block, seed)
        elif not isinstance(source, MarkovSource):
            self.streams = [Windows(source, seq_len, self.file, shuffle=shuffle, seed=seed)]
        self.windows_per_epoch = self.streams[0].count if len(self.streams) == 1 and not self.blend else None
        # Prompt/response data (a loss mask): some targets do not count, so a step averages over those that do.
        self.loss_masked = any(getattr(s.tokens, "masks", None) is not None for s in self.streams)

    def __repr__(self) -> str:
        return (
            f"TokenBatches({self.file}, seq_len={self.seq_len}, global_batch={self.global_batch}, "
            f"dp_rank={self.dp_rank}/{self.dp_size}, sequences_consumed={self.sequences_consumed})"
        )

    @property
    def step(self) -> int:
        """Number of steps (global batches) consumed so far."""
        return self.sequences_consumed // self.global_batch

    @property
    def epoch(self) -> int:
        """Completed passes over a token array (a mixture: over the source read furthest through; synthetic
        data: always 0)."""
        return max(self.source_epochs(), default=0)

    def source_epochs(self) -> list[int]:
        """Completed passes over each source (one for a token array, none for synthetic data)."""
        if self.blend is None:
            return [self.sequences_consumed // s.count for s in self.streams]
        read = self.blend.consumed(self.sequences_consumed)
        return [int(n) // s.count for n, s in zip(read, self.streams, strict=True)]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, targets)``, both int64 ``[local_batch, seq_len]``, then advance one step."""
        first = self.sequences_consumed + self.dp_rank * self.local_batch
        seqs = self._sequences(first, self.local_batch)
        self.sequences_consumed += self.global_batch
        ids, counted = split_counted(seqs)  # prompt/response data: prompt tokens are not targets
        targets = ids[:, 1:].contiguous()
        if counted is not None:
            targets = targets.masked_fill(~counted[:, 1:], IGNORE)
        # Contiguous copies so a trainer can .view(-1) targets for the loss.
        return ids[:, :-1].contiguous(), targets

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "sequences_consumed": self.sequences_consumed,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "step": self.step,
            "epoch": self.epoch,
            **({"source_epochs": self.source_epochs()} if self.blend else {}),
            "source": _describe(self.source),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position; ``dp_rank``/``dp_size`` may differ from the saving run."""
        missing = {"sequences_consumed", "global_batch", "seq_len"} - state.keys()
        if missing:
            raise DataError(f"{self.file}: data state is missing {sorted(missing)}; it was not saved by TokenBatches")
        for key in ("global_batch", "seq_len"):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"{self.file}: cannot resume: data state was saved with {key}={state[key]}, now "
                    f"{getattr(self, key)}; the saved position counts sequences of the old shape and cannot "
                    f"be mapped onto the new one. Resume with global_batch={state['global_batch']} and "
                    f"seq_len={state['seq_len']} (dp size may change), or start a fresh run."
                )
        if "source" in state and state["source"] != _describe(self.source):
            # Not fatal: switching data on purpose is legitimate, but silently
            # resuming on different data usually is not.
            warnings.warn(f"resuming data position saved for {state['source']} on {_describe(self.source)}")
        self.sequences_consumed = int(state["sequences_consumed"])

    def _sequences(self, first: int, count: int) -> torch.Tensor:
        length = self.seq_len + 1
        if isinstance(self.source, MarkovSource):
            return self.source.sequences(range(first, first + count), length)
        g = np.arange(first, first + count)
        if self.blend is None:
            return torch.from_numpy(self.streams[0].rows(g).astype(np.int64))
        source, index = self.blend.locate(g)
        rows = np.empty((count, length), dtype=np.int64)
        for s in np.unique(source):
            here = source == s
            rows[here] = self.streams[s].rows(index[here])
        return torch.from_numpy(rows)


def _default_name(source: object) -> str:
    if isinstance(source, MarkovSource):
        return repr(source)
    if isinstance(source, Mixture):
        return f"mixture of {', '.join(part.name for part in source.parts)}"
    filename = getattr(source, "filename", None)
    return str(filename) if filename else "token array"


def _describe(source: object) -> str:
    """Short identity of the data, stored in the state to catch resuming on other data."""
    if isinstance(source, MarkovSource):
        return repr(source)
    if isinstance(source, Mixture):
        return source.describe()
    return f"token array of {len(source)} tokens"


def _check_shape(name: str, seq_len: int, global_batch: int, dp_rank: int, dp_size: int) -> None:
    if seq_len < 1 or global_batch < 1 or dp_size < 1:
        raise DataError(
            f"{name}: seq_len, global_batch and dp_size must be >= 1 "
            f"(got {seq_len}, {global_batch}, {dp_size})"
        )
    if global_batch % dp_size:
        valid = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
        raise DataError(
            f"{name}: global_batch={global_batch} is not divisible by dp_size={dp_size}; "
            f"valid dp sizes: {', '.join(map(str, valid))}"
        )
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"{name}: dp_rank={dp_rank} is out of range for dp_size={dp_size}; valid: 0..{dp_size - 1}")

