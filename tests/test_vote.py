"""The step's vote: one all-reduce that every rank reads the same way (train/vote.py)."""

from __future__ import annotations

import pytest

from meshfit.util.ranks import run_ranks


def _vote_job(counted: bool) -> dict:
    import torch
    import torch.distributed as dist

    from meshfit.train.vote import Ballot, Vote

    rank = dist.get_rank()
    # Rank 0 computes no loss (a pipeline stage before the last); rank 1's gradients held a NaN; each holds
    # a share of the squares; only rank 1 asks to stop.
    ballot = Ballot(square=torch.tensor(2.0 + rank, dtype=torch.float64),
                    loss=None if rank == 0 else torch.tensor(3.25), nonfinite=rank == 1, stop=rank == 1,
                    counter=(1000 * (rank + 1), rank == 0) if counted else None)
    vote = Vote(ballot, torch.device("cpu"))
    tally = vote.tally
    return {"square": float(vote.square), "loss": tally.loss, "bad": tally.nonfinite_ranks, "stop": tally.stop,
            "saving": tally.saving, "counters": tally.counters}


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_every_rank_reads_the_same_decision_and_each_rank_keeps_its_own_slot() -> None:
    for counted in (True, False):
        ranks = run_ranks(_vote_job, 2, counted)
        assert ranks[0] == ranks[1]
        tally = ranks[0]
        assert tally["square"] == 5.0  # 2 + 3: every rank's share, summed
        assert tally["loss"] == 3.25  # the mean over the ranks that computed a loss, not over all ranks
        assert tally["bad"] == [1] and tally["stop"] and not tally["saving"]
        assert tally["counters"] == ([(1000, True), (2000, False)] if counted else None)
