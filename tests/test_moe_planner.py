"""Mixture-of-Experts models in `meshfit plan` and `meshfit verify`: expert parallelism in the memory and time
estimates, the search, plan files, and the dry run's balanced routing (docs/moe.md, "What the plan counts")."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshfit.dryrun.verify import verify_layout
from meshfit.hardware.catalog import Cluster
from meshfit.layout.layout import Layout, Workload
from meshfit.models import get_preset
from meshfit.models.moe import Router, balanced_counts
from meshfit.planner.memory.activations import block_activation_bytes, dense_model
from meshfit.planner.memory.estimate import estimate_memory
from meshfit.planner.memory.experts import experts_per_rank, gathered_experts, routed_params, shard_dim
from meshfit.planner.search import search
from meshfit.planner.timing.estimate import step_time

WORK = Workload(seq_len=4096, global_batch=16)
NODE = Cluster("H100-SXM", nodes=2, gpus_per_node=8)


@pytest.mark.parametrize("tokens, capacity", [(7, None), (64, None), (9, 1.0), (33, 0.5)])
def test_balanced_counts_are_the_round_robin_routers_counts(tokens: int, capacity: float | None) -> None:
    model = get_preset("tiny-moe")
    router = Router(model)
    router.balanced = True
    _, chosen, _ = router(torch.randn(tokens, model.dim))
    demand = F.one_hot(chosen.reshape(-1), model.moe_experts).sum(0)
    kept = demand if capacity is None else demand.clamp(max=-(-int(capacity * tokens * model.moe_top_k)
                                                               // model.moe_experts))
    assert balanced_counts(tokens, model.moe_top_k, model.moe_experts, capacity) == kept.tolist()


def test_expert_states_keep_their_bytes_under_every_ep_and_zero_stage() -> None:
    """Routed experts split over ep and FSDP-sharded over edp: the same states per rank as ep 1's."""
    model = get_preset("qwen3-30b-a3b")
    for stage in (1, 2, 3):
        base = estimate_memory(model, Layout(dp_shard=16, zero_stage=stage), WORK)
        for ep in (2, 4, 16):
            got = estimate_memory(model, Layout(dp_shard=16, zero_stage=stage, ep=ep), WORK)
            assert got.rest[2] == pytest.approx(base.rest[2], rel=1e-3), (stage, ep)


def test_fewer_local_experts_than_edp_ranks_with_uneven_rows_leave_whole_experts_on_the_first_ranks() -> None:
    """FSDP shards rows of the expert dimension where an expert's rows do not split evenly either (a width of
    14335 over 8 ranks): one local expert at ep 8 over 64 ranks stays whole on rank 0 (8 times the even share
    of the routed experts' optimizer states)."""
    model = dataclasses.replace(get_preset("mixtral-8x7b"), moe_ffn_hidden=14335)
    work = Workload(seq_len=4096, global_batch=64)
    layout = Layout(dp_shard=64, zero_stage=3, ep=8)
    assert shard_dim(model, layout) == 0 and gathered_experts(model, layout) == 8
    even = estimate_memory(model, Layout(dp_shard=64, zero_stage=3), work).rest[2]
    whole = estimate_memory(model, layout, work).rest[2]
    routed = model.moe_layers * routed_params(model) * 8  # AdamW's two fp32 moments
    assert whole - even == pytest.approx(routed / 8 - routed / 64, rel=1e-3)


@pytest.mark.parametrize("ep", [2, 8])
def test_local_experts_that_do_not_split_over_edp_split_their_rows_with_no_padding(ep: int) -> None:
    """Mixtral's 8 experts at 64 ranks: 4 local experts over 32 edp ranks (ep 2), 1 over 8 (ep 8). FSDP splits
    each expert's rows (layout/expert_sharding.py): every rank keeps the even share of the states, and a
    block's all-gather brings its E/ep experts, not padded rows."""
    model = get_preset("mixtral-8x7b")
    work = Workload(seq_len=4096, global_batch=64)
    layout = Layout(dp_shard=64, zero_stage=3, ep=ep)
    assert shard_dim(model, layout) == 1 and gathered_experts(model, layout) == 8 // ep
    assert experts_per_rank(model, layout) == pytest.approx(8 / 64)
    even = estimate_memory(model, Layout(dp_shard=64, zero_stage=3), work).rest
    split = estimate_memory(model, layout, work).rest
    assert split[2] == pytest.approx(even[2], rel=1e-3)  # optimizer states


