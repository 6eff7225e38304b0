"""Hardware profiles (`meshfit calibrate`, `meshfit plan --hardware`, `--gpu cpu`) and the time model on
measured rates: known answers, orderings, a calibration round trip on real ranks."""

import json
import math
import tempfile
from pathlib import Path

import pytest

from meshfit.commands.main import main
from meshfit.hardware.catalog import Cluster, cpu_device
from meshfit.hardware.profile import HardwareProfile, Link, load_profile, save_profile
from meshfit.layout.layout import Layout, Workload
from meshfit.models.config import flops_per_token, num_params
from meshfit.models.presets import get_preset
from meshfit.models.traffic import elementwise_traffic
from meshfit.planner.timing.comms import DDP_BUCKET_BYTES
from meshfit.planner.timing.estimate import step_time

TINY = get_preset("tiny")
WORK = Workload(seq_len=64, global_batch=8, precision="fp32")


def _profile(ar=1e9, ag=2e9, rs=0.5e9, latency=1e-4, flops=1e10, overlap=0.0, model=True, op_s=None
             ) -> HardwareProfile:
    """Measured rates; ``model``: the model's own training rate too (calibrate --model), which holds the
    element-wise work, so compute is the FLOPs at that rate alone."""
    links = {"all_reduce": Link(bus_bytes_per_s=ar, latency_s=latency),
             "all_gather": Link(bus_bytes_per_s=ag, latency_s=latency),
             "reduce_scatter": Link(bus_bytes_per_s=rs, latency_s=latency),
             "send_recv": Link(bus_bytes_per_s=ar, latency_s=latency)}
    return HardwareProfile(device="cpu", device_name="test", backend="gloo", ranks=2, threads_per_rank=1,
                           matmul_flops={"fp32": flops, "bf16": flops}, attention_flops={"fp32": flops, "bf16": flops},
                           elementwise_bytes_per_s=1e10, collectives={2: links}, overlap=overlap,
                           model_flops={"fp32": flops, "bf16": flops} if model else None, seq=64 if model else 0,
                           op_s={"fp32": op_s, "bf16": op_s} if op_s is not None else None)


def _time(layout: Layout, profile: HardwareProfile):
    return step_time(TINY, layout, WORK, Cluster(cpu_device(2**30, profile), nodes=1, gpus_per_node=2))


def test_profile_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "hw.json"
    save_profile(_profile(), path)
    assert load_profile(path) == _profile()
    doc = json.loads(path.read_text())
    doc["collectives"]["2"]["all_gather"]["bus_bytes_per_s"] = -1
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"hw.json: collectives.2.all_gather.bus_bytes_per_s: .*greater than 0"):
        load_profile(path)
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a meshfit hardware profile.*meshfit calibrate"):
        load_profile(path)


def test_known_answer_compute_and_collectives_on_measured_rates():
    # Compute at the measured rate (no efficiency factor); DDP all-reduces the fp32 gradients in buckets,
    # a ring over 2 ranks: 2 · ((n−1)/n · bytes / bus bandwidth + calls · latency · (n−1)).
    ddp = _time(Layout(dp_replicate=2), _profile())
    tokens = WORK.global_batch // 2 * WORK.seq_len
    assert ddp.compute_s == pytest.approx(tokens * flops_per_token(TINY, WORK.seq_len) / 1e10)
    grads = num_params(TINY) * 4
    calls = math.ceil(grads / DDP_BUCKET_BYTES)
    assert ddp.dp_comm_s == pytest.approx(2 * (0.5 * grads / 1e9 + calls * 1e-4))
    # ZeRO-3 gathers with all-gather's rate and reduces with reduce-scatter's: one call per block and the
    # root, twice per micro-batch for the gathers (forward, backward), once for the reductions.
    z3 = _time(Layout(dp_shard=2, zero_stage=3, micro_batch=4), _profile())
    units = TINY.n_layers + 1
    gather = 0.5 * num_params(TINY) * 4 / 2e9 + units * 1e-4
    reduce = 0.5 * num_params(TINY) * 4 / 0.5e9 + units * 1e-4
    assert z3.dp_comm_s == pytest.approx(2 * gather + reduce)


