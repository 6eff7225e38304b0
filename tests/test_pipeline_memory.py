"""Pipeline memory independent of the step's micro-batch count (parallel/pipeline_memory.py, the planner)."""

from __future__ import annotations

import dataclasses

import pytest
from dist_jobs import parity_config, peaks_job

from meshfit.layout.layout import Layout, Workload
from meshfit.models.presets import get_preset
from meshfit.parallel.pipeline_memory import wait_points
from meshfit.planner.memory.estimate import estimate_memory
from meshfit.util.ranks import run_ranks


def _torch_order(name: str, pp: int, m: int) -> dict[int, list]:
    """Every rank's action list with sends and receives, as torch's multi-stage runtime builds it (no
    process group: only the op-list computation; reads torch internals, like test_planner_memory)."""
    from torch.distributed.pipelining import schedules

    cls = {"interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
           "interleaved-zb": schedules.ScheduleInterleavedZeroBubble,
           "zbv": schedules.ScheduleZBVZeroBubble, "dualpipev": schedules.ScheduleDualPipeV}[name]
    v, rounds = 2, max(1, m // pp)
    compute = {}
    for rank in range(pp):
        sched = object.__new__(cls)
        for key, value in {"pp_group_size": pp, "n_local_stages": v, "_n_microbatches": m, "rank": rank,
                           "number_of_rounds": rounds, "microbatches_per_round": m // rounds,
                           "num_stages": pp * v, "_num_stages": pp * v}.items():
            setattr(sched, key, value)
        compute[rank] = [a for a in sched._calculate_single_rank_operations(rank) if a is not None]
    v_shape = name in ("zbv", "dualpipev")

    def stage_to_rank(stage: int) -> int:
        return (stage if stage < pp else 2 * pp - 1 - stage) if v_shape else stage % pp

    return schedules._add_send_recv(compute, stage_to_rank=stage_to_rank, num_stages=pp * v)


KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}


def _run(order: dict[int, list], waits: dict[int, dict]) -> dict[int, int]:
    """Execute every rank's list where a send waited for blocks until the peer posted its receive and a
    computation blocks until its input was sent; returns each rank's most sends pending at once. Fails
    (AssertionError) if the ranks deadlock."""
    posted, sent = set(), set()
    pos = {r: 0 for r in order}
    pending = {r: set() for r in order}
    most = {r: 0 for r in order}
    partner = {"SEND_F": ("RECV_F", 1), "SEND_B": ("RECV_B", -1)}
    needs = {"FORWARD": ("SEND_F", -1), "FULL_BACKWARD": ("SEND_B", 1), "BACKWARD_INPUT": ("SEND_B", 1)}
    while any(pos[r] < len(order[r]) for r in order):
        progressed = False
        for r, actions in order.items():
            while pos[r] < len(actions):
                a = actions[pos[r]]
                subs = a.sub_actions or (a,)
                own = {(x.computation_type.name, x.stage_index, x.microbatch_index) for x in actions}
                deps = []
                for c in subs:
                    need = needs.get(c.computation_type.name)
                    recv = "RECV_F" if c.computation_type.name == "FORWARD" else "RECV_B"
                    if need and (recv, c.stage_index, c.microbatch_index) in own:
                        deps.append((need[0], c.stage_index + need[1], c.microbatch_index))
                due = [key for c in subs if c.computation_type.name in KINDS
                       for key in waits[r].get((c.stage_index, KINDS[c.computation_type.name], c.microbatch_index), ())]
                matched = [(partner[k[0]][0], k[1] + partner[k[0]][1], k[2]) for k in due]
                if any(d not in sent for d in deps) or any(m not in posted for m in matched):
                    break
                pending[r] -= set(due)
                name = a.computation_type.name
                if name in ("RECV_F", "RECV_B"):
                    posted.add((name, a.stage_index, a.microbatch_index))
                if name in ("SEND_F", "SEND_B"):
                    sent.add((name, a.stage_index, a.microbatch_index))
                    pending[r].add((name, a.stage_index, a.microbatch_index))
                    most[r] = max(most[r], len(pending[r]))
                pos[r] += 1
                progressed = True
        assert progressed, f"deadlock at {pos}"
    return most


