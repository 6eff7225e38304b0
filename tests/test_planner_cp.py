"""The planner under context parallelism (parallel.cp): layout, activations, model states, time, search,
--explain. Plain arithmetic on the planner's functions; the dry-run check is in tests/test_verify.py."""

from __future__ import annotations

import dataclasses

import pytest

from meshfit.commands.plan_flags import PlanInputError, check_layout
from meshfit.hardware.catalog import Cluster
from meshfit.layout.layout import Layout, Workload, parse_layout
from meshfit.models import get_preset
from meshfit.planner.explain import explain
from meshfit.planner.memory.activations import (
    block_activation_bytes,
    checkpointed_block_bytes,
    cp_keys_per_query,
    gathered_kv_bytes,
)
from meshfit.planner.memory.estimate import estimate_memory
from meshfit.planner.search import MIN_CP_TOKENS, enumerate_layouts, search
from meshfit.planner.timing.estimate import step_time

SMALL = get_preset("small")
LLAMA8B = get_preset("llama3-8b")
LONG8B = dataclasses.replace(LLAMA8B, max_seq_len=131072)
NODE = Cluster("H100-SXM", nodes=1, gpus_per_node=8)


def test_layout_counts_cp_in_the_world_and_in_the_config():
    layout = parse_layout("cp=4,tp=2")
    assert layout.world_size == 8 and layout.dp == 1 and layout.shard == 4
    assert layout.zero_stage == 3  # the config's default: state sharded over dp_shard × cp
    assert layout.config_sections(4)["parallel"]["cp"] == 4
    assert layout.describe() == "zero3 · cp=4 · tp=2 · mb=1"
    # Plan files written before cp existed read as cp = 1.
    old = {k: v for k, v in Layout(dp_shard=2, zero_stage=3).to_dict().items() if k != "cp"}
    assert Layout.from_dict(old).cp == 1
    with pytest.raises(ValueError, match="layout cp=0"):
        parse_layout("cp=0")