def test_a_measured_tensor_parallel_rate_replaces_the_split_compute_and_its_collectives():
    # Without a measured rate: 1/t of the FLOPs at the model's rate plus the modelled all-reduces.
    modelled = _time(Layout(tp=2), _profile())
    tokens = WORK.global_batch * WORK.seq_len
    fpt = flops_per_token(TINY, WORK.seq_len)
    assert modelled.compute_s == pytest.approx(tokens * fpt / 2 / 1e10) and modelled.tp_comm_s > 0
    # With one (collectives inside it): the same FLOPs at the measured rate plus the fixed cost per block and
    # micro-batch, no collectives on top; the variant follows the layout's sequence parallelism, other
    # degrees and layouts keep the model.
    def measured(flops: float, call_s: float) -> dict:
        return {"flops": {"fp32": flops, "bf16": flops}, "block_call_s": {"fp32": call_s, "bf16": call_s}}

    rates = {2: {"plain": measured(4e9, 0.0), "sp": measured(5e9, 1e-3)}}
    profile = HardwareProfile.model_validate({**_profile().model_dump(), "tp_flops": rates})
    plain = _time(Layout(tp=2), profile)
    sp = _time(Layout(tp=2, sp=True, loss_parallel=True, micro_batch=2), profile)
    assert plain.compute_s == pytest.approx(tokens * fpt / 2 / 4e9) and plain.tp_comm_s == 0
    calls = TINY.n_layers * WORK.global_batch // 2  # blocks × micro-batches
    assert sp.compute_s == pytest.approx(tokens * fpt / 2 / 5e9 + calls * 1e-3) and sp.tp_comm_s == 0
    assert plain.total_s > modelled.total_s  # 4e9 per rank is slower than 1e10 plus the modelled comm
    assert _time(Layout(dp_replicate=2), profile).compute_s == pytest.approx(
        _time(Layout(dp_replicate=2), _profile()).compute_s)
    # Full recompute re-runs each block's forward: a third more of the fixed cost, as of the FLOPs.
    full = _time(Layout(tp=2, sp=True, loss_parallel=True, micro_batch=2, activation_checkpointing="full"),
                 profile)
    assert full.compute_s - full.recompute_s == pytest.approx(sp.compute_s)
    free = HardwareProfile.model_validate({**_profile().model_dump(), "tp_flops": {2: {"sp": measured(5e9, 0.0)}}})
    no_fixed = _time(Layout(tp=2, sp=True, loss_parallel=True, micro_batch=2, activation_checkpointing="full"),
                     free)
    assert full.recompute_s - no_fixed.recompute_s == pytest.approx(calls * 1e-3 / 3)
    # Measured with sequence and loss parallelism together: one without the other takes the measurement of
    # its sequence parallelism, plus (loss parallelism off) or minus (on) what loss parallelism changes at
    # the head: the gathered logits and the loss over the whole vocabulary, the same amount either way.
    sp_only = _time(Layout(tp=2, sp=True, micro_batch=2), profile)
    lp_only = _time(Layout(tp=2, loss_parallel=True, micro_batch=2), profile)
    plain2 = _time(Layout(tp=2, micro_batch=2), profile)
    assert sp_only.tp_comm_s == lp_only.tp_comm_s == 0
    added, saved = sp_only.compute_s - sp.compute_s, plain2.compute_s - lp_only.compute_s
    assert added > 0 and added == pytest.approx(saved)


def test_matmul_rates_alone_add_the_elementwise_traffic_at_the_measured_bandwidth():
    # Without the model's own rate, compute is the FLOPs at the matmul rate plus the element-wise bytes at
    # the measured element-wise rate (fp32 values: 4 bytes).
    t = elementwise_traffic(TINY, 4)
    tokens = WORK.global_batch // 2 * WORK.seq_len
    ddp = _time(Layout(dp_replicate=2), _profile(model=False))
    moved = TINY.n_layers * t.block + t.embed + t.final_norm + t.vocab
    assert ddp.compute_s == pytest.approx(tokens * flops_per_token(TINY, WORK.seq_len) / 1e10 + tokens * moved / 1e10)
    assert ddp.compute_s > _time(Layout(dp_replicate=2), _profile()).compute_s
    # A tensor-parallel rate measured on the model holds its element-wise work too.
    tp_rates = {2: {"sp": {"flops": {"fp32": 1e10, "bf16": 1e10}, "block_call_s": {"fp32": 0.0, "bf16": 0.0}}}}
    tp_only = HardwareProfile.model_validate({**_profile(model=False).model_dump(), "tp_flops": tp_rates})
    sp = _time(Layout(tp=2, sp=True, loss_parallel=True), tp_only)
    assert sp.elementwise_s == 0.0 and sp.compute_s == pytest.approx(WORK.tokens * flops_per_token(TINY, 64) / 2 / 1e10)