@pytest.mark.parametrize("name", ["interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"])
@pytest.mark.parametrize("pp", [2, 4])
def test_sends_are_waited_without_deadlock_and_stay_bounded(name, pp):
    # The wait points only ever wait for a send whose receive the peer has posted, so blocking waits there
    # complete whatever the interleaving; the sends left pending no longer grow with the micro-batches.
    most = {}
    for m in (pp, 4 * pp, 16 * pp):
        if name == "dualpipev" and m < 2 * pp:
            continue
        order = _torch_order(name, pp, m)
        waits = {r: wait_points(order, r) for r in order}
        most[m] = max(_run(order, waits).values())
        # Without the wait points every send of the step is pending at its end.
        assert max(_run(order, {r: {} for r in order}).values()) >= 2 * m
    assert most[16 * pp] == most[4 * pp] <= 2 * pp + 2, most


def test_wait_points_follow_the_actions_they_wait_behind():
    order = _torch_order("interleaved-1f1b", 2, 8)
    for rank, points in ((r, wait_points(order, r)) for r in order):
        names = [(a.computation_type.name, a.stage_index, a.microbatch_index) for a in order[rank]]
        kinds = {"F": "FORWARD", "B": ("FULL_BACKWARD", "BACKWARD_INPUT"), "W": "BACKWARD_WEIGHT"}
        for (stage, kind, mb), sends in points.items():
            at = min(i for i, n in enumerate(names) if n[1:] == (stage, mb) and n[0] in kinds[kind])
            assert all(names.index(send) < at for send in sends)


LLAMA70 = "llama3-70b"


def test_planned_pipeline_memory_is_flat_in_the_micro_batch_count():
    # Llama-3 70B, tp 8 × pp 8 (1F1B, SP, loss parallel), seq 4096, micro-batch 1, full recompute, 64 GPUs:
    # the global batch 8 -> 512 (m = p -> 64p) no longer adds boundary buffers or activations.
    model = get_preset(LLAMA70)
    layout = Layout(tp=8, pp=8, sp=True, loss_parallel=True, schedule="1f1b", micro_batch=1,
                    activation_checkpointing="full")
    plans = {b: estimate_memory(model, layout, Workload(seq_len=4096, global_batch=b, precision="mixed"))
             for b in (8, 32, 128, 512)}
    steady = plans[32]
    for b in (128, 512):
        assert plans[b].total == pytest.approx(steady.total, rel=1e-9), b
        assert (plans[b].buffers, plans[b].activations) == (steady.buffers, steady.activations)
    # m = p has no steady state: its peak is at the first backward, before any gradient exists.
    assert plans[8].total <= steady.total
    assert steady.buffers < 2**30 * 0.05  # RoPE tables only; per-micro-batch receive buffers are gone


@pytest.mark.parametrize("schedule, virtual", [("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2),
                                               ("dualpipev", 2)])
def test_planned_multi_stage_memory_is_flat_past_the_warm_up(schedule, virtual):
    model = dataclasses.replace(get_preset("tiny"), n_layers=8)
    layout = Layout(pp=2, schedule=schedule, virtual_stages=virtual, micro_batch=1)
    totals = [estimate_memory(model, layout, Workload(seq_len=128, global_batch=m, precision="fp32")).total
              for m in (8, 32, 128)]
    assert totals[0] == totals[1] == totals[2]


def _peaks_config(schedule: str, m: int) -> dict:
    # Boundary tensors (256 tokens × 256) of the size of a block's saved input: with torch's
    # per-micro-batch buffers and end-of-step send waits the peak grew by a third (1f1b) and 2.4× (interleaved)
    # from m = 4p to 16p on this model.
    return parity_config("model.dim=256", "model.n_layers=4", "model.max_seq_len=256", "train.seq_len=256",
                         "train.steps=2", "parallel.pp=2", "parallel.activation_checkpointing=full",
                         f"pipeline.schedule={schedule}", f"train.global_batch={m}", f"pipeline.microbatches={m}")


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_real_pipeline_peak_does_not_grow_with_the_micro_batch_count():
    # From the schedules' steady state on (m = 4p) the peak stays put as m grows to 16p. (m = p is lower:
    # there the most micro-batches in flight come before any gradient exists, as the planner counts.)
    cfgs = [_peaks_config(schedule, m) for schedule in ("1f1b", "interleaved-1f1b") for m in (8, 32)]
    one_4p, one_16p, inter_4p, inter_16p = run_ranks(peaks_job, 2, cfgs, timeout_s=280)[0]
    assert one_16p == pytest.approx(one_4p, rel=0.05)
    assert inter_16p == pytest.approx(inter_4p, rel=0.05)