def test_dense_first_blocks_count_as_dense_blocks() -> None:
    model = get_preset("small-moe")  # its first block is dense
    kw = dict(mode="bf16", seq=512, batch=1)
    dense = block_activation_bytes(dense_model(model), **kw)
    all_moe = block_activation_bytes(dataclasses.replace(model, moe_dense_layers=0), **kw)
    mean = block_activation_bytes(model, **kw)
    assert mean == pytest.approx((dense + (model.n_layers - 1) * all_moe) / model.n_layers)
    assert dense != pytest.approx(all_moe)


def test_imbalance_scales_the_most_loaded_ranks_routed_tokens_under_ep_only() -> None:
    model = get_preset("qwen3-30b-a3b")
    skewed = dataclasses.replace(WORK, moe_imbalance=1.5)
    for ep, grows in ((1, False), (8, True)):
        layout = Layout(dp_shard=16, zero_stage=3, ep=ep)
        balanced = estimate_memory(model, layout, WORK).activation_peak
        assert (estimate_memory(model, layout, skewed).activation_peak > balanced * 1.05) == grows
    layout = Layout(dp_shard=16, zero_stage=3, ep=8)
    assert step_time(model, layout, skewed, NODE).ep_comm_s > step_time(model, layout, WORK, NODE).ep_comm_s * 1.4


def test_all_to_alls_through_nics_cost_more_than_inside_a_node() -> None:
    model = get_preset("qwen3-30b-a3b")
    inside = step_time(model, Layout(dp_shard=16, zero_stage=3, ep=8), WORK, NODE)
    across = step_time(model, Layout(dp_shard=16, zero_stage=3, ep=16), WORK, NODE)
    assert inside.ep_comm_s > 0 and across.ep_comm_s > 3 * inside.ep_comm_s
    assert step_time(model, Layout(dp_shard=16, zero_stage=3), WORK, NODE).ep_comm_s == 0.0


def test_expert_parallelism_moves_fewer_expert_bytes_through_fsdp() -> None:
    model = get_preset("qwen3-30b-a3b")
    plain = step_time(model, Layout(dp_shard=16, zero_stage=3), WORK, NODE, dp_overlap=0.0)
    split = step_time(model, Layout(dp_shard=16, zero_stage=3, ep=8), WORK, NODE, dp_overlap=0.0)
    assert split.dp_comm_s < plain.dp_comm_s / 2  # routed experts are 95% of its parameters


def test_explain_says_why_ep_stays_in_a_node_with_the_plans_numbers() -> None:
    from meshfit.planner.explain import explain
    from meshfit.planner.timing.experts import all_to_all
    from meshfit.util.units import fmt_duration

    plan = search(get_preset("qwen3-30b-a3b"), WORK, NODE, activation_checkpointing="full", micro_batch=1)
    text = explain(plan)
    chosen = next(c for c in plan.candidates if c.layout.ep > 1)
    call = all_to_all(plan.model, chosen.layout, NODE, WORK.seq_len, 2)
    assert "Why ep inside a node" in text and fmt_duration(call.in_node_seconds) in text
    assert fmt_duration(call.across_seconds) in text and call.across_seconds > call.in_node_seconds


@pytest.mark.parametrize("bad", [0.5, -1.0, "2", True])
def test_a_bad_imbalance_names_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="moe_imbalance=.* must be a number ≥ 1"):
        dataclasses.replace(WORK, moe_imbalance=bad).check()


