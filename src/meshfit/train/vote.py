"""The one small collective of a training step: what every rank must agree on before the optimizer steps,
and what the step's record needs from every rank.

Each rank casts a `Ballot`; one all-reduce (a sum over the world, in fp64) makes the `Vote`:

* the global gradient norm: each rank adds its sums of squares, each divided by the number of ranks that
  hold the same gradient values (grad_norm.py), so that the world's sum counts every value once;
* per rank, in its own slot: whether its loss or gradients are non-finite (the step guard names the rank
  where a NaN began), and its memory counter and whether it grew, which steps the memory tracker does not
  measure report (memory/meter.py);
* from any rank: a stop request (SIGTERM), an unfinished background checkpoint save, and whether it
  compiled during the step (train.compile: the memory meter then treats the step alike on every rank);
* the step's loss: the ranks that compute one add it and count themselves, so the mean is over data-parallel
  replicas whatever the layout (tensor-parallel ranks share a loss; only the last pipeline stage has one).

One collective instead of one per consumer: on CPU ranks each small collective costs ~0.5 ms of a step, and
on accelerators each one is a host synchronization. Integers up to 2^53 (memory counters in bytes) are exact
in fp64, and a sum of a few fp32 losses of similar size is too.

Tensor-parallel gradients that arrive as partial sums are still added up by their own collective before
they are squared (grad_norm.py); meshfit's layouts reduce them in the backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

# The shared slots; the per-rank ones follow them. The first two are computed on the device, the rest on
# the host.
_SQUARE, _LOSS, _STOP, _SAVING, _LOSS_RANKS, _COMPILED, _SHARED = range(7)


@dataclass
class Ballot:
    """This rank's part of the step's vote."""

    square: torch.Tensor  # Σ g² over this rank's gradients, each divided by its holders (fp64 scalar)
    loss: torch.Tensor | None = None  # this rank's mean loss over its micro-batches; None: it computes none
    nonfinite: bool = False  # this rank's loss or gradients hold a NaN or Inf
    stop: bool = False
    saving: bool = False  # a background checkpoint save of this rank is still being written
    compiled: bool = False  # this rank compiled (train.compile) during the step
    counter: tuple[int, bool] | None = None  # (memory counter in bytes, whether it grew); None in dry runs


@dataclass(frozen=True)
class Tally:
    """What the vote decided, read back to the host."""

    nonfinite_ranks: list[int]
    stop: bool
    saving: bool
    compiled: bool  # some rank compiled during the step
    loss: float  # mean over the ranks that computed one (NaN when none did, as in a dry run)
    counters: list[tuple[int, bool]] | None  # per rank; None in dry runs


class Vote:
    """The all-reduced ballots. `square` stays on the device (clipping needs no host read); `tally` reads
    the rest back once, when first asked (dry runs never ask: their values are fake)."""

    def __init__(self, ballot: Ballot, device: torch.device) -> None:
        self.world = dist.get_world_size()
        rank = dist.get_rank()
        host = torch.zeros(_SHARED + 3 * self.world, dtype=torch.float64)
        host[_STOP], host[_SAVING] = float(ballot.stop), float(ballot.saving)
        host[_COMPILED] = float(ballot.compiled)
        host[_LOSS_RANKS] = float(ballot.loss is not None)
        host[_SHARED + rank] = float(ballot.nonfinite)
        self.counted = ballot.counter is not None  # the same on every rank (memory/meter.py)
        if ballot.counter is not None:
            host[_SHARED + self.world + rank] = float(ballot.counter[0])
            host[_SHARED + 2 * self.world + rank] = float(ballot.counter[1])
        # The host's slots go to the device in one copy and join the square and the loss there (NCCL
        # reduces device tensors only); no element is written into a device tensor one by one. With
        # offloaded gradients the square is a host scalar and moves too.
        square = ballot.square.to(device, torch.float64).reshape(1)
        loss = (ballot.loss.detach().to(device, torch.float64).reshape(1) if ballot.loss is not None
                else torch.zeros(1, dtype=torch.float64, device=device))
        values = torch.cat([square, loss, host[_STOP:].to(device)])
        dist.all_reduce(values)
        self.values = values

    @property
    def square(self) -> torch.Tensor:
        """Σ g² over every gradient value of the model, each counted once (fp64, on the device)."""
        return self.values[_SQUARE]

    @functools.cached_property
    def tally(self) -> Tally:
        host = self.values.cpu().tolist()
        world = self.world
        flags = host[_SHARED:_SHARED + world]
        counters = None
        if self.counted:
            counters = [(int(c), bool(g)) for c, g in zip(host[_SHARED + world:_SHARED + 2 * world],
                                                         host[_SHARED + 2 * world:], strict=True)]
        loss_ranks = host[_LOSS_RANKS]
        return Tally(nonfinite_ranks=[r for r, flag in enumerate(flags) if flag], stop=bool(host[_STOP]),
                     saving=bool(host[_SAVING]), compiled=bool(host[_COMPILED]),
                     loss=host[_LOSS] / loss_ranks if loss_ranks else float("nan"), counters=counters)
