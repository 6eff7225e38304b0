"""What every rank agrees on before the optimizer steps, through the step's vote (vote.py).

It carries, for each rank, whether its loss or gradients hold a NaN/Inf, whether a stop (SIGTERM) was
requested anywhere, and whether an asynchronous checkpoint save is still being written. All ranks then take
the same decision at the same step: step, skip the step (`train.on_nonfinite=skip`) or stop before the
optimizer touches the parameters (`stop`), and end cleanly after this step when a stop was requested.
"""

from __future__ import annotations

from typing import Any

import torch

from meshfit.train.grad_norm import GradSquares
from meshfit.train.vote import Tally


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or gradient: every rank stops at the same step, parameters untouched."""


class StepGuard:
    def __init__(self, run: Any, faults: Any, stop: Any, checkpointer: Any) -> None:
        self.run = run
        self.faults = faults
        self.stop = stop
        self.checkpointer = checkpointer
        self.stop_requested = False
        self.skipped = False

    def after_backward(self, losses: list[torch.Tensor]) -> list[torch.Tensor]:
        """Fault injection point (tests): between backward and the gradient norm."""
        if self.faults is None:
            return losses
        params = list(self.run.model.parameters())
        return [self.faults.after_backward(self.run.step + 1, params, losses[0]), *losses[1:]]

    def locally_finite(self, losses: list[torch.Tensor], squares: GradSquares) -> bool:
        """This rank's loss and own gradient shards are finite. Checked before clipping, which spreads one
        rank's NaN to every rank through the global norm, so the report names the rank where it began.
        `squares`: this rank's sums of squares of its gradients, taken once for the guard and clipping."""
        values = [loss.detach().float().reshape(()) for loss in losses]
        return bool(torch.isfinite(torch.stack(values)).all()) and squares.finite()

    def requests(self) -> tuple[bool, bool]:
        """(a stop was requested on this rank, its background checkpoint save is unfinished), for the vote."""
        return (bool(self.stop.requested) if self.stop is not None else False,
                bool(self.checkpointer.unfinished()) if self.checkpointer is not None else False)

    def allow_step(self, tally: Tally, grad_norm: torch.Tensor) -> bool:
        """Apply the vote; returns whether the optimizer may step (raises NonFiniteError on stop).

        A rank whose loss or own gradients were not finite (see locally_finite) stops or skips every rank; so
        does a non-finite global norm from finite shards (an overflow)."""
        self.stop_requested = tally.stop
        if self.checkpointer is not None and self.checkpointer.pending is not None and not tally.saving:
            self.checkpointer.finalize_pending()  # every rank's background save is done
        bad = tally.nonfinite_ranks
        overflow = not bad and not bool(torch.isfinite(grad_norm.detach()).all())
        self.skipped = bool(bad) or overflow
        if not self.skipped:
            return True
        self.run.optimizer.zero_grad(set_to_none=True)
        step = self.run.step + 1
        where = (f"rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}" if bad
                 else "every rank (the global gradient norm overflowed)")
        if self.run.cfg.train.on_nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite loss or gradient at step {step} on {where}: every rank stopped before the optimizer "
                f"step, so the parameters are those after step {step - 1}. Lower train.lr, check the data, or set "
                "train.on_nonfinite=skip to skip such steps.")
        return False