def test_the_search_enumerates_ep_for_moe_models_only() -> None:
    work = Workload(seq_len=256, global_batch=8)
    cluster = Cluster("H100-SXM", nodes=1, gpus_per_node=4)
    moe = get_preset("tiny-moe")
    found = {c.layout.ep for c in search(moe, work, cluster).candidates}
    assert found == {1, 2, 4}
    for c in search(moe, work, cluster).candidates:
        assert c.layout.shard % c.layout.ep == 0 and moe.moe_experts % c.layout.ep == 0
        assert c.layout.ep == 1 or c.layout.zero_stage >= 1
    assert {c.layout.ep for c in search(get_preset("tiny"), work, cluster).candidates} == {1}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout, each_part", [(Layout(dp_shard=4, zero_stage=1, ep=2), True),
                                               (Layout(dp_shard=4, zero_stage=3, ep=4), False)])
def test_plan_and_dry_run_of_expert_parallelism_agree_within_5_percent(layout: Layout, each_part: bool) -> None:
    """`small-moe` on 4 ranks (benchmarks/planner/moe_plan_accuracy.py prints every ep × ZeRO stage). At this
    size ZeRO-3's gathered units are a large part of the weights: the total only there."""
    work = Workload(seq_len=512, global_batch=8)
    measured = verify_layout("small-moe", layout, work).measured
    planned = estimate_memory(get_preset("small-moe"), layout, work).as_dict()
    parts = ("params", "grads", "optim", "activations", "total") if each_part else ("total",)
    for part in parts:
        assert planned[part] == pytest.approx(measured[part], rel=0.05), (part, planned, measured)


@pytest.mark.timeout(400)
def test_plan_and_dry_run_agree_within_5_percent_where_experts_split_their_rows() -> None:
    """`small-moe` with 6 experts, ep 2 on 4 ranks: 3 local experts over 2 edp ranks, split on their rows. ZeRO-1
    every component; ZeRO-3 the total (its gathered units: see above). A plan that counted FSDP's padded
    expert rows (2 of the 3 experts on a rank) would count a third more of the routed experts' states."""
    model = dataclasses.replace(get_preset("small-moe"), moe_experts=6)
    work = Workload(seq_len=512, global_batch=8)
    for stage, parts in ((1, ("params", "grads", "optim", "activations", "total")), (3, ("total",))):
        layout = Layout(dp_shard=4, zero_stage=stage, ep=2)
        assert shard_dim(model, layout) == 1
        measured = verify_layout(model, layout, work).measured
        planned = estimate_memory(model, layout, work).as_dict()
        for part in parts:
            assert planned[part] == pytest.approx(measured[part], rel=0.05), (stage, part, planned, measured)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", [Layout(dp_shard=2, tp=2, sp=True, zero_stage=3),
                                    Layout(dp_shard=2, cp=2, zero_stage=3, ep=2)], ids=["tp2-sp", "cp2-ep2"])
def test_plan_and_dry_run_agree_within_5_percent_under_tensor_and_context_parallelism(layout: Layout) -> None:
    """`small-moe` on 4 ranks: the MoE MLP whole on every tp rank, routing the rank's sequence slice under SP;
    cp ranks route their chunks (the total: ZeRO-3's gathered units, see above). At Qwen3-30B-A3B's shapes
    the same layouts agree within 0.1% in every part (benchmarks/planner/moe_plan_accuracy.py --scale)."""
    work = Workload(seq_len=512, global_batch=8)
    measured = verify_layout("small-moe", layout, work).measured
    planned = estimate_memory(get_preset("small-moe"), layout, work).as_dict()
    assert planned["total"] == pytest.approx(measured["total"], rel=0.05), (planned, measured)


def _meshfit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshfit", *args], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ), timeout=300)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_a_plan_file_carries_ep_and_trains_on_two_ranks(tmp_path: Path) -> None:
    plan = _meshfit("plan", "--model", "tiny-moe", "--gpus-per-node", "2", "--seq-len", "64", "--global-batch", "4",
                    "--precision", "fp32", "--layout", "dp_shard=2,ep=2", "--out", str(tmp_path / "plan.json"),
                    cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["layout"]["ep"] == 2
    run = _meshfit("train", "--plan", str(tmp_path / "plan.json"), "--set", "train.steps=3", "--nproc", "2",
                   "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "parallel:" in (config := (tmp_path / "run" / "config.yaml").read_text()) and "ep: 2" in config
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "moe_load" in r]
    assert len(steps) == 3 and all(r["moe_load"] for r in steps)
