"""Pipeline parallelism: stage split, every schedule, composition with ZeRO and TP (3-D), validation."""

import functools

import pytest
from dist_jobs import parity_config, train_job

from meshfit.config import ConfigError, load_config
from meshfit.parallel.pipeline_parallel import SCHEDULES, balanced_split
from meshfit.train.shape import resolve_run
from meshfit.util.ranks import run_ranks

FOUR_LAYERS = "model.n_layers=4"  # pp × virtual stages = 4 needs four blocks


@functools.cache
def reference(layers=FOUR_LAYERS):
    return run_ranks(train_job, 1, parity_config(layers))[0]


def _check_parity(result, layers=FOUR_LAYERS):
    ref = reference(layers)
    assert max(abs(a - b) for a, b in zip(result["losses"], ref["losses"], strict=True)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(result["grad_norms"], ref["grad_norms"], strict=True)) <= 1e-5


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_matches_one_process(schedule):
    ranks = run_ranks(train_job, 2, parity_config(FOUR_LAYERS, "parallel.pp=2",
                                                  f"pipeline.schedule={schedule}", "pipeline.microbatches=4"))
    _check_parity(ranks[0])
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the loss reaches every stage
    assert ranks[0]["grad_norms"] == ranks[1]["grad_norms"]  # one vote: every rank clips alike
    stages = [m["stages"] for m in ranks[0]["mem"]]  # every stage runs on exactly one rank
    assert sorted(s for ids in stages for s in ids) == list(range(len(stages[0]) * 2))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("data_parallel", [["parallel.dp_replicate=2"], ["parallel.dp_shard=2", "parallel.zero_stage=1"],
                                           ["parallel.dp_shard=2", "parallel.zero_stage=3"],
                                           ["parallel.dp_shard=2", "parallel.zero_stage=2", "pipeline.schedule=zbv",
                                            "pipeline.microbatches=4"]],
                         ids=["ddp", "zero1", "zero3", "zero2-zbv"])
def test_pipeline_with_data_parallel(data_parallel):
    ranks = run_ranks(train_job, 4, parity_config(FOUR_LAYERS, "parallel.pp=2", *data_parallel))
    _check_parity(ranks[0])


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("recompute", ["full", "selective", "attention"])
def test_split_backward_with_recompute_matches_one_process(recompute):
    # The weight-gradient step runs the recomputed blocks' forward again, apart from the input-gradient step.
    # Two blocks per stage, so that "selective" checkpoints one of each stage's.
    layers = "model.n_layers=8"
    ranks = run_ranks(train_job, 2, parity_config(layers, "parallel.pp=2", "pipeline.schedule=zbv",
                                                  "pipeline.microbatches=4",
                                                  f"parallel.activation_checkpointing={recompute}"))
    _check_parity(ranks[0], layers)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_3d_pipeline_zero1_tensor_parallel_eight_ranks():
    # Megatron's standard layout: TP × PP × data parallelism with sharded optimizer states (ZeRO-1).
    ranks = run_ranks(train_job, 8, parity_config(FOUR_LAYERS, "parallel.pp=2", "parallel.dp_shard=2",
                                                  "parallel.zero_stage=1", "parallel.tp=2", "parallel.sp=true", "parallel.loss_parallel=true",
                                                  "pipeline.schedule=interleaved-1f1b"), timeout_s=380)
    _check_parity(ranks[0])
    # Per-stage memory: every rank reports its own stages; peak_mem_bytes is the most-loaded one.
    mem = ranks[0]["mem"]
    assert ranks[0]["peak_mem_bytes"] == max(m["peak"] for m in mem)
    assert {tuple(m["stages"]) for m in mem} == {(0, 2), (1, 3)}


def test_balanced_split_counts_the_head_on_the_last_stage():
    assert balanced_split(8, 2, layer_cost=1.0, head_cost=0.0) == [4, 4]
    assert balanced_split(8, 2, layer_cost=1.0, head_cost=2.0) == [5, 3]
    assert sum(balanced_split(80, 4, layer_cost=1.0, head_cost=3.0)) == 80


def test_pipeline_validation_messages():
    def shape(*overrides, world=2):
        return resolve_run(load_config(None, ["model.preset=tiny", *overrides]), world)

    with pytest.raises(ConfigError, match=r"2 × 2 = 4 stages, but the model has 2 layers"):
        shape("parallel.pp=2", "pipeline.schedule=interleaved-1f1b")
    with pytest.raises(ConfigError, match="zbv runs exactly 2"):
        shape(FOUR_LAYERS, "parallel.pp=2", "pipeline.schedule=zbv", "pipeline.virtual_stages=1")
    with pytest.raises(ConfigError, match="valid values: 2, 4, 8$"):  # 1 is below pp: not offered
        shape("parallel.pp=2", "pipeline.microbatches=3")
    with pytest.raises(ConfigError, match="at least pp=2 micro-batches"):
        shape("parallel.pp=2", "pipeline.microbatches=1")
    with pytest.raises(ConfigError, match="untied embeddings"):
        shape("model.preset=tiny-gpt", "parallel.pp=2")
    with pytest.raises(ConfigError, match="add up to 4 layers"):
        shape(FOUR_LAYERS, "parallel.pp=2", "pipeline.layers_per_stage=3,2")
    plan = shape(FOUR_LAYERS, "parallel.pp=2", "pipeline.layers_per_stage=3,1").stages
    assert plan.layers == ((0, 1, 2), (3,))


