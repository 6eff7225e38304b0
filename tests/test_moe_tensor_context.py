"""Mixture-of-Experts models under tensor (with and without sequence and loss parallelism) and context
parallelism, with and without expert parallelism, train as one process does: fp32, dropless, `tiny-moe`
(its first block dense, the auxiliary loss on) with the expert bias on (and once a shared expert), 10
steps: the same losses and gradient norms (≤ 1e-5), the same auxiliary loss (≤ 1e-6: it is the whole
sequences' on every part), the same tokens per expert and expert biases. The reference's micro-batches are
one data-parallel rank's batch of whole sequences."""

import pytest
from dist_jobs import moe_layouts_job, parity_config

from meshfit.util.ranks import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

BASE = ["model.preset=tiny-moe", "model.moe_bias_update_rate=0.001"]
SHARED = ["model.moe_shared_experts=1"]  # an expert every token passes through: its gradient summed over tp too


def _config(*extra: str) -> dict:
    return parity_config(*BASE, *extra)


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _same(run: dict, ref: dict) -> None:
    assert _close(run["losses"], ref["losses"]) <= 1e-5
    assert _close(run["grad_norms"], ref["grad_norms"]) <= 1e-5
    assert _close(run["aux_losses"], ref["aux_losses"]) <= 1e-6
    assert run["tokens"] == ref["tokens"]
    assert run["biases"] == ref["biases"] and any(b != 0 for bias in ref["biases"].values() for b in bias)


def _references(*micro_batches: int, **extra: list[str]) -> dict:
    cfgs = {mb: _config(f"train.micro_batch={mb}") for mb in micro_batches}
    cfgs.update({name: _config(f"train.micro_batch={micro_batches[0]}", *fields) for name, fields in extra.items()})
    return run_ranks(moe_layouts_job, 1, cfgs)[0]


def test_tp2_and_cp2_on_two_ranks_train_as_one_process() -> None:
    ref = _references(8, shared=SHARED)
    tp = ["parallel.dp_shard=1", "parallel.tp=2"]
    layouts = {
        "tp2": _config(*tp, "parallel.loss_parallel=true"),
        "tp2_sp": _config(*tp, "parallel.sp=true"),
        "tp2_sp_recompute": _config(*tp, "parallel.sp=true", "parallel.activation_checkpointing=full"),
        "tp2_sp_shared": _config(*tp, "parallel.sp=true", *SHARED),
        "cp2": _config("parallel.dp_shard=1", "parallel.cp=2"),
        "cp2_ep2": _config("parallel.dp_shard=1", "parallel.cp=2", "parallel.ep=2"),
    }
    out = run_ranks(moe_layouts_job, 2, layouts, timeout_s=360)
    for name in layouts:
        _same(out[0][name], ref["shared" if name.endswith("shared") else 8])
    # Routed experts are not split by tp (here nothing shards them): whole on each tp rank.
    assert out[1]["tp2"]["shapes"]["w1"] == ((8, 32, 64), (8, 32, 64))
    assert out[1]["cp2_ep2"]["shapes"]["w1"] == ((8, 32, 64), (4, 32, 64))


def test_ep2_with_tp2_or_cp2_on_four_ranks_trains_as_one_process() -> None:
    ref = _references(4, 8)
    layouts = {
        "ep2_tp2": _config("parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2", "parallel.loss_parallel=true"),
        "ep2_tp2_sp": _config("parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2", "parallel.sp=true"),
        "ep2_cp2": _config("parallel.dp_shard=2", "parallel.ep=2", "parallel.cp=2"),
        # One data-parallel rank: both sequence splits at once, the experts over the cp ranks.
        "ep2_cp2_tp2_sp": _config("parallel.dp_shard=1", "parallel.ep=2", "parallel.cp=2", "parallel.tp=2",
                                  "parallel.sp=true", "parallel.loss_parallel=true"),
    }
    out = run_ranks(moe_layouts_job, 4, layouts, timeout_s=360)[0]
    # Each rank holds 8 / ep experts, split again by ZeRO-3 over the ranks holding the same ones (dp_shard ×
    # cp / ep of them: 2 under ep2_cp2, 1 elsewhere).
    held = {"ep2_tp2": 4, "ep2_tp2_sp": 4, "ep2_cp2": 2, "ep2_cp2_tp2_sp": 4}
    for name, run in out.items():
        assert run["shapes"]["w1"] == ((8, 32, 64), (held[name], 32, 64)), name
        _same(run, ref[8 if name == "ep2_cp2_tp2_sp" else 4])