def test_measured_rates_order_layouts_and_overlap_hides_communication():
    slow, fast = _profile(ar=1e8, ag=1e8, rs=1e8), _profile(ar=1e10, ag=1e10, rs=1e10)
    for layout in (Layout(dp_replicate=2), Layout(dp_shard=2, zero_stage=3), Layout(tp=2)):
        assert _time(layout, fast).total_s < _time(layout, slow).total_s, layout
    assert _time(Layout(dp_replicate=2), _profile(flops=2e10)).compute_s == pytest.approx(
        _time(Layout(dp_replicate=2), _profile()).compute_s / 2)
    hidden = _time(Layout(dp_shard=2, zero_stage=3), _profile(overlap=1.0))
    assert hidden.dp_comm_s < _time(Layout(dp_shard=2, zero_stage=3), _profile()).dp_comm_s


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_calibrate_then_plan_cpu_ranks(tmp_path, capsys, monkeypatch):
    from meshfit.calibrate.message_sizes import layout_messages
    from meshfit.planner.timing.op_count import op_counts

    # The compiled block's launches: one inductor cache with tests/test_compile.py (a warm one compiles nothing).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "meshfit-tests-inductor"))
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--nproc", "2", "--quick", "--model", "tiny", "--seq-len", "64", "--out", str(out)]) == 0
    profile = load_profile(out)
    assert profile.device == "cpu" and profile.backend == "gloo" and profile.ranks == 2
    assert set(profile.collectives) == {2} and profile.model_flops.fp32 > 0 and profile.seq == 64
    assert 0 < profile.op_s.fp32 < 1e-2 and not profile.lacks()
    # Every collective timed at tiny's layouts' message sizes (activations of 1 and 8 sequences of 64 tokens,
    # one block's parameters), in fp32 and bf16 bytes.
    sizes = layout_messages(TINY, 64)
    assert sizes["send_recv"] == [64 * 64 * v * b for v, b in ((2, 1), (4, 1), (2, 8), (4, 8))]
    assert {op: sorted(t) for op, t in profile.collective_times[2].items()} == sizes
    assert all(0 < s < 1.0 for t in profile.collective_times[2].values() for s in t.values())
    # --quick compiles one policy: launches of one block, forward + backward, against its eager heavy operators.
    assert set(profile.compiled_launches) == {"none"}
    counted = profile.compiled_launches["none"]
    assert counted.heavy == op_counts(TINY, "none").block_heavy and counted.heavy < counted.launches < 3 * counted.heavy
    # tiny's 4 heads split over 2 ranks: tensor parallelism measured, with and without sequence parallelism.
    assert set(profile.tp_flops) == {2} and set(profile.tp_flops[2]) == {"plain", "sp"}
    assert 0 < profile.tp_flops[2]["plain"].flops.fp32 < 10 * profile.model_flops.fp32
    assert profile.tp_flops[2]["sp"].block_call_s.fp32 >= 0
    capsys.readouterr()
    assert main(["plan", "--model", "tiny", "--gpu", "cpu", "--gpu-memory", "80MiB", "--gpus-per-node", "2",
                 "--hardware", str(out), "--seq-len", "64", "--global-batch", "8", "--precision", "fp32",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["cluster"]["gpu"] == "cpu" and plan["cluster"]["usable_bytes"] == 80 * 2**20
    assert plan["cluster"]["rates"] == "measured"
    assert plan["candidates"] and not any(c["layout"]["offload"] for c in plan["candidates"])
    # Refused: an existing --out, a CPU plan without its budget, datasheet overrides next to --hardware.
    assert main(["calibrate", "--nproc", "2", "--out", str(out)]) == 2
    assert main(["plan", "--model", "tiny", "--gpu", "cpu", "--hardware", str(out)]) == 2
    assert main(["plan", "--model", "tiny", "--hardware", str(out), "--gpu-memory", "1GiB",
                 "--gpu-tflops", "100"]) == 2
    assert main(["plan", "--model", "tiny", "--hardware", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert "exists: replace it with --overwrite" in err and "--gpu-memory, e.g. --gpu-memory 80MiB" in err
    assert "--gpu-tflops overrides a datasheet figure" in err and "none.json: no such hardware profile" in err
    assert "Traceback" not in err


def test_profiles_that_do_not_match_the_flags_are_refused(tmp_path, capsys):
    cpu, one_rank = tmp_path / "cpu.json", tmp_path / "one.json"
    save_profile(_profile(), cpu)
    save_profile(_profile().model_copy(update={"collectives": {}, "ranks": 1}), one_rank)
    base = ["plan", "--model", "tiny", "--seq-len", "64", "--global-batch", "8", "--gpus-per-node", "2"]
    assert main([*base, "--hardware", str(cpu), "--gpu", "A100-80GB"]) == 2
    assert main([*base, "--hardware", str(one_rank), "--gpu", "cpu", "--gpu-memory", "80MiB"]) == 2
    assert main([*base, "--gpu", "cpu", "--gpu-memory", "80MiB", "--gpu-tflops", "10"]) == 2
    assert main(["calibrate", "--seq-len", "64"]) == 2
    err = capsys.readouterr().err
    assert "measured on CPU ranks: it plans --gpu cpu, not --gpu A100-80GB" in err
    assert "calibrated on one rank" in err and "--gpu-tflops overrides a catalog GPU's datasheet" in err
    assert "--seq-len is the sequence length of --model's measurement" in err and "Traceback" not in err
    # A CPU profile alone means CPU ranks (no --gpu needed); verify needs no rates, so no calibration.
    assert main([*base, "--hardware", str(cpu), "--gpu-memory", "80MiB", "--precision", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"]["gpu"] == "cpu"


def test_a_calibrated_overlap_hides_that_share_of_the_communication():
    # calibrate measures the share of a collective that concurrent compute hides: with compute far longer
    # than the collectives, an overlap of 0.25 leaves three quarters of them exposed (not none of them).
    for layout in (Layout(dp_replicate=2), Layout(dp_shard=2, zero_stage=3)):
        exposed, quarter = _time(layout, _profile(overlap=0.0)), _time(layout, _profile(overlap=0.25))
        assert exposed.dp_comm_s < exposed.compute_s / 2, layout
        assert quarter.dp_comm_s == pytest.approx(0.75 * exposed.dp_comm_s), layout


def test_a_profile_without_the_operator_cost_loads_and_says_what_it_lacks(tmp_path):
    path = tmp_path / "hw.json"
    save_profile(_profile(op_s=2e-5), path)
    assert load_profile(path).op_s.fp32 == 2e-5
    doc = json.loads(path.read_text())
    del doc["op_s"]  # as written before the cost per operator was measured
    path.write_text(json.dumps(doc))
    old = load_profile(path)
    assert old.op_s is None and old.op_seconds("mixed") is None
    assert [w.split(" (")[0] for w in old.lacks()] == ["the cost per dispatched operator", "tensor-parallel rates",
                                                      "collectives timed at the layouts' message sizes"]
    kernels = _profile(model=False)
    assert any("model's own training rate" in w for w in kernels.lacks())


def test_the_operator_cost_is_counted_operators_times_the_measured_cost_per_micro_batch():
    from meshfit.planner.timing.op_count import rank_ops

    plain = _time(Layout(dp_replicate=2, micro_batch=1), _profile())
    for mb in (1, 4):
        t = _time(Layout(dp_replicate=2, micro_batch=mb), _profile(op_s=1e-4))
        m = WORK.global_batch // 2 // mb
        assert t.operators_s == pytest.approx(m * rank_ops(TINY, "none", TINY.n_layers, True, False) * 1e-4)
        assert t.compute_s == pytest.approx(plain.compute_s + t.operators_s)
    # Recompute re-runs operators: the extra ones are recompute; a measured tensor-parallel rate holds its own.
    full = _time(Layout(dp_replicate=2, activation_checkpointing="full"), _profile(op_s=1e-4))
    ops = rank_ops(TINY, "full", TINY.n_layers, True, False) - rank_ops(TINY, "none", TINY.n_layers, True, False)
    assert full.recompute_s - _time(Layout(dp_replicate=2, activation_checkpointing="full"), _profile()).recompute_s \
        == pytest.approx(WORK.global_batch // 2 * ops * 1e-4)  # micro-batches of 1
    assert _time(Layout(dp_replicate=2), _profile(op_s=None)).operators_s == 0.0


def test_plan_says_what_times_rest_on_and_which_it_cannot_order():
    from meshfit.hardware.catalog import get_gpu
    from meshfit.planner.timing.basis import DATASHEET_ERROR, MODEL_CALIBRATED_ERROR, close_runs, time_basis

    assert time_basis(get_gpu("H100-SXM")).error == DATASHEET_ERROR
    assert "datasheet" in time_basis(get_gpu("H100-SXM")).label
    calibrated = time_basis(cpu_device(2**30, _profile(op_s=1e-5)))
    assert calibrated.error == MODEL_CALIBRATED_ERROR and calibrated.lacks[0] == "tensor-parallel rates"
    assert calibrated.lacks[1].startswith("collectives timed at the layouts' message sizes")
    assert close_runs([1.0, 1.1, 1.2, 2.0, 2.1, 5.0], 0.25) == [(0, 2), (3, 4)]
    assert close_runs([1.0, 1.5, 2.5], 0.25) == []


def test_the_fixed_part_and_the_rate_split_through_a_short_and_a_full_step():
    from meshfit.calibrate.tensor_parallel import split_fixed

    # t = 10 ms + FLOPs / 10 GFLOP/s at 1e8 and 1e10 FLOPs.
    rate, fixed = split_fixed((0.01 + 1e8 / 1e10, 1e8), (0.01 + 1e10 / 1e10, 1e10))
    assert rate == pytest.approx(1e10) and fixed == pytest.approx(0.01)
    # Noise that makes the full step no slower, or the line cross below zero: all of it is rate.
    assert split_fixed((2.0, 1e8), (1.0, 1e10)) == (1e10, 0.0)
    assert split_fixed((0.001, 1e8), (1.0, 1e10)) == (1e10, 0.0)
