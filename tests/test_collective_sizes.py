"""Collectives timed at the layouts' message sizes and compiled blocks' counted launches: the interpolation,
the profile that holds them (old ones still load), the time model's use of them, and what `plan` says."""

import json
import math

import pytest

from meshfit.hardware.catalog import Cluster, cpu_device
from meshfit.hardware.profile import HardwareProfile, Link, load_profile, save_profile
from meshfit.layout.layout import Layout, Workload
from meshfit.models.config import num_params
from meshfit.models.presets import get_preset
from meshfit.planner.timing.basis import time_basis
from meshfit.planner.timing.comms import along_points
from meshfit.planner.timing.estimate import step_time
from meshfit.planner.timing.op_count import COMPILED_PER_HEAVY, op_counts, rank_ops

TINY = get_preset("tiny")
WORK = Workload(seq_len=64, global_batch=8, precision="fp32")


def line(b: float) -> float:  # 100 µs + bytes at 1 GB/s
    return 1e-4 + b / 1e9


def test_between_measured_sizes_log_linear_beyond_them_the_line_through_the_end_point():
    points = {1000: 1e-3, 100_000: 1e-1}
    assert along_points(points, 1000, line) == pytest.approx(1e-3)
    assert along_points(points, 100_000, line) == pytest.approx(1e-1)
    # Halfway in log(bytes) is halfway in log(seconds): the geometric mean.
    assert along_points(points, 10_000, line) == pytest.approx(1e-2)
    # Above the largest: that point plus what the line adds from there (its bandwidth, measured at a larger size
    # still); below the smallest: the line scaled to meet that point.
    assert along_points(points, 1_000_000, line) == pytest.approx(1e-1 + (1e6 - 1e5) / 1e9)
    assert along_points(points, 10, line) == pytest.approx(1e-3 * line(10) / line(1000))
    # No points: the line itself.
    assert along_points({}, 5000, line) == pytest.approx(line(5000))


def test_a_slow_repetition_at_a_smaller_size_does_not_make_it_dearer_than_a_larger_one():
    # 2000 bytes measured slower than 4000 (a busy host): it takes the larger message's time.
    points = {1000: 1e-4, 2000: 5e-3, 4000: 4e-4}
    assert along_points(points, 2000, line) == pytest.approx(4e-4)
    assert along_points(points, 3000, line) == pytest.approx(4e-4)
    w = math.log(1.5) / math.log(2)  # 1500 bytes: between 1000 and 2000 (now 4e-4) in log-log
    assert along_points(points, 1500, line) == pytest.approx(1e-4 ** (1 - w) * 4e-4 ** w)
    times = [along_points(points, 1000 * 1.1 ** k, line) for k in range(40)]
    assert all(b >= a * (1 - 1e-12) for a, b in zip(times, times[1:]))  # never falls as messages grow


