"""Analytic planner memory and the GPU catalog against published figures (pure arithmetic, no ranks)."""

from dataclasses import FrozenInstanceError
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

import pytest

from meshfit.hardware.catalog import GPUS, Cluster, get_gpu
from meshfit.planner.memory.formulas import (
    activation_bytes_per_layer,
    activation_terms_per_layer,
    model_state_bytes,
    pipeline_in_flight_microbatches,
)

# --- Model states: ZeRO (Rajbhandari et al. 2020) ------------------------------------------------------


def _gb(n: float) -> Decimal:
    # The paper rounds half up to 0.1 GB (1.875 GB prints as 1.9), with GB = 1e9 bytes.
    return (Decimal(n) / Decimal(10**9)).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)


def test_zero_paper_figure_1():
    psi, n_d, k = 7_500_000_000, 64, 12
    totals = [sum(model_state_bytes(psi, precision="mixed", optimizer="adamw", zero_stage=stage,
                                    dp_shard=n_d).values()) for stage in range(4)]
    assert [_gb(x) for x in totals] == [Decimal("120.0"), Decimal("31.4"), Decimal("16.6"), Decimal("1.9")]
    # The paper's formulas: (2 + 2 + K)Ψ, 2Ψ + 2Ψ + KΨ/N_d, 2Ψ + (2 + K)Ψ/N_d, (2 + 2 + K)Ψ/N_d.
    assert totals == [(4 + k) * psi, 4 * psi + k * psi / n_d, 2 * psi + (2 + k) * psi / n_d, (4 + k) * psi / n_d]


def test_model_state_precisions_and_optimizers():
    n = 1000
    full = {"zero_stage": 0, "dp_shard": 1}
    assert model_state_bytes(n, precision="fp32", optimizer="adamw", **full) == {
        "params": 4000, "grads": 4000, "optim": 8000}  # the README's 16 bytes per parameter
    assert model_state_bytes(n, precision="fp32", optimizer="sgd", **full)["optim"] == 4000
    assert model_state_bytes(n, precision="mixed", optimizer="sgd", **full) == {
        "params": 2000, "grads": 2000, "optim": 8000}
    assert model_state_bytes(n, precision="bf16", optimizer="adamw", **full) == {
        "params": 2000, "grads": 2000, "optim": 4000}
    # DDP replicates whatever dp_shard says; each stage shards one more term.
    assert model_state_bytes(n, precision="fp32", optimizer="adamw", zero_stage=0, dp_shard=8) == {
        "params": 4000, "grads": 4000, "optim": 8000}
    assert model_state_bytes(n, precision="fp32", optimizer="adamw", zero_stage=1, dp_shard=8) == {
        "params": 4000, "grads": 4000, "optim": 1000}
    assert model_state_bytes(n, precision="fp32", optimizer="adamw", zero_stage=2, dp_shard=8) == {
        "params": 4000, "grads": 500, "optim": 1000}
    assert model_state_bytes(n, precision="fp32", optimizer="adamw", zero_stage=3, dp_shard=8) == {
        "params": 500, "grads": 500, "optim": 1000}


