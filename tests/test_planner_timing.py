"""Analytic step time: compute, communication, bubble and throughput of layouts (pure arithmetic, no ranks)."""

from dataclasses import replace

import pytest

from meshfit.hardware.catalog import Cluster
from meshfit.layout.layout import Layout, Workload
from meshfit.layout.stage_split import balanced_split, head_flops, layer_flops
from meshfit.models.config import flops_per_token
from meshfit.models.presets import PRESETS, get_preset
from meshfit.models.traffic import elementwise_traffic
from meshfit.parallel.pipeline_parallel import StagePlan, plan_stages
from meshfit.hardware.kernels import kernel_rates
from meshfit.planner.timing.estimate import (
    EAGER_ATTENTION_SLOWDOWN,
    HBM_EFFICIENCY,
    ZERO_BUBBLE_FACTOR,
    StepTime,
    bottleneck_rank,
    step_time,
)
from meshfit.planner.timing.kernels import kernel_times

LLAMA8B = get_preset("llama3-8b")
NODE = Cluster("H100-SXM", nodes=1, gpus_per_node=8)
LONG = Workload(seq_len=8192, global_batch=32)
PARTS = ("compute_s", "tp_comm_s", "dp_comm_s", "pp_comm_s", "bubble_s", "offload_s", "optimizer_s")


def _time(layout: Layout, workload: Workload = LONG, cluster: Cluster = NODE, model=LLAMA8B, **kw) -> StepTime:
    layout.check()
    return step_time(model, layout, workload, cluster, **kw)