def _profile(times: dict | None = None, launches: dict | None = None, op_s: float | None = None) -> HardwareProfile:
    link = Link(bus_bytes_per_s=1e9, latency_s=1e-4)
    return HardwareProfile(
        device="cpu", device_name="test", backend="gloo", ranks=2, threads_per_rank=1,
        matmul_flops={"fp32": 1e10, "bf16": 1e10}, attention_flops={"fp32": 1e10, "bf16": 1e10},
        model_flops={"fp32": 1e10, "bf16": 1e10}, seq=64, elementwise_bytes_per_s=1e10,
        collectives={2: {op: link for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")}},
        collective_times=times or {}, compiled_launches=launches or {},
        op_s={"fp32": op_s, "bf16": op_s} if op_s is not None else None)


def _time(layout: Layout, profile: HardwareProfile, work: Workload = WORK):
    return step_time(TINY, layout, work, Cluster(cpu_device(2**30, profile), nodes=1, gpus_per_node=2))


def test_profile_round_trip_and_a_profile_from_before_the_sizes_loads(tmp_path):
    path = tmp_path / "hw.json"
    prof = _profile({2: {"all_gather": {65536: 2e-4, 1 << 20: 1e-3}}},
                    {"none": {"launches": 34, "heavy": 23}, "full": {"launches": 45, "heavy": 30}})
    save_profile(prof, path)
    loaded = load_profile(path)
    assert loaded == prof and loaded.collective_times[2]["all_gather"][65536] == 2e-4
    assert loaded.launches_per_heavy() == {"none": pytest.approx(34 / 23), "full": pytest.approx(1.5)}
    doc = json.loads(path.read_text())
    assert doc["collective_times"]["2"]["all_gather"]["65536"] == 2e-4  # JSON keys: group size, then bytes
    for key in ("collective_times", "compiled_launches"):  # as written before they were measured
        del doc[key]
    path.write_text(json.dumps(doc))
    old = load_profile(path)
    assert old.collective_times == {} and old.compiled_launches == {}
    assert old.measured_sizes(2, "all_gather") == (2, {})
    doc["collective_times"] = {"2": {"broadcast": {"10": 1.0}}}
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"hw.json: collective_times.2.broadcast"):
        load_profile(path)


def test_the_time_model_takes_a_collective_s_time_from_the_measured_sizes():
    # Every size between 1 byte and 1 TB measured at one time T: each call then costs T, whatever the line says.
    flat = {1: 3e-3, 10**12: 3e-3}
    ops = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
    prof = _profile({2: {op: flat for op in ops}})
    units = TINY.n_layers + 1  # FSDP's calls per gather: one per block and the root
    z3 = _time(Layout(dp_shard=2, zero_stage=3, micro_batch=4), prof)
    assert z3.dp_comm_s == pytest.approx(2 * units * 3e-3 + units * 3e-3)  # gathers in fwd and bwd, one reduction
    # Tensor parallelism: 4 all-reduces per block, the embedding's and the head's, per micro-batch; the logits'
    # gather (no loss parallelism) is one more call.
    tp = _time(Layout(tp=2, micro_batch=8), prof)
    assert tp.tp_comm_s == pytest.approx((4 * TINY.n_layers + 2) * 3e-3 + 3e-3)
    # Pipeline: each micro-batch's activation forward and its gradient back.
    pp = _time(Layout(pp=2, micro_batch=2), prof)
    assert pp.pp_comm_s == pytest.approx(2 * 4 * 3e-3)
    # Without measured sizes the line: per call bytes / bus bandwidth (× ring factor) + latency per hop.
    line_z3 = _time(Layout(dp_shard=2, zero_stage=3, micro_batch=4), _profile())
    per_unit = num_params(TINY) * 4 / units
    assert line_z3.dp_comm_s == pytest.approx(3 * units * (0.5 * per_unit / 1e9 + 1e-4))


def test_a_group_size_not_measured_scales_the_measured_times_by_the_lines():
    from meshfit.planner.timing.comms import collective_s, ring_terms

    prof = _profile({2: {"all_gather": {1000: 2e-4, 10**7: 2e-3}}})  # 10**5 halfway in log
    cluster = Cluster(cpu_device(2**30, prof), nodes=1, gpus_per_node=4)
    at_two = collective_s(cluster, "all_gather", 1, 2, 10**5)
    assert at_two == pytest.approx(math.sqrt(2e-4 * 2e-3))

    def ring_line(n: int) -> float:
        moved, hops = ring_terms("all_gather", n)
        return moved * 10**5 / 1e9 + hops * 1e-4

    assert collective_s(cluster, "all_gather", 1, 4, 10**5) == pytest.approx(at_two * ring_line(4) / ring_line(2))


def test_counted_launches_replace_the_assumed_two_per_heavy_operator():
    heavy = op_counts(TINY, "none").block_heavy
    assumed = rank_ops(TINY, "none", 2, True, True)
    assert assumed == pytest.approx(2 * heavy * COMPILED_PER_HEAVY + op_counts(TINY, "none").rest)
    counted = rank_ops(TINY, "none", 2, True, True, {"none": 1.5})
    assert counted == pytest.approx(2 * heavy * 1.5 + op_counts(TINY, "none").rest)
    # A policy not counted takes "none"'s ratio; eager blocks ignore it.
    full_heavy = op_counts(TINY, "full").block_heavy
    assert rank_ops(TINY, "full", 1, False, True, {"none": 1.5}) == pytest.approx(full_heavy * 1.5)
    assert rank_ops(TINY, "full", 1, False, False, {"none": 1.5}) == op_counts(TINY, "full").block
    # In the step time: the operators' seconds of a compiled workload follow the counted ratio.
    compiled = Workload(seq_len=64, global_batch=8, precision="fp32", compiled=True)
    launches = {"none": {"launches": 3 * heavy, "heavy": heavy}}  # 3 per heavy operator
    with_count = _time(Layout(dp_replicate=2), _profile(launches=launches, op_s=1e-4), compiled)
    without = _time(Layout(dp_replicate=2), _profile(op_s=1e-4), compiled)
    rest = op_counts(TINY, "none").rest * 1e-4 * 4  # 4 micro-batches of one sequence
    assert with_count.operators_s - rest == pytest.approx(1.5 * (without.operators_s - rest))


def test_plan_says_whether_collectives_and_compiled_launches_are_measured():
    bare = time_basis(cpu_device(2**30, _profile(op_s=1e-5)), compiled=True)
    assert any(w.startswith("collectives timed at the layouts' message sizes (a bandwidth/latency line")
               for w in bare.lacks)
    assert any(w.startswith("a counted launch count of compiled blocks (2 per") for w in bare.lacks)
    assert bare.rests_on == ()
    measured = _profile({2: {"all_gather": {65536: 2e-4, 1 << 20: 1e-3}}}, {"none": {"launches": 34, "heavy": 23}},
                        op_s=1e-5)
    basis = time_basis(cpu_device(2**30, measured), compiled=True)
    assert basis.rests_on == ("collectives timed at the calibrated model's message sizes (64.0 KiB–1.0 MiB, "
                              "interpolated; the bandwidth/latency line beyond them)",
                              "compiled blocks' kernel launches as counted (1.48 per matmul/attention operator)")
    assert not any("collectives" in w or "launch" in w for w in basis.lacks)
    assert time_basis(cpu_device(2**30, measured)).rests_on == basis.rests_on[:1]  # eager: launches not named


def test_launches_are_counted_in_generated_code():
    from meshfit.calibrate.compiled_launches import count_launches

    source = '''
cpp_fused_add_0 = async_compile.cpp_pybinding(['const float*'], r\'\'\'
extern "C" void kernel(const float* in_ptr0) { for(int x0=0; x0<4; x0++) { tmp0 = in_ptr0[x0]; } }
\'\'\')
triton_poi_fused_1 = async_compile.triton('triton_poi_fused_1', \'\'\'
def triton_poi_fused_1(in_ptr0): tl.load(in_ptr0)
\'\'\')
def call(self, args):
        primals_1, = args
        buf0 = empty_strided_cpu((4, ), (1, ), torch.float32)
        cpp_fused_add_0(primals_1, buf0)
        extern_kernels.mm(reinterpret_tensor(buf0, (2, 2), (2, 1), 0), primals_1, out=buf1)
        buf2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf1, buf1, buf1, 0.0, True)
        triton_poi_fused_1.run(buf1, stream=stream0)
        del buf0
        return (buf2, )
'''
    assert count_launches(source) == 4