@pytest.mark.parametrize("kwargs, match", [
    ({"precision": "fp16"}, "valid precisions: fp32, mixed, bf16"),
    ({"optimizer": "lion"}, "valid optimizers: adamw, sgd"),
    ({"zero_stage": 4}, "0, 1, 2 or 3"),
    ({"dp_shard": 0}, "dp_shard"),
])
def test_model_state_rejects_bad_input(kwargs, match):
    args = {"precision": "mixed", "optimizer": "adamw", "zero_stage": 1, "dp_shard": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        model_state_bytes(100, **args)


# --- Activations: Korthikanti et al. 2022 ---------------------------------------------------------------

SHAPES = [
    # (s, b, h, a, t)
    (2048, 1, 12288, 96, 8),  # GPT-3 175B, as in the paper
    (2048, 1, 12288, 96, 1),
    (1024, 4, 1024, 16, 2),
    (2048, 2, 4096, 32, 4),
    (512, 8, 768, 12, 3),  # t that does not divide the constants 10, 24, 34
    (128, 3, 256, 8, 4),
]


def _closed_forms(s, b, h, a, t):
    # Table 2 of the paper, per layer, evaluated exactly.
    sbh, attn = Fraction(s * b * h), Fraction(5 * a * s, h)
    return {
        (False, "none"): sbh * (10 + Fraction(24, t) + attn / t),
        (True, "none"): sbh * (Fraction(34, t) + attn / t),
        (False, "selective"): sbh * (10 + Fraction(24, t)),
        (True, "selective"): sbh * Fraction(34, t),
        (False, "full"): 2 * sbh,
        (True, "full"): 2 * sbh / t,
    }


@pytest.mark.parametrize("s, b, h, a, t", SHAPES)
def test_korthikanti_closed_forms_exact(s, b, h, a, t):
    for (sp, recompute), expected in _closed_forms(s, b, h, a, t).items():
        got = activation_bytes_per_layer(s=s, b=b, h=h, a=a, t=t, sp=sp, recompute=recompute)
        assert got == float(expected), (sp, recompute)
        terms = activation_terms_per_layer(s=s, b=b, h=h, a=a, t=t, sp=sp, recompute=recompute)
        assert float(sum(Fraction(v) for v in terms.values())) == got
    # Without tensor parallelism: sbh(34 + 5as/h).
    got = activation_bytes_per_layer(s=s, b=b, h=h, a=a)
    assert got == float(Fraction(s * b * h) * (34 + Fraction(5 * a * s, h))) == 34 * s * b * h + 5 * a * s * s * b


def test_gpt3_175b_layer_in_bytes():
    # sbh·34/t with t = 8, SP and selective recompute: 2048·12288·34/8 bytes per layer.
    kw = {"s": 2048, "b": 1, "h": 12288, "a": 96, "t": 8}
    assert activation_bytes_per_layer(**kw, sp=True, recompute="selective") == 106_954_752
    # The attention core is the bulk without recompute: 5as²b/t = 251,658,240 bytes.
    assert activation_bytes_per_layer(**kw, sp=True) == 106_954_752 + 251_658_240


def test_per_tensor_terms():
    s, b, h, a = 128, 2, 256, 8
    sbh, core = s * b * h, a * s * s * b
    terms = activation_terms_per_layer(s=s, b=b, h=h, a=a)
    assert terms["attn.softmax_output"] == 2 * core and terms["attn.softmax_dropout_mask"] == core
    assert terms["mlp.gelu_input"] == 8 * sbh and terms["mlp.dropout_mask"] == sbh
    assert terms["ln1.input"] == terms["ln2.input"] == 2 * sbh
    # Tensor parallelism splits heads and the MLP width; SP also splits the norms, inputs and masks.
    tp = activation_terms_per_layer(s=s, b=b, h=h, a=a, t=4)
    assert tp["attn.q"] == 2 * sbh / 4 and tp["ln1.input"] == 2 * sbh and tp["attn.dropout_mask"] == sbh
    assert activation_terms_per_layer(s=s, b=b, h=h, a=a, t=4, sp=True)["ln1.input"] == 2 * sbh / 4
    assert activation_terms_per_layer(s=s, b=b, h=h, a=a, recompute="full") == {"layer_input": 2 * sbh}


@pytest.mark.parametrize("s, b, h, a, t", SHAPES)
@pytest.mark.parametrize("sp", [False, True])
def test_variants_move_the_right_way(s, b, h, a, t, sp):
    kw = {"s": s, "b": b, "h": h, "a": a, "t": t, "sp": sp}
    base = activation_bytes_per_layer(**kw)
    flash = activation_bytes_per_layer(**kw, attention="flash")
    no_dropout = activation_bytes_per_layer(**kw, dropout=False)
    fp32 = activation_bytes_per_layer(**kw, bytes_per_value=4)
    assert flash < base and no_dropout < base and fp32 > base
    # Flash keeps an fp32 log-sum-exp (4asb) instead of the 5as²b attention core.
    assert Fraction(flash) == Fraction(base) - Fraction(5 * a * s * s * b, t) + Fraction(4 * a * s * b, t)
    # One-byte masks: two residual ones (sbh each, split like the residual stream) and the attention one.
    masks = Fraction(2 * s * b * h, t if sp else 1) + Fraction(a * s * s * b, t)
    # No dropout: the masks and the dropped-out copy of the probabilities (2as²b) are gone.
    assert Fraction(no_dropout) == Fraction(base) - masks - Fraction(2 * a * s * s * b, t)
    # fp32 doubles every stored value; the masks stay one byte.
    assert Fraction(fp32) == 2 * Fraction(base) - masks
    full = activation_bytes_per_layer(**kw, recompute="full")
    selective = activation_bytes_per_layer(**kw, recompute="selective")
    assert full < selective < base
    # Selective recompute already drops the attention core, so flash changes nothing there.
    assert activation_bytes_per_layer(**kw, recompute="selective", attention="flash") == selective


@pytest.mark.parametrize("kwargs, match", [
    ({"recompute": "some"}, "none, selective, full"),
    ({"attention": "sdpa"}, "flash, eager"),
    ({"family": "t5"}, "gpt, llama"),
    ({"t": 0}, "t=0"),
    ({"bytes_per_value": 0}, "bytes_per_value"),
])
def test_activation_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        activation_bytes_per_layer(**({"s": 8, "b": 1, "h": 16, "a": 2} | kwargs))


# --- Hardware catalog --------------------------------------------------------------------------------

NAMES = ["A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200", "MI300X", "L40S", "RTX-4090"]


def test_catalog_entries():
    assert list(GPUS) == NAMES
    for name, gpu in GPUS.items():
        assert gpu.name == name
        assert gpu.bf16_flops > gpu.fp32_flops > 0 and gpu.hbm_bytes_per_s > 0
        # Inside a node is faster than the network for every part.
        assert gpu.intra_node_bytes_per_s > gpu.inter_node_bytes_per_s > 0
    h100 = get_gpu("H100-SXM")
    assert h100.memory_bytes == 80 * 2**30 and h100.bf16_flops == 989.4e12  # dense, not the 1,979 sparse
    assert h100.intra_node_bytes_per_s == 450e9  # 900 GB/s NVLink, one direction
    assert get_gpu("A100-80GB").bf16_flops == 312e12 and get_gpu("H200").memory_bytes == 141 * 2**30
    # PCIe cards talk over PCIe inside the node.
    assert get_gpu("L40S").intra_node_bytes_per_s == get_gpu("RTX-4090").intra_node_bytes_per_s == 32e9
    assert get_gpu("H100-PCIe").intra_node_bytes_per_s == 64e9
    with pytest.raises(FrozenInstanceError):
        h100.memory_bytes = 1  # type: ignore[misc]


def test_gpu_lookup_is_case_insensitive():
    assert get_gpu("h100-sxm") is get_gpu("H100-SXM") is get_gpu("H100_SXM") is get_gpu(" h100 sxm ")
    assert get_gpu("mi300x") is GPUS["MI300X"] and get_gpu("rtx-4090") is GPUS["RTX-4090"]


def test_unknown_gpu_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_gpu("V100")
    message = str(err.value)
    assert "'V100'" in message and "valid GPUs: " + ", ".join(NAMES) in message


def test_cluster():
    cluster = Cluster(get_gpu("H100-SXM"), nodes=4, gpus_per_node=8)
    assert cluster.world_size == 32 and cluster.gpu is GPUS["H100-SXM"]
    assert Cluster("b200", nodes=2).world_size == 16 and Cluster("b200").gpu is GPUS["B200"]
    with pytest.raises(ValueError, match="nodes"):
        Cluster(GPUS["L40S"], nodes=0)
    with pytest.raises(ValueError, match="valid GPUs"):
        Cluster("TPU-v5", nodes=1)


# --- Pipeline schedules ------------------------------------------------------------------------------


def test_gpipe_and_1f1b_in_flight():
    pp, m = 4, 8
    assert [pipeline_in_flight_microbatches("1f1b", pp, r, m) for r in range(pp)] == [4, 3, 2, 1]
    assert [pipeline_in_flight_microbatches("gpipe", pp, r, m) for r in range(pp)] == [8] * pp
    # Fewer micro-batches than stages: a stage cannot hold more than there are.
    assert [pipeline_in_flight_microbatches("1f1b", pp, r, 2) for r in range(pp)] == [2, 2, 2, 1]
    assert pipeline_in_flight_microbatches("1f1b", 1, 0, 5) == 1


@pytest.mark.parametrize("pp, v", [(2, 2), (4, 2), (4, 4), (8, 3)])
def test_interleaved_first_stage_matches_narayanan(pp, v):
    # (1 + (pp-1)/(pp·v))·pp micro-batches of a rank's layers = pp·v + pp - 1 micro-batch-stages.
    for m in (2 * pp, 3 * pp, 4 * pp):
        got = pipeline_in_flight_microbatches("interleaved-1f1b", pp, 0, m, virtual=v)
        assert Fraction(got, v) == (1 + Fraction(pp - 1, pp * v)) * pp
        last = pipeline_in_flight_microbatches("interleaved-1f1b", pp, pp - 1, m, virtual=v)
        assert last == got - 2 * (pp - 1)


def test_v_schedules_in_flight():
    # ZB-V: the same peak as 1F1B's first stage (pp micro-batches of a rank's two stages) on every rank.
    assert [pipeline_in_flight_microbatches("zbv", 4, r, 8, virtual=2) for r in range(4)] == [8] * 4
    assert [pipeline_in_flight_microbatches("zbv", 4, r, 4, virtual=2) for r in range(4)] == [5, 6, 7, 8]
    assert [pipeline_in_flight_microbatches("dualpipev", 4, r, 8, virtual=2) for r in range(4)] == [9] * 4
    assert pipeline_in_flight_microbatches("interleaved-zb", 4, 3, 8, virtual=2) == 8


@pytest.mark.parametrize("args, kwargs, match", [
    (("zero-bubble", 4, 0, 8), {}, "valid schedules"),
    (("1f1b", 4, 4, 8), {}, r"0\.\.3"),
    (("1f1b", 4, 0, 8), {"virtual": 2}, "one stage per rank"),
    (("zbv", 4, 0, 8), {}, "exactly 2"),
    (("interleaved-1f1b", 4, 0, 8), {}, "≥ 2"),
    (("interleaved-1f1b", 4, 0, 9), {"virtual": 2}, "multiple of 2"),
    (("dualpipev", 4, 0, 6), {"virtual": 2}, "at least 2 · pp = 8"),
])
def test_pipeline_rejects_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pipeline_in_flight_microbatches(*args, **kwargs)


def _torch_rank_ops(name, pp, m, v, rank):
    # Build only the op list torch's multi-stage schedules compute in __init__ (no process group).
    from torch.distributed.pipelining import schedules

    cls = {"interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
           "interleaved-zb": schedules.ScheduleInterleavedZeroBubble,
           "zbv": schedules.ScheduleZBVZeroBubble, "dualpipev": schedules.ScheduleDualPipeV}[name]
    sched = object.__new__(cls)
    rounds = max(1, m // pp)
    for key, value in {"pp_group_size": pp, "n_local_stages": v, "_n_microbatches": m, "rank": rank,
                       "number_of_rounds": rounds, "microbatches_per_round": m // rounds,
                       "num_stages": pp * v, "_num_stages": pp * v}.items():
        setattr(sched, key, value)
    return sched._calculate_single_rank_operations(rank)


def _peak_alive(ops):
    from torch.distributed.pipelining.schedules import _ComputationType as C

    live = peak = 0
    for op in ops:
        for act in (op.sub_actions if op is not None and op.computation_type == C.OVERLAP_F_B else [op]):
            if act is None:
                continue
            if act.computation_type == C.FORWARD:
                live += 1
                peak = max(peak, live)
            elif act.computation_type in (C.FULL_BACKWARD, C.BACKWARD_WEIGHT):
                live -= 1
    return peak


def test_multi_stage_counts_follow_torch_op_order():
    # Reads torch's private schedule op lists: if they move, this fails and the counts need re-checking.
    cases = [(name, pp, m, v) for pp in (2, 3, 4) for m in range(1, 4 * pp + 1)
             for name, vs in (("interleaved-1f1b", (2, 3)), ("interleaved-zb", (2, 3)), ("zbv", (2,)),
                              ("dualpipev", (2,)))
             for v in vs
             if not (name == "dualpipev" and m < 2 * pp) and not (name.startswith("inter") and m % max(1, m // pp))]
    for name, pp, m, v in cases:
        for rank in range(pp):
            torch_peak = _peak_alive(_torch_rank_ops(name, pp, m, v, rank))
            assert pipeline_in_flight_microbatches(name, pp, rank, m, virtual=v) == torch_peak, (name, pp, m, v, rank)


def test_rank_actions_follow_torch_op_order():
    # The order the pipelined ZeRO-3 phases walk: torch's interleaved 1F1B op list, stage by stage.
    from torch.distributed.pipelining.schedules import _ComputationType as C

    from meshfit.planner.memory.formulas import rank_actions

    for pp in (2, 3, 4, 8):
        for v in (2, 3, 4):
            for m in [m for m in range(1, 4 * pp + 1) if m % max(1, m // pp) == 0]:
                for rank in range(pp):
                    ops = [("F" if op.computation_type == C.FORWARD else "B", op.stage_index // pp)
                           for op in _torch_rank_ops("interleaved-1f1b", pp, m, v, rank) if op is not None]
                    assert list(rank_actions(pp, rank, m, v)) == ops, (pp, v, m, rank)


def test_rank_moments_walk_only_as_far_as_the_states_differ():
    # The planner walks a shortened order; its distinct moments must be those of the whole step's order.
    from meshfit.planner.memory.formulas import rank_actions
    from meshfit.planner.memory.phase_terms import rank_moments, walk_moments

    for pp in (2, 3, 4):
        for v in (1, 2, 3):
            for m in [m for m in range(1, 8 * pp + 1) if v == 1 or m % max(1, m // pp) == 0]:
                for rank in range(pp):
                    for warmup in ((None, 1, min(m, pp - rank)) if v == 1 else (None,)):
                        for loss in (None, v - 1):
                            whole = walk_moments(rank_actions(pp, rank, m, v, warmup), loss)
                            assert set(rank_moments(pp, rank, m, v, warmup, loss)) == set(whole), (pp, v, m, rank)


def test_rank_actions_one_stage_is_the_1f1b_shape():
    from meshfit.planner.memory.formulas import rank_actions

    assert rank_actions(4, 1, 5, 1, warmup=3) == (("F", 0),) * 3 + (("B", 0), ("F", 0)) * 2 + (("B", 0),) * 3
    # GPipe: every forward first.
    assert rank_actions(2, 0, 3, 1) == (("F", 0),) * 3 + (("B", 0),) * 3


def _split_frontier(ops):
    from torch.distributed.pipelining.schedules import _ComputationType as C

    waiting, split, states = set(), set(), {(0, 0)}
    # DualPipeV's overlapped forward + backward runs its forward, then its backward.
    ops = [sub for op in ops if op is not None for sub in (op.sub_actions or (op,))]
    for op in ops:
        key = (op.stage_index, op.microbatch_index)
        if op.computation_type == C.FORWARD:
            waiting.add(key)
        elif op.computation_type in (C.BACKWARD_INPUT, C.FULL_BACKWARD):
            waiting.discard(key)
            if op.computation_type == C.BACKWARD_INPUT:
                split.add(key)
        elif op.computation_type == C.BACKWARD_WEIGHT:
            split.discard(key)
        states.add((len(waiting), len(split)))
    return sorted(s for s in states if not any(o != s and o[0] >= s[0] and o[1] >= s[1] for o in states))


def test_zbv_split_backward_states_follow_torch_op_order():
    # The closed form against torch's op lists.
    from meshfit.planner.memory.formulas import split_backward_states

    for pp in range(1, 9):
        for m in range(1, 3 * pp + 1):
            for rank in range(pp):
                expected = _split_frontier(_torch_rank_ops("zbv", pp, m, 2, rank))
                got = split_backward_states(pp, rank, m)
                # The same heaviest state whenever a split micro-batch weighs at least a waiting one.
                for weight in (1, 1.5, 2, 4, 16):
                    assert max(k + weight * j for k, j in got) == max(k + weight * j for k, j in expected), \
                        (pp, m, rank, weight)


@pytest.mark.parametrize("schedule, virtuals, first_m", [("interleaved-zb", (2, 3, 4), 1), ("dualpipev", (2,), 2)])
def test_other_split_backward_states_follow_torch_op_order(schedule, virtuals, first_m):
    from meshfit.planner.memory.formulas import split_backward_states

    for pp in range(2, 6):
        for v in virtuals:
            for m in range(first_m * pp, 3 * pp + 1, pp):
                for rank in range(pp):
                    expected = _split_frontier(_torch_rank_ops(schedule, pp, m, v, rank))
                    assert sorted(split_backward_states(pp, rank, m, schedule, v)) == expected, (pp, v, m, rank)


def test_zbv_plans_import_no_torch():
    # The search offers zbv at every micro-batch count; its states are a closed form, not torch's order.
    import subprocess
    import sys

    code = ("import sys; from meshfit.models.presets import get_preset; "
            "from meshfit.planner.memory.estimate import estimate_memory; from meshfit.layout.layout import Layout, "
            "Workload; estimate_memory(get_preset('llama3-8b'), Layout(pp=4, schedule='zbv', virtual_stages=2), "
            "Workload(seq_len=2048, global_batch=5)); print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_cuda_device_names_map_to_the_catalog():
    # MFU on a real GPU reads the same datasheet peak the planner uses.
    from meshfit.hardware.catalog import gpu_for_device

    assert gpu_for_device("NVIDIA H100 80GB HBM3").name == "H100-SXM"
    assert gpu_for_device("NVIDIA H100 PCIe").name == "H100-PCIe"
    assert gpu_for_device("NVIDIA A100-SXM4-40GB").name == "A100-40GB"
    assert gpu_for_device("NVIDIA H200").bf16_flops == gpu_for_device("NVIDIA H100 80GB HBM3").bf16_flops
    assert gpu_for_device("Some other accelerator") is None


def test_cached_layer_activations_still_validate_after_an_equal_valid_call():
    from meshfit.planner.memory.formulas import activation_bytes_per_layer

    kw = dict(s=8, b=1, h=16, a=2)
    activation_bytes_per_layer(t=1, **kw)  # cached: an equal but invalid argument must not hit this entry
    with pytest.raises(ValueError):
        activation_bytes_per_layer(t=True, **kw)

