"""`meshfit verify`'s engine: one-process dry runs of the real training code at the layout's world size.

Every dry run here uses the `tiny` preset (about 0.1 MB of weights) so the file stays well under a minute.
The large-model runs (Llama-3 8B at 64 ranks, 70B at 256) live in benchmarks/planner/verify_scale.py.
"""

from __future__ import annotations

import dataclasses
import gc
import sys

import pytest
import torch
import torch.distributed as dist

from meshfit.dryrun.verify import COMPONENTS, measured_ranks, verify_config, verify_layout
from meshfit.layout.layout import Layout, Workload
from meshfit.models import get_preset, num_params

pytestmark = pytest.mark.timeout(120)

WORK = Workload(seq_len=64, global_batch=8, precision="mixed")
FP32 = dataclasses.replace(WORK, precision="fp32")
TINY_PARAMS = num_params(get_preset("tiny"))


def _parts(measured: dict[str, int]) -> int:
    return sum(measured[k] for k in COMPONENTS if k != "total")


def _check_shape(result, *, grads: bool = True) -> None:
    m = result.measured
    assert set(m) == set(COMPONENTS)
    for name in ("params", "optim", "activations", "buffers"):
        assert m[name] > 0, name
    if grads:
        assert m["grads"] > 0
    # The total is the tally at the peak; the components are that tally's parts.
    assert m["total"] == _parts(m)
    assert result.wall_s > 0 and result.max_rss_bytes > 0
    assert not dist.is_initialized()  # the fake group is gone: the process can run anything next


def test_zero3_shards_parameters_and_states_across_ranks():
    at8 = verify_layout("tiny", Layout(dp_shard=8, zero_stage=3), WORK)
    _check_shape(at8, grads=False)  # the peak is at the end of forward, before any gradient exists
    assert at8.rank == 0 and at8.stage_ids is None and at8.steps == 2
    at2 = verify_layout("tiny", Layout(dp_shard=2, zero_stage=3), WORK)
    assert at8.measured["params"] < at2.measured["params"]
    # AdamW's two fp32 moments of this rank's 1/N shard (+ a step counter per parameter).
    assert at8.measured["optim"] < at2.measured["optim"] / 3


def test_ddp_keeps_full_replicas_whose_gradients_are_its_buckets():
    result = verify_layout("tiny", Layout(dp_replicate=4), FP32)
    _check_shape(result)
    m = result.measured
    assert m["params"] == 4 * TINY_PARAMS  # every rank holds the whole fp32 model
    assert m["grads"] == 4 * TINY_PARAMS  # views into DDP's buckets: no second copy
    assert 8 * TINY_PARAMS <= m["optim"] < 8 * TINY_PARAMS + 4096  # two moments + step counters
    assert m["buffers"] < TINY_PARAMS  # the RoPE tables only
    assert result.steps == 3  # the buckets are rebuilt in step 2; step 3 is a steady step


def test_tensor_parallel_with_sequence_and_loss_parallelism():
    lay = Layout(tp=2, sp=True, loss_parallel=True, micro_batch=4)  # 2 accumulation steps: a dry run's
    result = verify_layout("tiny", lay, FP32)  # time is its op count, and more repeat the same ops
    _check_shape(result)
    # Norm gains stay replicated; every matrix is split in two.
    assert 2 * TINY_PARAMS <= result.measured["params"] < 2.1 * TINY_PARAMS


def test_sequence_parallelism_keeps_only_the_shard_of_gathered_inputs(monkeypatch):
    # Each column-parallel region (attention and MLP of every block, the head) all-gathers its input along
    # the sequence; backward gathers it again, so only the shard stays alive. Without that, every gathered
    # input would stay too: the other (t - 1)/t of s·b·h fp32 values per region, at the loss peak.
    lay, work = Layout(tp=2, sp=True, loss_parallel=True, micro_batch=8), dataclasses.replace(FP32, global_batch=8)
    kept = verify_layout("tiny", lay, work)
    import meshfit.parallel.parallelize as parallelize

    monkeypatch.setattr(parallelize, "regather_in_backward", lambda *args: None)
    gathered = verify_layout("tiny", lay, work)
    cfg = get_preset("tiny")
    regions = 2 * cfg.n_layers + 1
    assert gathered.measured["activations"] - kept.measured["activations"] == regions * 64 * 8 * cfg.dim * 4 // 2


def test_context_parallelism_shards_states_over_cp_and_keeps_a_part_of_each_sequence():
    from meshfit.planner.memory.estimate import estimate_memory

    work = dataclasses.replace(FP32, seq_len=256, global_batch=2)
    over_cp = verify_layout("tiny", Layout(cp=2, zero_stage=3), work)
    over_dp = verify_layout("tiny", Layout(dp_shard=2, zero_stage=3), work)
    _check_shape(over_cp, grads=False)
    # The cp ranks hold the same weights: ZeRO-3 shards them (and the states) as it does over dp_shard.
    assert over_cp.measured["optim"] == over_dp.measured["optim"]
    # Each rank keeps half of every sequence (plus the gathered keys and values), against a whole one.
    assert over_cp.measured["activations"] < 0.75 * over_dp.measured["activations"]
    predicted = estimate_memory(get_preset("tiny"), Layout(cp=2, zero_stage=3), work).activations
    assert predicted == pytest.approx(over_cp.measured["activations"], rel=0.05)


