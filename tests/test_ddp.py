"""DDP baseline: parity with a one-process run and the measured per-rank memory breakdown."""

import pytest
from dist_jobs import parity_config, train_job

from meshfit.util.ranks import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def reference():
    return run_ranks(train_job, 1, parity_config())[0]


def test_ddp_two_ranks_matches_single_process(reference):
    ddp = run_ranks(train_job, 2, parity_config("parallel.dp_replicate=2"))
    assert len(ddp[0]["losses"]) == 10
    deltas = [abs(a - b) for a, b in zip(ddp[0]["losses"], reference["losses"], strict=True)]
    assert max(deltas) <= 1e-5, deltas
    gdeltas = [abs(a - b) for a, b in zip(ddp[0]["grad_norms"], reference["grad_norms"], strict=True)]
    assert max(gdeltas) <= 1e-5, gdeltas
    assert ddp[0]["losses"] == ddp[1]["losses"]  # every rank logs the same global loss
    assert ddp[0]["losses"][-1] < ddp[0]["losses"][0]  # it learns


def test_ddp_with_accumulation_matches_single_process(reference):
    ddp = run_ranks(train_job, 2, parity_config("parallel.dp_replicate=2", "train.micro_batch=1"))
    assert max(abs(a - b) for a, b in zip(ddp[0]["losses"], reference["losses"], strict=True)) <= 1e-5


def test_ddp_memory_breakdown_is_a_full_replica(reference):
    ddp = run_ranks(train_job, 2, parity_config("parallel.dp_replicate=2", "train.steps=3"))[0]
    one = reference["mem"][0]
    for rank_mem in ddp["mem"]:
        # Every DDP rank holds the whole model and, at its peak, whole gradients and AdamW states.
        assert rank_mem["params"] == one["params"]
        assert rank_mem["max"]["grads"] >= one["params"]  # fp32 grads of every parameter
        assert rank_mem["max"]["optim"] >= 2 * one["params"]  # AdamW exp_avg + exp_avg_sq
        # The categories partition the tracked bytes at the peak.
        assert rank_mem["peak"] == sum(rank_mem[k] for k in ("params", "grads", "optim", "activations_other"))
        # The gradients are views into DDP's buckets, which live for the run: no second copy.
        assert rank_mem["rest"]["grads"] == one["params"] and rank_mem["max"]["other"] < one["params"] / 10
    # Half the local batch per rank: fewer activations than the single process at its forward peak.
    assert ddp["mem"][0]["activations"] < one["activations"]


@pytest.mark.timeout(120)
def test_ddp_sends_no_buffers_before_forward_and_no_deprecation_warning():
    from dist_jobs import ddp_buffers_job

    ranks = run_ranks(ddp_buffers_job, 2)
    for rank, out in enumerate(ranks):
        assert not [w for w in out["warnings"] if "deprecated" in w], out["warnings"]
        assert out["buffer"] == [float(rank)] * 3  # rank 0's buffer was not broadcast before the forward
