"""Expert parallelism (parallel.ep) trains a Mixture-of-Experts model as one process does: ep 2 on 2 ranks
and ep 2 over 4 data-parallel ranks (ZeRO-3 then shards each ep shard over the 2 ranks that hold it), fp32,
dropless, 10 steps: the same losses and gradient norms (≤ 1e-5), the same tokens per expert and expert
biases, each rank holding half of the experts; with a capacity factor (copies dropped before the
exchange) and the auxiliary loss on 2 ranks too. A run saved under ep 2 resumes under ep 1 with the same
losses (the experts are stored at global shape). With 6 experts, ep 2 over 4 ranks leaves 3 local experts
for 2 edp ranks: ZeRO-3 then splits each expert's rows (dim 1, layout/expert_sharding.py) and trains as one
process does, as ep 1 does with its 6 experts over 4 ranks, and a run saved under ep 2 resumes under ep 1."""

import pytest
from dist_jobs import moe_layouts_job, parity_config

from meshfit.util.ranks import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

BASE = ["model.preset=tiny-moe", "model.moe_bias_update_rate=0.001"]
CAPACITY = ["model.moe_capacity_factor=1.0", "model.moe_aux_loss_coeff=0.01"]


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _same(run: dict, ref: dict) -> None:
    assert _close(run["losses"], ref["losses"]) <= 1e-5
    assert _close(run["grad_norms"], ref["grad_norms"]) <= 1e-5
    assert run["tokens"] == ref["tokens"]
    assert run["biases"] == ref["biases"] and any(b != 0 for bias in ref["biases"].values() for b in bias)


def _reference(ranks: int, **variants: list[str]) -> dict:
    # One process, micro-batches as large as one rank's batch (capacity and auxiliary loss are a micro-batch's).
    cfgs = {name: parity_config(*BASE, f"train.micro_batch={8 // ranks}", *extra) for name, extra in variants.items()}
    return run_ranks(moe_layouts_job, 1, cfgs)[0]


def _held(run: dict, experts: int, total: int = 8, rows: int = 1) -> None:
    # tiny-moe: `total` experts of width 32 over dim 64; each rank holds `experts` of them (its ep shard, split
    # again by ZeRO-3 over the ranks that hold the same ep shard), `1 / rows` of each one's rows.
    assert run["shapes"]["w1"] == ((total, 32, 64), (experts, 32 // rows, 64))
    assert run["shapes"]["w2"] == ((total, 64, 32), (experts, 64 // rows, 32))


def test_ep2_on_two_ranks_trains_as_one_process_and_resumes_under_ep1(tmp_path) -> None:
    ref = _reference(2, plain=[], capacity=CAPACITY)
    ep2, ep1 = (parity_config(*BASE, "parallel.dp_shard=2", f"parallel.ep={ep}") for ep in (2, 1))
    capacity = parity_config(*BASE, *CAPACITY, "parallel.dp_shard=2", "parallel.ep=2")
    out = run_ranks(moe_layouts_job, 2, {"ep2": ep2, "capacity": capacity}, (ep2, ep1, str(tmp_path / "resume")),
                    timeout_s=360)[0]
    _held(out["ep2"], 4)
    _same(out["ep2"], ref["plain"])
    _same(out["capacity"], ref["capacity"])
    assert out["capacity"]["dropped"] > 0 and out["ep2"]["dropped"] == 0
    assert _close(out["resumed"], ref["plain"]["losses"]) <= 1e-5


def test_ep2_over_four_data_parallel_ranks_trains_as_one_process_under_each_zero_stage() -> None:
    ref = _reference(4, plain=[])["plain"]
    cfgs = {f"zero{stage}": parity_config(*BASE, "parallel.dp_shard=4", "parallel.ep=2",
                                          f"parallel.zero_stage={stage}") for stage in (1, 2, 3)}
    out = run_ranks(moe_layouts_job, 4, cfgs, timeout_s=360)[0]
    for stage in (1, 2, 3):
        _held(out[f"zero{stage}"], 2)  # between steps each ep shard is split over the 2 ranks that hold it
        _same(out[f"zero{stage}"], ref)


def test_three_local_experts_over_two_ranks_split_expert_rows_train_as_one_process_and_resume_under_ep1(
        tmp_path) -> None:
    six = ["model.moe_experts=6"]
    ref = _reference(4, plain=six)["plain"]
    rows, ep1 = (parity_config(*BASE, *six, "parallel.dp_shard=4", "parallel.zero_stage=3", *ep)
                 for ep in (["parallel.ep=2"], []))
    out = run_ranks(moe_layouts_job, 4, {"rows": rows, "ep1": ep1}, (rows, ep1, str(tmp_path / "resume")),
                    timeout_s=360)[0]
    _held(out["rows"], 3, total=6, rows=2)  # no padding: half of each of the 3 local experts' rows
    _held(out["ep1"], 6, total=6, rows=4)  # without ep, 6 experts over 4 ranks: a quarter of every expert
    _same(out["rows"], ref)
    _same(out["ep1"], ref)
    assert _close(out["resumed"], ref["losses"]) <= 1e-5
