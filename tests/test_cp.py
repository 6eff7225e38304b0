"""Context parallelism: parity with one process in every composition, the chunk layout, validation."""

import functools

import pytest
import torch
from dist_jobs import PARITY_BASE, parity_config, train_job

from meshfit.config import ConfigError, load_config
from meshfit.models.layers import AttentionCore
from meshfit.parallel.context_parallel import _global_order, local_positions, shard_sequence
from meshfit.train.launch import launch
from meshfit.train.shape import resolve_run
from meshfit.util.ranks import run_ranks

# RoPE, learned positions (untied: pipeline stages hold the embedding and the head apart)
FAMILIES = {"llama": ["model.preset=tiny"], "gpt": ["model.preset=tiny-gpt", "model.tie_embeddings=false"]}
LAYOUTS = {  # ranks, overrides
    "cp2": (2, ["parallel.cp=2"]),
    "cp4": (4, ["parallel.cp=4"]),
    "cp2-zero3": (4, ["parallel.cp=2", "parallel.dp_shard=2", "parallel.zero_stage=3"]),
    "cp2-tp2-sp": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
    "cp2-pp2": (4, ["parallel.cp=2", "parallel.pp=2"]),
}


@functools.cache
def reference(family):
    return run_ranks(train_job, 1, parity_config(*FAMILIES[family]))[0]


def _max_delta(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _assert_parity(runs, family):
    ref = reference(family)
    assert _max_delta(runs[0]["losses"], ref["losses"]) <= 1e-5
    assert _max_delta(runs[0]["grad_norms"], ref["grad_norms"]) <= 1e-5
    assert all(r["losses"] == runs[0]["losses"] for r in runs)  # one vote: the same loss on every rank


# Every layout for Llama; for GPT the ones where its learned positions meet another split (all of them run
# in benchmarks/correctness/parity_report.py).
CASES = [("llama", name) for name in LAYOUTS] + [("gpt", "cp2"), ("gpt", "cp2-pp2")]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_cp_parity(family, layout):
    ranks, overrides = LAYOUTS[layout]
    _assert_parity(run_ranks(train_job, ranks, parity_config(*FAMILIES[family], *overrides)), family)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides", [
    ["model.attention=eager", "parallel.activation_checkpointing=op"],
    ["parallel.zero_stage=0", "parallel.activation_checkpointing=full"],  # DDP: each rank keeps its RoPE rows
    ["parallel.zero_stage=2", "parallel.offload=true", "parallel.activation_checkpointing=selective"],
], ids=["eager-op-recompute", "ddp-full-recompute", "zero2-offload-selective"])
def test_cp_composes_with_kernels_recompute_and_data_parallel_kinds(overrides):
    _assert_parity(run_ranks(train_job, 2, parity_config(*FAMILIES["llama"], "parallel.cp=2", *overrides)), "llama")


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_gathered_chunks_in_rank_order_are_the_sequence(cp):
    seq = torch.arange(2 * 24).view(2, 24)  # [batch, sequence]
    parts = [shard_sequence(seq, cp, rank) for rank in range(cp)]
    for rank, part in enumerate(parts):
        assert torch.equal(part[0], local_positions(24 // cp, cp, rank))  # the positions it holds
    gathered = torch.cat([p.t() for p in parts])  # sequence-first, rank after rank, as the all-gather leaves it
    assert torch.equal(_global_order(gathered, cp).t(), seq)


def test_chunks_balance_causal_work():
    # Rank i holds chunks i and 2cp-1-i: every rank's queries see the same number of keys.
    cp, seq = 4, 64
    work = [int((local_positions(seq // cp, cp, rank) + 1).sum()) for rank in range(cp)]
    assert len(set(work)) == 1


@pytest.mark.parametrize("kernel", ["flash", "eager"])
def test_fewer_queries_than_keys_are_the_last_positions(kernel):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    core = AttentionCore(0.0, kernel)
    full = core(q, k, v)
    assert torch.allclose(core(q[:, :, 12:], k, v), full[:, :, 12:], atol=1e-6)
    assert torch.allclose(core(q[:, :, 4:8], k[:, :, :8], v[:, :, :8]), full[:, :, 4:8], atol=1e-6)


def test_cp_validation_names_the_field_and_what_works():
    with pytest.raises(ConfigError, match=r"parallel.cp=2 cuts each sequence into 2·cp = 4 .* train.seq_len=66 .*"
                                          r"use train.seq_len 64 or 68"):
        resolve_run(load_config(None, ["parallel.cp=2", "train.seq_len=66"]), 2)
    with pytest.raises(ConfigError, match=r"pp × dp_replicate × dp_shard × cp × tp = 1 × 1 × 1 × 2 × 2 = 4, "
                                          r"but the world size is 2"):
        resolve_run(load_config(None, ["parallel.cp=2", "parallel.tp=2", "parallel.dp_shard=1"]), 2)
    with pytest.raises(ConfigError, match=r"parallel.cp=2 with parallel.zero_stage=0 .* use parallel.zero_stage 1"):
        resolve_run(load_config(None, ["parallel.cp=2", "parallel.zero_stage=0", "train.precision=bf16"]), 2)
    with pytest.raises(ConfigError, match=r"train.seq_len/parallel.cp=18"):  # under SP, tp splits each rank's part
        resolve_run(load_config(None, ["parallel.cp=2", "parallel.tp=4", "parallel.sp=true", "train.seq_len=36",
                                       "model.n_kv_heads=4"]), 8)


def test_cp_defaults_to_sharding_over_the_context_ranks():
    shape = resolve_run(load_config(None, ["parallel.cp=2"]), 4)
    assert (shape.dims.dp_shard, shape.dims.cp, shape.zero_stage) == (2, 2, 3)
    assert resolve_run(load_config(None, ["parallel.cp=2"]), 2).zero_stage == 3  # cp ranks shard the weights


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_checkpoints_reshard_between_cp_degrees(tmp_path):
    """cp 2 → one process → cp 4, 3 steps each, resumed from each other's checkpoints, against one process
    for 9 steps."""
    base = [*PARITY_BASE, "train.steps=9"]
    reference = launch(load_config(None, base), tmp_path / "reference")
    assert reference.ok, reference.message
    losses, layouts = [], []
    for i, (overrides, nproc) in enumerate([(["parallel.cp=2"], 2), ([], None), (["parallel.cp=4"], 4)]):
        resume = ["checkpoint.resume=true"] if i else []
        outcome = launch(load_config(None, [*base, *overrides, *resume, f"train.stop_after={3 * (i + 1)}"]),
                         tmp_path / "run", nproc)
        assert outcome.ok, outcome.message
        assert outcome.result["start_step"] == 3 * i
        losses += outcome.result["losses"]
        layouts.append(outcome.result["layout"])
    assert layouts == ["cp=2", "single rank", "cp=4"]
    assert losses == pytest.approx(reference.result["losses"], abs=1e-5, rel=0)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_cp_under_mixed_precision_stays_within_bf16_rounding_of_one_process():
    # bf16 rounding moves the loss by ~1e-4 between any two layouts (dp_shard 2 vs one process: 1.7e-4 seen).
    ref = run_ranks(train_job, 1, parity_config("parallel.zero_stage=3", "parallel.mixed_precision=true"))[0]
    runs = run_ranks(train_job, 2, parity_config("parallel.cp=2", "parallel.mixed_precision=true"))
    assert _max_delta(runs[0]["losses"], ref["losses"]) <= 1e-3