@pytest.mark.parametrize("layout, seq, message", [
    (Layout(cp=3, zero_stage=3), 4096, "--layout cp=3 cuts each sequence into 2·cp = 6"),
    (Layout(cp=2, zero_stage=0), 4096, "--layout zero_stage 1, 2 or 3"),  # DDP over cp ranks: fp32 only
    (Layout(cp=4, tp=4, sp=True, zero_stage=3), 8200, "--seq-len/cp=2050"),
])
def test_plan_refuses_cp_layouts_the_trainer_refuses(layout, seq, message):
    model = dataclasses.replace(SMALL, max_seq_len=8200)
    with pytest.raises(PlanInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_layout(model, layout, Workload(seq_len=seq, global_batch=1))


def test_block_activations_are_the_local_sequence_plus_the_gathered_keys_and_values():
    kw = dict(mode="bf16", batch=2, attention="flash")
    for cp in (2, 4):
        local = block_activation_bytes(SMALL, seq=2048 // cp, **kw)
        kv = gathered_kv_bytes(SMALL, mode="bf16", seq=2048, batch=2)
        assert kv == 2 * 2048 * 2 * SMALL.n_kv_heads * SMALL.head_size * 2
        assert block_activation_bytes(SMALL, seq=2048, cp=cp, **kw) == local + kv
        # Policies that recompute the attention core or keep only kernel outputs re-gather keys and values.
        for policy in ("op", "attention"):
            assert (block_activation_bytes(SMALL, seq=2048, cp=cp, policy=policy, **kw)
                    == block_activation_bytes(SMALL, seq=2048 // cp, policy=policy, **kw))
        assert checkpointed_block_bytes(SMALL, mode="bf16", seq=2048, batch=2, cp=cp) == 2048 // cp * 2 * SMALL.dim * 2
    # Tensor parallelism splits the key/value heads, so the gathered keys and values too.
    assert gathered_kv_bytes(SMALL, mode="bf16", seq=2048, batch=2, tp=2) == kv / 2
    # The gathered keys and values replace the local ones; each chunk's fused-kernel output is kept next
    # to their concatenation. Llama's `small` has kv_width = dim / 2 (the two cancel), GPT's kv_width = dim.
    gpt = get_preset("small-gpt")
    local_tokens = 1024 * 2
    assert block_activation_bytes(gpt, seq=2048, cp=2, **kw) == (
        block_activation_bytes(gpt, seq=1024, **kw) + gathered_kv_bytes(gpt, mode="bf16", seq=2048, batch=2)
        - 2 * local_tokens * gpt.dim * 2 + local_tokens * gpt.dim * 2)


def test_eager_scores_cover_each_chunks_prefix_of_the_keys():
    seq, cp = 1024, 4
    chunk = seq // (2 * cp)
    # Rank i's chunks i and 2cp-1-i see (i+1) and (2cp-i) chunks of keys: the same sum on every rank.
    for rank in range(cp):
        keys = (rank + 1) * chunk + (2 * cp - rank) * chunk
        assert keys * chunk == pytest.approx(2 * chunk * cp_keys_per_query(seq, cp))
    eager, flash = (block_activation_bytes(SMALL, mode="bf16", seq=seq, batch=1, attention=a, cp=cp)
                    for a in ("eager", "flash"))
    scores = SMALL.n_heads * (seq // cp) * cp_keys_per_query(seq, cp)
    mask = SMALL.n_heads // SMALL.n_kv_heads * (seq // cp) * cp_keys_per_query(seq, cp)
    lse = 4 * SMALL.n_heads * (seq // cp)
    outputs = seq // cp * SMALL.dim * 2  # the fused kernel's per-chunk outputs
    assert eager - flash == pytest.approx(2 * scores + mask - lse - outputs)


def test_model_states_shard_over_dp_shard_times_cp():
    work = Workload(seq_len=8192, global_batch=8)
    over_cp = estimate_memory(LLAMA8B, Layout(cp=8, zero_stage=3), work)
    over_dp = estimate_memory(LLAMA8B, Layout(dp_shard=8, zero_stage=3), work)
    assert over_cp.optim == over_dp.optim and over_cp.rest == over_dp.rest
    assert over_cp.activations < over_dp.activations / 4


def test_cp_collectives_and_compute_per_rank():
    work = Workload(seq_len=32768, global_batch=8)
    plain = step_time(LLAMA8B, Layout(dp_shard=8, zero_stage=3), work, NODE)
    cp = step_time(LLAMA8B, Layout(dp_shard=4, cp=2, zero_stage=3), work, NODE)
    assert plain.cp_comm_s == 0.0 and cp.cp_comm_s > 0
    # Same ranks, same tokens per step: each cp rank computes half of twice the sequences. At one rate for
    # every matmul (a what-if) that is the same compute; kernel by kernel the cp ranks' GEMMs take 16,384-token
    # micro-batches where the plain ranks' take 32,768, whose last waves fill differently (0.08% here).
    flat = [step_time(LLAMA8B, Layout(dp_shard=8 // c, cp=c, zero_stage=3), work, NODE, efficiency=0.5).compute_s
            for c in (1, 2)]
    assert flat[1] == pytest.approx(flat[0], rel=1e-9)
    assert cp.compute_s == pytest.approx(plain.compute_s, rel=2e-3)
    # Full recompute gathers keys and values once more per block: forward gather, re-run gather, and the
    # backward reduce-scatter move the same bytes over the same ring.
    full = step_time(LLAMA8B, Layout(dp_shard=4, cp=2, zero_stage=3, activation_checkpointing="full"), work, NODE)
    assert full.cp_comm_s == pytest.approx(cp.cp_comm_s * 3 / 2)
    # cp ranks are tp apart: with tp=4 a cp group of 4 spans two nodes' slower links.
    two_nodes = Cluster("H100-SXM", nodes=2, gpus_per_node=8)
    inside = step_time(LLAMA8B, Layout(dp_shard=2, cp=2, tp=4, zero_stage=3), work, two_nodes)
    across = step_time(LLAMA8B, Layout(cp=4, tp=4, zero_stage=3), work, two_nodes)
    assert across.cp_comm_s > 2 * inside.cp_comm_s


def test_search_enumerates_cp_degrees_that_split_the_sequence():
    long = Workload(seq_len=65536, global_batch=8)
    layouts = list(enumerate_layouts(LLAMA8B, long, NODE, activation_checkpointing="none", micro_batch=1))
    cps = {lay.cp for lay in layouts}
    assert cps == {1, 2, 4, 8}
    assert any(lay.cp > 1 and lay.pp > 1 for lay in layouts)  # context parallelism composes with pipelines
    for lay in layouts:
        if lay.cp > 1:
            assert long.seq_len % (2 * lay.cp) == 0 and long.seq_len // lay.cp >= MIN_CP_TOKENS
            assert not lay.sp or (long.seq_len // lay.cp) % lay.tp == 0
            assert lay.zero_stage > 0  # mixed precision: DDP over cp ranks is fp32 only
    short = Workload(seq_len=2 * MIN_CP_TOKENS - 2, global_batch=8)  # the search's size is unchanged here
    assert {lay.cp for lay in enumerate_layouts(LLAMA8B, short, NODE)} == {1}


def test_long_sequences_pick_cp_and_explain_says_activations_do_not_fit():
    cluster = Cluster("H100-SXM", nodes=8, gpus_per_node=8)
    plan = search(LONG8B, Workload(seq_len=131072, global_batch=64), cluster, model_name="llama3-8b")
    assert plan.best is not None and plan.best.layout.cp > 1
    text = explain(plan)
    assert "What does not fit here is activations, not weights" in text
    assert "- context parallelism splits every sequence" in text
    assert "best without context parallelism" in text


def test_explain_says_nothing_of_activations_when_model_states_do_not_fit():
    one = Cluster("H100-SXM", nodes=1, gpus_per_node=1)
    plan = search(LLAMA8B, Workload(seq_len=2048, global_batch=4), one, model_name="llama3-8b")
    text = explain(plan)
    assert "Model states alone exceed the device" in text
    assert "What does not fit here is activations" not in text
