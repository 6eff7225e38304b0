"""FSDP units bounded by parallel.max_unit_params, and parallel.reduce_dtype."""

import dataclasses

import pytest
import torch
from dist_jobs import parity_config, train_job

from meshfit.config import load_config
from meshfit.dryrun.verify import verify_layout
from meshfit.layout.layout import Layout, Workload
from meshfit.models import build_model
from meshfit.parallel.data_parallel import precision_policy
from meshfit.parallel.fsdp_units import sub_units, unit_sizes
from meshfit.planner.memory.estimate import estimate_memory
from meshfit.util.ranks import run_ranks


def _block(preset: str):
    cfg = load_config(None, [f"model.preset={preset}", "model.n_layers=1"]).model.resolve()
    return build_model(cfg, "meta").layers["0"]


def test_a_block_within_the_limit_is_one_unit():
    block = _block("llama3-70b")  # 856M parameters per block
    assert sub_units(block, 10**9) == [] and unit_sizes(block, 10**9) == [sum(p.numel() for p in block.parameters())]


def test_a_wide_block_splits_into_attention_and_projections_never_below_one_projection():
    block = _block("gpt3-175b")  # hidden 12,288: 1.8B parameters per block
    assert [type(u).__name__ for u in sub_units(block, 10**9)] == ["Attention", "Linear", "Linear"]
    sizes = unit_sizes(block, 10**9)
    assert max(sizes) <= 10**9 and sum(sizes) == sum(p.numel() for p in block.parameters())
    # A limit below one projection leaves the projection whole: it is the smallest unit.
    assert max(unit_sizes(block, 10**6)) == 12288 * 4 * 12288 + 4 * 12288


def test_reduce_dtype_compute_reduces_in_bf16_at_stages_2_and_3():
    assert precision_policy(3, True).reduce_dtype == torch.float32
    assert precision_policy(3, True, "compute").reduce_dtype == torch.bfloat16
    assert precision_policy(2, True, "compute").reduce_dtype == torch.bfloat16
    assert precision_policy(1, True).reduce_dtype == torch.bfloat16  # stage 1 always (16-bit accumulation)


def _delta(a, b):
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides, tolerance", [
    # 20,000: tiny's attention (16K) is one unit, its MLP (24.6K) splits into its three projections.
    (["parallel.max_unit_params=20000", "parallel.activation_checkpointing=full"], 1e-5),
    # The reduced bf16 shard is cast into the fp32 gradient after the reduce-scatter: the background
    # reduce on CPU ranks must wait for it (before, step 1 read an unfinished shard and stopped on NaN).
    (["parallel.mixed_precision=true", "parallel.reduce_dtype=compute"], 2e-3),
], ids=["units-smaller-than-a-block", "reduce-in-bf16"])
def test_zero3_trains_as_one_process(overrides, tolerance):
    ref = run_ranks(train_job, 1, parity_config())[0]
    runs = run_ranks(train_job, 2, parity_config("parallel.dp_shard=2", *overrides))
    assert _delta(runs[0], ref) <= tolerance


def _wide_gpt(layers: int):
    # Hidden 16,384, 96 layers ≈ 310B parameters; fewer layers keep the dry run short (the working set is
    # per block).
    return load_config(None, ["model.preset=gpt3-175b", "model.dim=16384", f"model.n_layers={layers}",
                              "model.n_heads=128", "model.n_kv_heads=128", "model.ffn_hidden=65536"]).model.resolve()


WIDE = Workload(seq_len=2048, global_batch=1024, precision="mixed")
WIDE_LAYOUT = Layout(dp_shard=512, zero_stage=3, activation_checkpointing="full", micro_batch=2)


def test_the_plan_bounds_zero3s_working_set_by_the_unit_and_the_reduce_dtype():
    model = _wide_gpt(96)

    def working(layout):  # gathered weights and unreduced gradients beyond the rank's shards at rest
        m = estimate_memory(model, layout, WIDE)
        return m.params + m.grads - m.rest[0] - m.rest[1]

    whole = working(dataclasses.replace(WIDE_LAYOUT, max_unit_params=10**12))
    units = working(WIDE_LAYOUT)
    low = working(dataclasses.replace(WIDE_LAYOUT, reduce_dtype="compute"))
    assert whole > 30 * 2**30 and units < 12 * 2**30 and low < 8 * 2**30


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduce_dtype", ["fp32", "compute"])
def test_the_split_blocks_plan_agrees_with_the_dry_run(reduce_dtype):
    model, layout = _wide_gpt(4), dataclasses.replace(WIDE_LAYOUT, reduce_dtype=reduce_dtype)
    measured = verify_layout(model, layout, WIDE).measured["total"]
    assert estimate_memory(model, layout, WIDE).total == pytest.approx(measured, rel=0.05)


def test_explain_says_what_units_and_the_reduce_dtype_are_worth():
    from meshfit.hardware.catalog import Cluster, get_gpu
    from meshfit.planner.explain import explain
    from meshfit.planner.search import Plan, evaluate

    model, cluster = _wide_gpt(96), Cluster(get_gpu("A100-80GB"), nodes=64, gpus_per_node=8)
    plan = Plan(model=model, model_name="wide", workload=WIDE, cluster=cluster,
                candidates=[evaluate(model, WIDE_LAYOUT, WIDE, cluster)])
    text = " ".join(explain(plan).split())
    assert "ZeRO-3 gathers units of at most 1,000,000,000 parameters" in text
    assert "one unit per block would need 55.1 GiB" in text
    assert "parallel.reduce_dtype=compute" in text


def test_explain_shows_a_pipelines_peak_does_not_follow_the_micro_batch_count():
    import re

    from meshfit.hardware.catalog import Cluster, get_gpu
    from meshfit.models import get_preset
    from meshfit.planner.explain import explain
    from meshfit.planner.search import Plan, evaluate

    model, cluster = get_preset("llama3-70b"), Cluster(get_gpu("H100-SXM"), nodes=8, gpus_per_node=8)
    work = Workload(seq_len=4096, global_batch=128, precision="mixed")
    layout = Layout(tp=8, pp=8, sp=True, loss_parallel=True, activation_checkpointing="full", micro_batch=1)
    plan = Plan(model=model, model_name="70b", workload=work, cluster=cluster,
                candidates=[evaluate(model, layout, work, cluster)])
    text = " ".join(explain(plan).split())
    found = re.search(r"4× the global batch: ([\d.]+ GiB) per rank, against ([\d.]+ GiB)", text)
    assert found and found.group(1) == found.group(2)