def _cluster(world: int, per_node: int = 8) -> Cluster:
    return Cluster("H100-SXM", nodes=max(1, world // per_node), gpus_per_node=min(world, per_node))


def _kernels(model, work: Workload, micro_batch: int = 1, tp: int = 1):
    """The datasheet per-kernel times (planner/timing/kernels.py) of ``model`` on the H100 node."""
    from meshfit.models.config import pad_vocab_for_tp

    return kernel_times(pad_vocab_for_tp(model, tp), NODE.gpu, work.precision, work.attention,
                        micro_batch * work.seq_len, work.seq_len, tp, 1, NODE.gpu.hbm_bytes_per_s * HBM_EFFICIENCY)


# --- Agreement with the pipeline's own split -----------------------------------------------------------


def _exhaustive_split(n_layers: int, n_stages: int, layer_cost: float, head_cost: float) -> list[int]:
    """Reference: search every contiguous split for the smallest most-expensive stage (O(layers² · stages))."""
    best: dict[tuple[int, int], tuple[float, list[int]]] = {}

    def solve(start: int, stages: int) -> tuple[float, list[int]]:
        if (start, stages) in best:
            return best[(start, stages)]
        left = n_layers - start
        if stages == 1:
            result = (left * layer_cost + head_cost, [left])
        else:
            result = (float("inf"), [])
            for take in range(1, left - stages + 2):
                rest_cost, rest = solve(start + take, stages - 1)
                cost = max(take * layer_cost, rest_cost)
                if cost < result[0]:
                    result = (cost, [take] + rest)
        best[(start, stages)] = result
        return result

    return solve(0, n_stages)[1]


def test_balanced_split_equals_the_exhaustive_search():
    for model in PRESETS.values():
        for seq in (128, 8192):
            layer, head = layer_flops(model, seq), 2.0 * model.dim * model.vocab_size
            for stages in (2, 3, 4, 5, 7, 8, 12, 16, 24, 32):
                if stages > min(model.n_layers, 3000 // model.n_layers):  # the reference is O(layers²·stages)
                    continue
                assert balanced_split(model.n_layers, stages, layer, head) == \
                    _exhaustive_split(model.n_layers, stages, layer, head), (model, seq, stages)


def _most_loaded(plan: StagePlan, pp: int, layer: float, head: float) -> tuple[int, bool, bool]:
    # (blocks, first stage, last stage) of the rank whose stages cost the most forward FLOPs.
    last = plan.n_stages - 1
    ranks = [plan.stages_of_rank(rank, pp) for rank in range(pp)]
    worst = max(ranks, key=lambda ids: sum(len(plan.layers[i]) for i in ids) * layer + head * (last in ids))
    return sum(len(plan.layers[i]) for i in worst), 0 in worst, last in worst


def test_bottleneck_rank_is_the_most_loaded_rank_of_the_pipeline_plan():
    for model in (LLAMA8B, get_preset("llama3-70b"), get_preset("small")):
        layer, head = layer_flops(model, 4096), 2.0 * model.dim * model.vocab_size
        assert bottleneck_rank(model.n_layers, 1, 1, False, layer, head) == (model.n_layers, True, True)
        for pp, schedule, v in ((2, "1f1b", 1), (4, "1f1b", 1), (2, "interleaved-1f1b", 2), (4, "zbv", 2),
                                (2, "dualpipev", 2), (4, "interleaved-zb", 3)):
            if pp * v > model.n_layers:
                continue
            plan = plan_stages(model, 4096, pp, v, schedule, None)
            expected = _most_loaded(plan, pp, layer, head)
            assert bottleneck_rank(model.n_layers, pp, v, plan.v_shape, layer, head) == expected
    with pytest.raises(ValueError, match="33 stages"):
        bottleneck_rank(32, 11, 3, False, 1.0, 1.0)


def test_a_loss_heavier_than_the_blocks_makes_the_head_rank_the_bottleneck():
    # Llama-3.2 1B over 4 stages splits its 16 blocks 5, 5, 5, 1 by FLOPs (the head weighs like 4 blocks);
    # its 128K-vocabulary fp32 loss moves as many bytes as 7 blocks, so by time the head rank is the most
    # loaded, and the step's compute is that rank's.
    model = get_preset("llama3-1b")
    layer, head = layer_flops(model, 2048), head_flops(model)
    assert bottleneck_rank(model.n_layers, 4, 1, False, layer, head) == (5, True, False)
    assert bottleneck_rank(model.n_layers, 4, 1, False, layer, head, (1.0, 12.0, 0.0)) == (1, False, True)
    work = Workload(seq_len=2048, global_batch=16)
    t = _time(Layout(pp=4, schedule="1f1b", micro_batch=1), work, _cluster(4), model)
    tokens = work.tokens
    kernels = _kernels(model, work)
    matmuls = tokens * (kernels.block + kernels.head)  # one block and the head, each kernel at its own rate
    assert t.compute_s == pytest.approx(matmuls + _elementwise_s(model, tokens, 1) - _embed_s(model, tokens))
    # At one efficiency for every matmul (a what-if) the stage is its FLOPs at that rate (rel: the model's
    # FLOPs per token also count the norms' weights, which the per-block count leaves out).
    flat = _time(Layout(pp=4, schedule="1f1b", micro_batch=1), work, _cluster(4), model, efficiency=0.5)
    matmuls = tokens * 3 * (layer + head) / (0.5 * NODE.gpu.bf16_flops)
    assert flat.compute_s == pytest.approx(matmuls + _elementwise_s(model, tokens, 1) - _embed_s(model, tokens),
                                           rel=1e-4)


def _embed_s(model, tokens: int) -> float:
    return tokens * elementwise_traffic(model, 2).embed / (NODE.gpu.hbm_bytes_per_s * HBM_EFFICIENCY)


# --- Compute and recomputation ---------------------------------------------------------------------------


def _elementwise_s(model, tokens: int, layers: int, forwards: float = 0.0, c: int = 2) -> float:
    """Seconds of the element-wise bytes of ``tokens`` through ``layers`` blocks (plus ``forwards`` re-run
    block forwards), the embeddings, final norm and loss, at the H100's HBM rate (unsplit: no TP)."""
    t = elementwise_traffic(model, c)
    moved = layers * t.block + forwards * (t.split_fwd + t.wide_fwd) + t.embed + t.final_norm + t.vocab
    return tokens * moved / (NODE.gpu.hbm_bytes_per_s * HBM_EFFICIENCY)


def test_single_rank_compute_is_the_kernels_time_plus_elementwise_traffic():
    model, work = get_preset("llama3-1b"), Workload(seq_len=2048, global_batch=64)
    t = _time(Layout(micro_batch=2), work, _cluster(1), model)
    kernels = _kernels(model, work, micro_batch=2)
    matmuls = work.tokens * (model.n_layers * kernels.block + kernels.head)
    assert t.compute_s == pytest.approx(matmuls + _elementwise_s(model, work.tokens, model.n_layers))
    assert t.tp_comm_s == t.dp_comm_s == t.pp_comm_s == t.bubble_s == t.offload_s == 0.0
    # MFU: the matmuls reach at most the H100's maximum achievable matmul fraction (80.3%), and the fused
    # attention (counted over every key, run over the causal half) less here; the element-wise time (a 128K
    # vocabulary's fp32 loss on a 1B model is a large part of it) and the optimizer step dilute it.
    assert 0.3 < t.mfu < kernel_rates("H100-SXM").matmul_fraction * matmuls / t.total_s
    # A what-if at one efficiency runs the model's FLOPs at that fraction of the peak.
    flat = _time(Layout(micro_batch=2), work, _cluster(1), model, efficiency=0.5)
    matmuls = work.tokens * flops_per_token(model, 2048) / (0.5 * NODE.gpu.bf16_flops)
    assert flat.compute_s == pytest.approx(matmuls + _elementwise_s(model, work.tokens, model.n_layers))
    assert flat.mfu == pytest.approx(0.5 * matmuls / flat.total_s)


def test_recompute_re_runs_the_checkpointed_blocks_forward():
    base = Layout(dp_shard=8, zero_stage=3)
    none = _time(base)
    full = _time(replace(base, activation_checkpointing="full"))
    selective = _time(replace(base, activation_checkpointing="selective"))
    op = _time(replace(base, activation_checkpointing="op"))
    assert none.recompute_s == 0.0
    # Full: one more forward of every block (its matmuls and attention core), and the blocks' forward
    # element-wise traffic again.
    tokens = LONG.tokens // 8
    layers = LLAMA8B.n_layers
    kernels = _kernels(LLAMA8B, LONG)
    matmuls = tokens * layers * (kernels.block_fwd + kernels.core_fwd)
    forwards = _elementwise_s(LLAMA8B, tokens, 0, layers) - _elementwise_s(LLAMA8B, tokens, 0)
    assert full.recompute_s == pytest.approx(matmuls + forwards)
    assert full.compute_s == pytest.approx(none.compute_s + full.recompute_s)
    # meshfit's selective checkpointing re-runs every second block (32 blocks: half of full's recompute).
    assert selective.recompute_s == pytest.approx(full.recompute_s / 2)
    # The "op" policy keeps matmul outputs and re-runs the element-wise ops of every block's forward.
    assert op.recompute_s == pytest.approx(forwards)


def test_split_backward_schedules_re_run_recomputed_blocks_per_weight_group():
    from meshfit.planner.timing.estimate import SPLIT_RERUNS

    def recompute(schedule, ac, virtual=2):
        return _time(Layout(dp_shard=2, pp=4, zero_stage=1, schedule=schedule, virtual_stages=virtual,
                            activation_checkpointing=ac)).recompute_s

    reruns = {name: counts["llama"] for name, counts in SPLIT_RERUNS.items()}
    # Against the schedule of the same stage placement without the split (1), and between the V schedules.
    assert recompute("interleaved-zb", "full") == pytest.approx(reruns["interleaved-zb"]
                                                                * recompute("interleaved-1f1b", "full"))
    assert recompute("zbv", "full") == pytest.approx(reruns["zbv"] / reruns["dualpipev"]
                                                     * recompute("dualpipev", "full"))
    assert all(recompute(schedule, "none") == 0.0 for schedule in SPLIT_RERUNS)


def test_eager_attention_is_slower_than_flash_on_the_attention_core_only():
    flash = _time(Layout(dp_shard=8, zero_stage=3))
    eager_work = replace(LONG, attention="eager")
    eager = _time(Layout(dp_shard=8, zero_stage=3), eager_work)
    fused, scores = _kernels(LLAMA8B, LONG), _kernels(LLAMA8B, eager_work)
    cores = LONG.tokens // 8 * LLAMA8B.n_layers  # attention cores per step, forward + backward
    assert eager.compute_s - flash.compute_s == pytest.approx(
        cores * (scores.core_fwd + scores.core_bwd - fused.core_fwd - fused.core_bwd))
    assert eager.compute_s > 1.2 * flash.compute_s
    # At one efficiency (a what-if) the eager core is EAGER_ATTENTION_SLOWDOWN times the fused one's FLOPs.
    core = LONG.tokens // 8 * 12 * LLAMA8B.n_layers * LLAMA8B.dim * 8192 / (0.5 * NODE.gpu.bf16_flops)
    flat = [_time(Layout(dp_shard=8, zero_stage=3), w, efficiency=0.5).compute_s for w in (LONG, eager_work)]
    assert flat[1] - flat[0] == pytest.approx(core * (EAGER_ATTENTION_SLOWDOWN - 1))


def test_tensor_sequence_and_loss_parallelism_split_the_elementwise_traffic():
    # One H100 node, tp 8 at one data-parallel rank per group: the split part divides by 8 in every
    # layout; sequence parallelism also divides the blocks' dim-wide part and the final norm (not the
    # embeddings, which run on the whole sequence), loss parallelism the vocabulary.
    work, t = Workload(seq_len=8192, global_batch=1), elementwise_traffic(LLAMA8B, 2)
    tokens, bw = work.tokens, NODE.gpu.hbm_bytes_per_s * HBM_EFFICIENCY
    plain = _time(Layout(tp=8), work)
    sp = _time(Layout(tp=8, sp=True), work)
    both = _time(Layout(tp=8, sp=True, loss_parallel=True), work)
    layers = LLAMA8B.n_layers
    assert plain.compute_s - sp.compute_s == pytest.approx(
        tokens * (layers * (t.wide_fwd + t.wide_bwd) + t.final_norm) * (1 - 1 / 8) / bw)
    assert sp.compute_s - both.compute_s == pytest.approx(tokens * t.vocab * (1 - 1 / 8) / bw)


def test_fp32_is_slower_than_mixed():
    layout = Layout(dp_shard=8, zero_stage=3)
    fp32, mixed = _time(layout, replace(LONG, precision="fp32")), _time(layout)
    assert fp32.compute_s > 10 * mixed.compute_s  # plain fp32 vs bf16 tensor cores
    assert fp32.total_s > mixed.total_s and fp32.tokens_per_s < mixed.tokens_per_s


# --- Pipeline bubble and point-to-point ------------------------------------------------------------------


def test_bubble_is_p_minus_1_over_m_and_divides_by_v_interleaved():
    work = Workload(seq_len=2048, global_batch=16)
    one = _time(Layout(pp=4, schedule="1f1b"), work, _cluster(4))
    assert one.bubble_s == pytest.approx(3 / 16 * one.compute_s)
    gpipe = _time(Layout(pp=4, schedule="gpipe"), work, _cluster(4))
    assert gpipe.bubble_s == pytest.approx(one.bubble_s)
    for v in (2, 4):
        inter = _time(Layout(pp=4, schedule="interleaved-1f1b", virtual_stages=v), work, _cluster(4))
        assert inter.bubble_s == pytest.approx(3 / (16 * v) * inter.compute_s)
        assert inter.pp_comm_s == pytest.approx(v * one.pp_comm_s)  # v times the stage boundaries


def test_more_microbatches_shrink_the_bubble():
    layout = Layout(pp=4, schedule="1f1b", micro_batch=4)
    bubbles = [_time(replace(layout, micro_batch=mb), Workload(2048, 32), _cluster(4)).bubble_s for mb in (8, 4, 2, 1)]
    assert bubbles == sorted(bubbles, reverse=True) and bubbles[0] > 4 * bubbles[-1]


def test_zero_bubble_schedules_beat_1f1b():
    work, cluster = Workload(seq_len=2048, global_batch=16), _cluster(4)
    one = _time(Layout(pp=4, schedule="1f1b"), work, cluster)
    for schedule, v in (("zbv", 2), ("dualpipev", 2), ("interleaved-zb", 2)):
        zb = _time(Layout(pp=4, schedule=schedule, virtual_stages=v), work, cluster)
        assert zb.bubble_s == pytest.approx(3 / (16 * v) * ZERO_BUBBLE_FACTOR * zb.compute_s)
        assert zb.bubble_s < one.bubble_s


# --- Tensor and data parallelism -------------------------------------------------------------------------


def test_tp_comm_grows_when_tp_spans_nodes():
    layout = Layout(tp=8, sp=True)
    inside = _time(layout, cluster=Cluster("H100-SXM", nodes=1, gpus_per_node=8))
    across = _time(layout, cluster=Cluster("H100-SXM", nodes=2, gpus_per_node=4))
    assert across.tp_comm_s > 2 * inside.tp_comm_s  # the 4 GPUs' NICs of a node (4 × 50 GB/s) vs 450 GB/s NVLink
    assert across.compute_s == inside.compute_s


def test_loss_parallel_saves_the_logits_gather_and_full_ac_repeats_the_forward_reductions():
    base = _time(Layout(tp=8))
    assert _time(Layout(tp=8, loss_parallel=True)).tp_comm_s < base.tp_comm_s
    assert _time(Layout(tp=8, activation_checkpointing="full")).tp_comm_s > base.tp_comm_s
    assert _time(Layout(tp=8, activation_checkpointing="selective")).tp_comm_s == base.tp_comm_s


def test_zero_stages_communicate_per_micro_batch_as_they_keep_state():
    # dp 8 with global batch 32: 4 micro-batches per rank. At equal bytes per value (fp32 and pure bf16),
    # in units of one pass over the weights: stage 3 gathers twice and reduces per micro-batch (12),
    # stage 2 gathers once per step and reduces per micro-batch (5), stage 1 gathers and reduces once (2).
    for precision in ("fp32", "bf16"):
        work = replace(LONG, precision=precision)
        z1, z2, z3 = (_time(Layout(dp_shard=8, zero_stage=s), work, dp_overlap=0.0).dp_comm_s for s in (1, 2, 3))
        assert z3 == pytest.approx(12 / 5 * z2) and z2 == pytest.approx(5 / 2 * z1)
    # One micro-batch: stage 3 moves 1.5× stage 2, and stage 1 = stage 2.
    one = replace(LONG, global_batch=8, precision="fp32")
    z1, z2, z3 = (_time(Layout(dp_shard=8, zero_stage=s), one, dp_overlap=0.0).dp_comm_s for s in (1, 2, 3))
    assert z3 == pytest.approx(1.5 * z2) and z1 == pytest.approx(z2)
    # Mixed precision gathers 2-byte weights; stage 1 also reduces in bf16, stages 2/3 reduce fp32
    # gradients (the per-call latency aside: 2 vs 3 units).
    mixed = replace(one, precision="mixed")
    z1, z2 = (_time(Layout(dp_shard=8, zero_stage=s), mixed, dp_overlap=0.0).dp_comm_s for s in (1, 2))
    assert 2 / 3 * z2 <= z1 < 0.7 * z2


def test_overlap_hides_dp_comm_and_dp_across_nodes_costs_more():
    layout = Layout(dp_shard=16, zero_stage=3)
    work = Workload(seq_len=2048, global_batch=16)
    exposed, hidden = _time(layout, work, _cluster(16), dp_overlap=0.0), _time(layout, work, _cluster(16))
    assert hidden.dp_comm_s < exposed.dp_comm_s
    # The same 16 ranks in one node: NVLink (450 GB/s) against the two nodes' 8 NICs (8 × 50 GB/s).
    one_node = _time(layout, work, Cluster("H100-SXM", nodes=1, gpus_per_node=16), dp_overlap=0.0)
    assert exposed.dp_comm_s > 1.1 * one_node.dp_comm_s
    # HSDP keeps the gathers inside the node and all-reduces a 1/8 shard across nodes: on 32 nodes it beats a
    # 256-rank ring, whose latency grows with its hops (on two nodes their 8 NICs make the two about even).
    big = Workload(seq_len=2048, global_batch=256)
    fsdp = _time(Layout(dp_shard=256, zero_stage=3), big, _cluster(256), dp_overlap=0.0)
    hsdp = _time(Layout(dp_replicate=32, dp_shard=8, zero_stage=3), big, _cluster(256), dp_overlap=0.0)
    assert hsdp.dp_comm_s < fsdp.dp_comm_s


def test_pure_dp_mfu_is_at_most_the_kernels_fraction_of_the_peak():
    for layout in (Layout(dp_replicate=8), Layout(dp_shard=8, zero_stage=1), Layout(dp_shard=8, zero_stage=2),
                   Layout(dp_shard=8, zero_stage=3), Layout(dp_shard=8, zero_stage=3, offload=True)):
        t = _time(layout, model=get_preset("llama3-1b"))
        assert 0 < t.mfu <= kernel_rates("H100-SXM").matmul_fraction, layout
        assert _time(layout, model=get_preset("llama3-1b"), efficiency=0.3).mfu <= 0.3


def test_offload_pays_the_host_optimizer_step():
    on, off = _time(Layout(dp_shard=8, zero_stage=3, offload=True)), _time(Layout(dp_shard=8, zero_stage=3))
    assert on.offload_s > 0 and on.optimizer_s == 0 and off.offload_s == 0 and off.optimizer_s > 0
    assert on.total_s > off.total_s


# --- Throughput and consistency --------------------------------------------------------------------------


def test_parts_add_up_and_throughput_is_consistent():
    layouts = (Layout(), Layout(dp_shard=4, zero_stage=3, tp=2, sp=True, activation_checkpointing="selective"),
               Layout(pp=2, dp_shard=2, zero_stage=2, tp=2, schedule="interleaved-1f1b", virtual_stages=2),
               Layout(pp=8, schedule="zbv", virtual_stages=2), Layout(dp_replicate=2, dp_shard=4, zero_stage=3))
    for layout in layouts:
        cluster = _cluster(layout.world_size)
        t = _time(layout, cluster=cluster)
        assert t.total_s == pytest.approx(sum(getattr(t, name) for name in PARTS))
        assert all(getattr(t, name) >= 0 for name in PARTS) and t.recompute_s <= t.compute_s
        assert t.tokens_per_s == pytest.approx(LONG.tokens / t.total_s)
        peak = layout.world_size * cluster.gpu.bf16_flops
        assert t.mfu == pytest.approx(t.tokens_per_s * flops_per_token(LLAMA8B, 8192) / peak)


def test_more_data_parallel_ranks_raise_throughput():
    work = Workload(seq_len=4096, global_batch=64)
    # Inside a node the gathers hide behind the compute: nearly linear.
    rates = [_time(Layout(dp_shard=n, zero_stage=3), work, _cluster(n)).tokens_per_s for n in (1, 2, 4, 8)]
    assert rates == sorted(rates) and rates[-1] > 7.5 * rates[0]
    # Across nodes, with one micro-batch per step so that each rank gathers once per forward and backward.
    rates = [_time(Layout(dp_shard=n, zero_stage=3, micro_batch=64 // n), work, _cluster(n)).tokens_per_s
             for n in (8, 16, 32)]
    assert rates == sorted(rates)
    ddp = [_time(Layout(dp_replicate=n), work, _cluster(n), get_preset("llama3-1b")).tokens_per_s
           for n in (1, 2, 4, 8, 16, 32)]
    assert ddp == sorted(ddp)


def test_rejects_a_layout_for_another_world_size():
    with pytest.raises(ValueError, match=r"layout world size 4 .*cluster's world size 8"):
        _time(Layout(dp_shard=4, zero_stage=3))
    with pytest.raises(ValueError, match="global_batch=30"):
        _time(Layout(dp_shard=8, zero_stage=3), replace(LONG, global_batch=30))
    with pytest.raises(ValueError, match="micro_batch=3"):
        _time(Layout(dp_shard=8, zero_stage=3, micro_batch=3))


# --- Operators per block (per-operator cost) ------------------------------------------------------------


def test_operator_counts_follow_recompute_and_compilation():
    from meshfit.planner.timing.op_count import op_counts, rank_ops

    small = get_preset("small")
    none, full, op = (op_counts(small, p) for p in ("none", "full", "op"))
    # A checkpointed block re-runs its forward in backward: more operators, and "full" also re-runs the
    # matmuls, which "op" keeps.
    assert full.block > none.block and op.block > none.block
    assert full.block_heavy > none.block_heavy == op.block_heavy > 0
    # The count is the structure's, not the sizes': a wider model with the same heads counts the same.
    assert op_counts(replace(small, dim=512, ffn_hidden=1376), "none") == none
    # Compiled blocks launch far fewer kernels; "selective" lies between "none" and "full".
    assert rank_ops(small, "none", 4, False, True) < rank_ops(small, "none", 4, False, False) / 3
    sel = rank_ops(small, "selective", 4, True, False)
    assert rank_ops(small, "none", 4, True, False) < sel < rank_ops(small, "full", 4, True, False)
    assert sel == 2 * full.block + 2 * none.block + none.rest
    with pytest.raises(ValueError, match="counted are none, full, op, attention"):
        op_counts(small, "selective")