def test_pipeline_measures_every_pipeline_rank_and_reports_the_most_loaded():
    lay = Layout(pp=2, micro_batch=2)  # 4 micro-batches: 1F1B's warm-up, steady state and drain
    assert measured_ranks(lay) == [0, 1]
    first = verify_layout("tiny", lay, FP32, rank=0)
    _check_shape(first)
    assert first.rank == 0 and first.stage_ids == [0]
    best = verify_layout("tiny", lay, FP32)
    assert best.rank in (0, 1) and best.stage_ids == [best.rank]
    assert best.measured["total"] >= first.measured["total"]
    assert measured_ranks(Layout(pp=4, dp_shard=2, zero_stage=3)) == [0, 2, 4, 6]


@pytest.mark.timeout(60)
def test_pipeline_ranks_of_a_3d_layout_run_one_after_another_in_one_process():
    # Each pipeline rank builds its own world and meshes; DTensor caches filled by the previous one must not
    # hand it that world's meshes (whose process groups are gone), in either order.
    from torch.distributed.device_mesh import DeviceMesh

    def meshes() -> list[DeviceMesh]:
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, DeviceMesh)]

    earlier = meshes()  # held, so that their ids are not reused (earlier tests' runs may still hold some)
    lay = Layout(pp=2, dp_shard=2, tp=2, zero_stage=3, sp=True, loss_parallel=True)
    assert measured_ranks(lay) == [0, 4]
    two = dataclasses.replace(FP32, global_batch=4)  # two pipeline micro-batches
    best = verify_layout("tiny", lay, two)  # rank 0, then rank 4
    _check_shape(best, grads=False)
    assert best.rank in (0, 4) and best.stage_ids == [best.rank // 4]
    assert set(best.per_rank) == {0, 4} and best.measured["total"] == max(best.per_rank.values())
    assert best.per_rank[best.rank] == best.measured["total"]
    first = verify_layout("tiny", lay, two, rank=0)  # after rank 4
    assert first.stage_ids == [0] and first.per_rank == {0: best.per_rank[0]}  # the same dry run, the same bytes
    assert {id(m) for m in meshes()} <= {id(m) for m in earlier}  # no world outlives its dry runs
    # A plain layout still runs after them in the same process.
    after = verify_layout("tiny", Layout(dp_shard=2, zero_stage=3), WORK)
    _check_shape(after)
    assert after.rank == 0 and after.stage_ids is None


def _real_single_process_peaks(cfg, steps: int) -> list[int]:
    """The same config trained for real (gloo, one rank) through build_run and measured_step."""
    from meshfit.train.dist import RankEnv
    from meshfit.train.run import build_run
    from meshfit.train.trainer import measured_step

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run = build_run(cfg, RankEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), None)
        peaks = []
        for _ in range(steps):
            inputs, targets = run.batches.next_batch()
            measured_step(run, inputs, targets)
            peaks.append(run.tracker.peak()["peak"])
        return peaks
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("work", [FP32, WORK], ids=["fp32", "mixed"])
def test_fake_peak_matches_a_real_single_process_run(work):
    layout = Layout(micro_batch=4)  # two accumulation steps
    fake = verify_layout("tiny", layout, work)
    real = _real_single_process_peaks(verify_config("tiny", layout, work), steps=2)
    assert abs(fake.measured["total"] - real[1]) <= 0.02 * real[1]


def test_model_config_and_restored_state():
    import torch.nn.parallel.distributed as ddp_module
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    patched = (ShardingPropagator._propagate_tensor_meta_non_cached, ddp_module._sync_module_states,
               sys.excepthook)
    small = dataclasses.replace(get_preset("tiny"), n_layers=1)
    one_layer = verify_layout(small, Layout(dp_shard=2, zero_stage=3), FP32, steps=1)
    assert one_layer.steps == 1 and one_layer.measured["total"] > 0
    assert (ShardingPropagator._propagate_tensor_meta_non_cached, ddp_module._sync_module_states,
            sys.excepthook) == patched


@pytest.mark.parametrize("change, field", [
    ({"precision": "bf16"}, "precision 'mixed'"),
    ({"optimizer": "sgd"}, "optimizer"),
    ({"dropout": 0.1}, "dropout"),
])
def test_unsupported_workloads_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        verify_layout("tiny", Layout(), dataclasses.replace(WORK, **change))


def test_bad_rank_and_bad_layout_are_reported_before_any_run():
    with pytest.raises(ValueError, match="rank=8"):
        verify_layout("tiny", Layout(dp_shard=8, zero_stage=3), WORK, rank=8)
    with pytest.raises(ValueError, match="global_batch"):
        verify_layout("tiny", Layout(dp_shard=3, zero_stage=3), WORK)
    assert not dist.is_initialized()