@pytest.mark.parametrize("schedule", ["zbv", "interleaved-zb", "dualpipev"])
def test_split_backward_schedules_refuse_the_data_parallelism_that_loses_gradients(schedule):
    # Their weight-gradient steps run outside the hooks FSDP re-sharding and DDP rely on: measured, the
    # first stage's gradients were lost (loss 0.28 off the one-process run) or DDP's reducer failed.
    def shape(*overrides, world=4):
        return resolve_run(load_config(None, ["model.preset=tiny", FOUR_LAYERS, "parallel.pp=2",
                                              f"pipeline.schedule={schedule}", *overrides]), world)

    for overrides, world in ((["parallel.dp_shard=2", "parallel.zero_stage=3"], 4),
                             (["parallel.dp_replicate=2"], 4), (["parallel.mixed_precision=true"], 2)):
        with pytest.raises(ConfigError, match=rf"pipeline.schedule={schedule} splits each backward.*use "
                                              r"pipeline.schedule 1f1b or interleaved-1f1b"):
            shape(*overrides, world=world)
    assert shape("parallel.dp_shard=2", "parallel.zero_stage=2", "parallel.mixed_precision=true").zero_stage == 2
    assert shape(world=2).zero_stage == 0
    # torch's op-level selective checkpointing fails at the weight-gradient step (a second backward through
    # the block), measured with the dry run of each schedule; whole-block recompute and the attention policy
    # run.
    with pytest.raises(ConfigError, match=rf"schedule={schedule} splits each backward.*op-level recompute.*use "
                                          r"parallel.activation_checkpointing full, selective or attention"):
        shape("parallel.activation_checkpointing=op", world=2)
    for policy in ("full", "selective", "attention"):
        assert shape(f"parallel.activation_checkpointing={policy}", world=2).zero_stage == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule, family", [("zbv", "llama"), ("interleaved-zb", "llama"), ("dualpipev", "llama"),
                                              ("zbv", "gpt"), ("dualpipev", "gpt")])
def test_split_backward_re_runs_recomputed_blocks_as_the_plan_counts(schedule, family, monkeypatch):
    # torch's weight-gradient step re-runs a recomputed block once per group of weights it reduces; the
    # step-time plan counts those forwards (planner/timing/estimate.py SPLIT_RERUNS). Counted on the dry run.
    import dataclasses

    from meshfit.dryrun.verify import verify_layout
    from meshfit.layout.layout import Layout, Workload
    from meshfit.models import get_preset, gpt, llama
    from meshfit.planner.timing.estimate import SPLIT_RERUNS

    calls = [0]
    block = llama.LlamaBlock if family == "llama" else gpt.GPTBlock
    forward = block.forward

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(block, "forward", counted)
    preset = "small" if family == "llama" else "small-gpt"
    model = dataclasses.replace(get_preset(preset), n_layers=4, tie_embeddings=False)
    workload = Workload(seq_len=64, global_batch=4, precision="fp32")
    runs = {}
    for ac in ("none", "full"):
        calls[0] = 0
        result = verify_layout(model, Layout(pp=2, schedule=schedule, virtual_stages=2, micro_batch=1,
                                             activation_checkpointing=ac), workload, rank=0)
        runs[ac] = calls[0]
    block_microbatches = 2 * 4 * result.steps  # rank 0's blocks × micro-batches × steps
    assert (runs["full"] - runs["none"]) / block_microbatches == pytest.approx(SPLIT_RERUNS[schedule][family],
                                                                               rel=0.02)


def test_search_offers_no_split_backward_schedule_that_loses_gradients():
    from meshfit.hardware.catalog import Cluster, get_gpu
    from meshfit.layout.layout import Workload
    from meshfit.layout.schedules import SPLIT_BACKWARD
    from meshfit.models import get_preset
    from meshfit.planner.search import enumerate_layouts

    for precision in ("fp32", "mixed"):
        layouts = list(enumerate_layouts(get_preset("llama3-8b"), Workload(seq_len=2048, global_batch=16,
                                                                            precision=precision),
                                         Cluster(get_gpu("H100-SXM"), 1, 8)))
        split = [lay for lay in layouts if lay.pp > 1 and lay.schedule in SPLIT_BACKWARD]
        assert split and all(lay.zero_stage in (1, 2) or (lay.zero_stage == 0 and lay.dp_replicate * lay.cp == 1
                                                          and precision == "fp32") for lay in split)
        assert not any(lay.activation_checkpointing == "op" for lay in split)
        assert {"full", "selective"} <= {lay.activation_checkpointing for lay in split}


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_tensor_parallel_plan_of_a_stage_names_only_its_modules(preset):
    from meshfit.models import build_model, get_preset
    from meshfit.parallel.pipeline_parallel import cut_stage
    from meshfit.parallel.tensor_parallel import tp_plan

    cfg = get_preset(preset)
    for first, last, layers in ((True, False, (0,)), (False, True, (1,))):
        stage = cut_stage(build_model(cfg, "meta"), layers, first, last)
        plan = tp_plan(cfg, sp=True, loss_parallel=True, layers=list(stage.layers.keys()), first=first, last=last)
        for path in plan:
            stage.get_submodule(path)  # raises if the plan names a module the stage does not have
        assert ("output" in plan) == last and ("tok_embeddings" in plan) == first
