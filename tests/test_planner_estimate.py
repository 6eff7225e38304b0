"""The planner's memory model against torch's memory tracker on meshfit's real blocks and real runs."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from meshfit.layout.layout import Layout, Workload
from meshfit.models import build_model
from meshfit.models.config import ModelConfig
from meshfit.models.presets import get_preset
from meshfit.planner.memory.activations import block_activation_bytes, block_weight_params
from meshfit.planner.memory.estimate import estimate_memory


def _tracked_forward_bytes(cfg: ModelConfig, mode: str, batch: int, seq: int) -> int:
    """Activation bytes torch's tracker counts at the end of a forward of ``cfg`` (real CPU tensors)."""
    model = build_model(cfg, "cpu")
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(tokens)
        snap = next(iter(tracker.get_tracker_snapshot().values()))
    return sum(v for k, v in snap.items() if str(k).endswith(("ACT", "TEMP")))


@pytest.mark.parametrize("family, variant", [("llama", {}), ("gpt", {}), ("llama", {"qkv_bias": True}),
                                             ("llama", {"qk_norm": True, "head_dim": 48})],
                         ids=["llama", "gpt", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_block_activations_match_what_torch_tracks(family, variant, mode):
    # The difference between a 3- and a 2-block model is exactly one block's saved tensors.
    base = dict(family=family, dim=128, n_heads=4, n_kv_heads=2 if family == "llama" else 4, vocab_size=512,
                ffn_hidden=352, max_seq_len=64, tie_embeddings=False, **variant)
    batch, seq = 2, 64
    measured = (_tracked_forward_bytes(ModelConfig(n_layers=3, **base), mode, batch, seq)
                - _tracked_forward_bytes(ModelConfig(n_layers=2, **base), mode, batch, seq))
    predicted = block_activation_bytes(ModelConfig(n_layers=3, **base), mode=mode, seq=seq, batch=batch)
    assert predicted == pytest.approx(measured, rel=0.01)


def _train_peak(tmp_path, sets: list[str]) -> dict:
    """Steady-state (step ≥ 2) peak breakdown of a real one-process training run."""
    args = [sys.executable, "-m", "meshfit", "train", "--run-dir", str(tmp_path), "--set", "train.steps=3",
            "--set", "train.device=cpu"]
    for item in sets:
        args += ["--set", item]
    res = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return max((m for r in records if r["step"] >= 2 for m in r["mem"]), key=lambda m: m["peak"])


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("micro_batch", [1, 4])
def test_single_rank_prediction_matches_a_real_run(tmp_path, micro_batch):
    # fp32 on one CPU rank: micro-batch 1 accumulates gradients over 4 forwards, micro-batch 4 runs once.
    layout = Layout(micro_batch=micro_batch)
    workload = Workload(seq_len=128, global_batch=4, precision="fp32")
    predicted = estimate_memory(get_preset("small"), layout, workload).as_dict()
    measured = _train_peak(tmp_path, ["model.preset=small", "train.seq_len=128", "train.global_batch=4",
                                      f"train.micro_batch={micro_batch}"])
    assert predicted["total"] == pytest.approx(measured["peak"], rel=0.03)
    # Weights and optimizer states are exact; which gradients exist depends on where in backward the peak
    # falls (two phases within a few percent of each other here).
    for key in ("params", "optim"):
        assert predicted[key] == pytest.approx(measured[key], rel=0.01, abs=1024)


def test_sharding_and_splitting_shrink_the_most_loaded_rank():
    # Two micro-batches per rank: gradients of the first are held while the second runs forward.
    model, wl = get_preset("llama3-8b"), Workload(seq_len=4096, global_batch=128)
    ddp = estimate_memory(model, Layout(dp_replicate=64), wl)
    zero = [estimate_memory(model, Layout(dp_shard=64, zero_stage=s), wl) for s in (1, 2, 3)]
    # Every stage shards the optimizer states evenly, element by element (the embedding included).
    for z in zero:
        assert ddp.optim == pytest.approx(64 * z.optim, rel=1e-6)
    # ZeRO-1 holds full 16-bit gradients until the last micro-batch; ZeRO-2 reduces them after each;
    # ZeRO-3 also gathers only two blocks at a time.
    assert zero[1].grads < zero[0].grads and zero[2].params < zero[1].params == zero[0].params
    assert ddp.total > zero[0].total > zero[1].total > zero[2].total
    full = estimate_memory(model, Layout(dp_shard=64, zero_stage=3, activation_checkpointing="full"), wl)
    assert full.activations < zero[2].activations / 3  # the 128k-vocabulary logits stay
    tp = estimate_memory(model, Layout(dp_shard=8, tp=8, zero_stage=3), wl)
    tp_sp = estimate_memory(model, Layout(dp_shard=8, tp=8, zero_stage=3, sp=True, loss_parallel=True), wl)
    assert tp_sp.activations < tp.activations < zero[2].activations
    # GPipe keeps every micro-batch in flight; 1F1B at most pp of them.
    gpipe = estimate_memory(model, Layout(dp_shard=16, pp=4, zero_stage=3, schedule="gpipe"), wl)
    one_f = estimate_memory(model, Layout(dp_shard=16, pp=4, zero_stage=3, schedule="1f1b"), wl)
    assert gpipe.activations > one_f.activations and one_f.pp_rank == 0
    # Offload takes the sharded states off the device.
    off = estimate_memory(model, Layout(dp_shard=64, zero_stage=3, offload=True), wl)
    assert off.optim == 0 and off.grads < zero[2].grads
    # On gloo a later micro-batch's reduced shard waits while the next block's backward runs; offloaded, it
    # waits in host memory (a real 2-rank ZeRO-3 + offload run on gloo holds no gradient shard there).
    small = Workload(seq_len=128, global_batch=8, precision="fp32")
    for offload, held in ((False, True), (True, False)):
        cpu = estimate_memory(get_preset("small"), Layout(dp_shard=2, zero_stage=3, offload=offload), small, "gloo")
        assert cpu.phase == "reduce in flight" and (cpu.grads > 0) == held


def test_a_bigger_local_batch_only_adds_activations():
    model, wl = get_preset("llama3-8b"), Workload(seq_len=4096, global_batch=64)
    one, two, four = (estimate_memory(model, Layout(dp_replicate=8, micro_batch=b), wl) for b in (1, 2, 4))
    assert one.at_rest_dict() == two.at_rest_dict() == four.at_rest_dict()
    assert one.total < two.total < four.total
    # From two sequences on, the peak is at the loss, where the 16-bit weight copies are gone: every extra
    # sequence adds the same activations and nothing else.
    assert (two.params, two.grads, two.optim, two.phase) == (four.params, four.grads, four.optim, "loss")
    assert four.activations == pytest.approx(2 * two.activations, rel=1e-9)


def _gpt(dim: int, n_layers: int, n_heads: int, tied: bool = True) -> ModelConfig:
    return ModelConfig(family="gpt", dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
                       vocab_size=51200, ffn_hidden=4 * dim, max_seq_len=2048, tie_embeddings=tied)


def _pp8(sp: bool) -> Layout:
    return Layout(tp=8, pp=8, sp=sp, schedule="1f1b", micro_batch=1, loss_parallel=True)


@pytest.mark.parametrize("model, layout, batch, published_gib", [
    (_gpt(6144, 48, 64), Layout(tp=8, micro_batch=4, loss_parallel=True), 4, 59.25),
    (_gpt(6144, 48, 64), Layout(tp=8, sp=True, micro_batch=4, loss_parallel=True), 4, 39.56),
    (_gpt(12288, 96, 96), _pp8(False), 64, 51.75),
    (_gpt(12288, 96, 96), _pp8(True), 64, 32.06),
], ids=["22B-tp8", "22B-tp8-sp", "175B-tp8-pp8", "175B-tp8-pp8-sp"])
def test_megatron_gpt_activation_peak_within_5_percent_of_korthikanti(model, layout, batch, published_gib):
    # Korthikanti et al. 2022, Table 2 / §5: 16-bit activations, dropout 0.1, eager attention, seq 2048,
    # vocabulary-parallel loss; a 1F1B first stage holds p micro-batches of L/p layers, sbhL·(10 + 24/t +
    # 5as/(ht)) without SP, sbhL·(34 + 5as/h)/t with it. The plan's peak activations add the logits,
    # backward temporaries, LayerNorm statistics, the causal mask and the embedding's dropout mask.
    workload = Workload(seq_len=2048, global_batch=batch, attention="eager", dropout=0.1)
    planned = estimate_memory(model, layout, workload).activation_peak / 2**30
    assert planned == pytest.approx(published_gib, rel=0.05)


def test_an_sp_first_stage_peaks_at_a_backward_end_with_one_micro_batch_fewer():
    # GPT-3 175B, PP 8 × TP 8 + SP: a block's gathered 16-bit weights outweigh one micro-batch's activations
    # of it, so the first stage's total peaks at a steady backward's end (the stage's units all gathered,
    # that micro-batch freed), with 7 of the 8 micro-batches its activations peak with (the dry run's
    # timeline: `benchmarks/planner/pipeline_activations.py --dry-run`). Without SP it peaks at the start.
    workload = Workload(seq_len=2048, global_batch=64, attention="eager", dropout=0.1)
    sp, plain = (estimate_memory(_gpt(12288, 96, 96), _pp8(flag), workload) for flag in (True, False))
    assert (sp.pp_rank, sp.phase, plain.phase) == (0, "block gradients", "backward")
    assert sp.activations == pytest.approx(sp.activation_peak * 7 / 8, rel=0.01)
    assert plain.activations == plain.activation_peak


@pytest.mark.parametrize("sp, verified_gib", [(False, 97.46), (True, 79.24)])
def test_gpt3_175b_first_stage_within_1_percent_of_its_dry_run(sp, verified_gib):
    # `meshfit verify`'s figures for rank 0 (`benchmarks/planner/pipeline_activations.py --dry-run`, 16
    # micro-batches): mixed precision replicas hold the embedding's gradient full-vocabulary in fp32 from
    # the first backward on, and the first stage the embedding's dropout masks.
    workload = Workload(seq_len=2048, global_batch=16, attention="eager", dropout=0.1)
    planned = estimate_memory(_gpt(12288, 96, 96, tied=False), _pp8(sp), workload)
    assert planned.pp_rank == 0
    assert planned.total / 2**30 == pytest.approx(verified_gib, rel=0.01)


def test_cpu_plans_count_the_reduce_scatter_in_flight():
    # On gloo a block's reduce-scatter (input plus the chunks received, parallel/host_reduce.py) runs on
    # through the next block's backward; NCCL plans hold neither.
    model, workload = get_preset("small"), Workload(seq_len=128, global_batch=8, precision="fp32")
    block = block_weight_params(model) * 4
    for stage in (2, 3):
        layout = Layout(dp_shard=2, zero_stage=stage)
        gpu, cpu = estimate_memory(model, layout, workload), estimate_memory(model, layout, workload, backend="gloo")
        assert gpu.phase != "reduce in flight" and cpu.phase == "reduce in flight", stage
        assert 1.5 * block <= cpu.total - gpu.total <= 2.5 * block, (stage, cpu.total - gpu.total, block)
    # Pipelines reduce blocking at the end of the step: no reduce in flight.
    piped = estimate_memory(model, Layout(pp=2, dp_shard=2, zero_stage=1), workload, backend="gloo")
    assert piped.phase != "reduce in flight"


def test_selective_recompute_counts_each_stages_blocks_as_the_trainer_checkpoints_them():
    # Every second block of each stage is checkpointed (layout/recompute.py): a one-block stage keeps its
    # block, so zbv on the four-layer model (one block per stage) plans exactly as without recompute.
    from meshfit.hardware.catalog import Cluster
    from meshfit.planner.memory.shares import layout_shares
    from meshfit.planner.timing.estimate import step_time

    wl = Workload(seq_len=512, global_batch=4, precision="fp32")
    zbv = Layout(pp=2, schedule="zbv", virtual_stages=2, micro_batch=1)
    selective = dataclasses.replace(zbv, activation_checkpointing="selective")
    small = get_preset("small")
    assert estimate_memory(small, selective, wl, "gloo").total == estimate_memory(small, zbv, wl, "gloo").total
    cluster = Cluster("H100-SXM", nodes=1, gpus_per_node=2)
    assert step_time(small, selective, wl, cluster).recompute_s == 0.0
    twelve = dataclasses.replace(small, n_layers=12)
    assert [s.stage_layers for s in layout_shares(twelve, selective, wl)] == [(3, 3), (3, 3)]
    assert [s.rerun("selective") for s in layout_shares(twelve, selective, wl)] == [2, 2]
    assert step_time(twelve, selective, wl, cluster).recompute_s > 0.0


def test_the_weight_gradient_step_comes_after_a_backward_so_gradients_exist():
    # zbv at m = p: rank 1 holds every micro-batch before its first backward (no gradient there), but its
    # weight-gradient steps follow backwards (the dry run: the stage's gradients exist at that peak).
    from meshfit.planner.memory.estimate import _phases
    from meshfit.planner.memory.shares import layout_shares

    small, wl = get_preset("small"), Workload(seq_len=256, global_batch=2, precision="fp32")
    layout = Layout(pp=2, schedule="zbv", virtual_stages=2, micro_batch=1, activation_checkpointing="full")
    share = layout_shares(small, layout, wl)[1]
    phases = _phases(small, layout, wl, share, 1)
    assert phases["loss"][1] == 0.0 and phases["weight step"][1] == share.params * 4


def test_an_interleaved_rank_counts_only_the_gradients_of_stages_that_ran_a_backward():
    # PP 2, v 2, m = p, rank 0: its last stage runs both backwards (4 then 3 micro-batches in flight) before
    # its first stage starts (2, with the last stage's gradients); the heaviest start depends on the sizes.
    from meshfit.planner.memory.phase_terms import interleaved_peak

    assert interleaved_peak(2, 0, 2, 2, per_stage=1.0, grads=1.0) == (4, 0.0)
    assert interleaved_peak(2, 0, 2, 2, per_stage=1.0, grads=4.0) == (3, 2.0)
    # In the steady state (m = 4p) every stage has run a backward at the heaviest start.
    assert interleaved_peak(2, 0, 8, 2, per_stage=1.0, grads=1.0)[1] == 1.0
