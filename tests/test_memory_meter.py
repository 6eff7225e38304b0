"""When memory is measured: tracked steps, carried-over breakdowns, growth caught after tracking stops."""

import json

import pytest
import torch.distributed as dist
from test_cli import meshfit

from meshfit.memory import meter as meter_module
from meshfit.memory.allocator import AllocatorTracker
from meshfit.memory.meter import MemoryMeter, rank_tracker


class _StubTracker:
    """Stands in for a per-operator tracker: a fixed breakdown per tracked step."""

    def __init__(self):
        self.peaks = 0

    def peak(self):
        self.peaks += 1
        return {"peak": 100 * self.peaks, "params": 10}

    def current(self):
        return {"peak": 50}


def _vote(meter: MemoryMeter) -> list[tuple[int, bool]]:
    """What the step's vote gathers from the only rank (train/vote.py), taken before its record."""
    return [meter.reading()]


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_auto_tracks_the_first_steps_then_carries_and_retracks_on_growth(world_of_one, monkeypatch):
    counter = {"value": 1000 * 2**20}
    monkeypatch.setattr(meter_module, "_counter", lambda device: counter["value"])
    tracker = _StubTracker()
    meter = MemoryMeter(tracker, meter_module.torch.device("cpu"), "auto", tracked_steps=2, budget=None)
    seen = []
    for step in range(6):
        if step == 3:
            counter["value"] *= 2  # memory grows after tracking stopped
        tracked = meter.tracking()
        records, retracked = meter.records(1, {}, _vote(meter))
        seen.append((tracked, records[0]["measured"], retracked, records[0]["peak"]))
    assert seen == [
        (True, "tracker", False, 100), (True, "tracker", False, 200),  # the tracked steps
        (False, "carried", False, 200),  # carried over
        (False, "carried", False, 200),  # the growth is seen here ...
        (True, "tracker", True, 300),  # ... and this step is measured again
        (False, "carried", False, 300),  # the new baseline holds
    ]
    assert tracker.peaks == 3


def test_auto_returns_the_free_heap_after_tracked_steps_only(world_of_one, monkeypatch):
    counter = {"value": 1000 * 2**20}
    monkeypatch.setattr(meter_module, "_counter", lambda device: counter["value"])
    trims = []
    monkeypatch.setattr(meter_module, "return_free_heap", lambda: trims.append(len(trims)))
    cpu = meter_module.torch.device("cpu")
    meter = MemoryMeter(_StubTracker(), cpu, "auto", tracked_steps=2, budget=None)
    kinds = []
    for step in range(6):
        if step == 3:
            counter["value"] *= 2
        tracked = meter.tracking()
        meter.records(1, {}, _vote(meter))
        kinds.append((tracked, len(trims)))
    # two tracked steps, two carried, the re-tracked one, one carried: a trim after each tracked step
    assert kinds == [(True, 1), (True, 2), (False, 2), (False, 2), (True, 3), (False, 3)]
    full = MemoryMeter(_StubTracker(), cpu, "full", tracked_steps=2, budget=None)
    for _ in range(3):  # every step is tracked: trimming each would cost page faults every step
        full.records(1, {}, _vote(full))
    assert len(trims) == 3


def test_full_tracks_every_step_and_a_cpu_budget_forces_it(world_of_one, monkeypatch):
    monkeypatch.setattr(meter_module, "_counter", lambda device: 0)
    cpu = meter_module.torch.device("cpu")
    for meter in (MemoryMeter(_StubTracker(), cpu, "full", 1, None), MemoryMeter(_StubTracker(), cpu, "auto", 1, 10**9)):
        for _ in range(3):
            assert meter.tracking()
            assert meter.records(1, {}, _vote(meter))[0][0]["measured"] == "tracker"


def test_off_never_tracks_and_reports_the_counter(world_of_one, monkeypatch):
    counter = {"value": 1000 * 2**20}
    monkeypatch.setattr(meter_module, "_counter", lambda device: counter["value"])
    tracker = _StubTracker()
    meter = MemoryMeter(tracker, meter_module.torch.device("cpu"), "off", tracked_steps=2, budget=None)
    for step in range(3):
        counter["value"] *= 2  # growth does not turn the tracker on either
        assert not meter.tracking()
        records, retracked = meter.records(1, {}, _vote(meter))
        assert records == [{"peak": counter["value"], "measured": "counter", "rss_peak": counter["value"]}]
        assert not retracked
    assert tracker.peaks == 0


class _StubAllocatorTracker(_StubTracker):
    """Stands in for the allocator attribution: a breakdown per step, and the step's peak so far."""

    def step_peak(self):
        return 100 * (self.peaks + 1)


def test_auto_on_cuda_attributes_every_step_from_the_allocator(world_of_one, monkeypatch):
    def no_counter(device):
        raise AssertionError("the attribution owns the allocator's peak counter; nothing else resets it")

    monkeypatch.setattr(meter_module, "_counter", no_counter)
    tracker = _StubAllocatorTracker()
    meter = MemoryMeter(tracker, meter_module.torch.device("cuda", 0), "auto", tracked_steps=2, budget=None)
    for step in range(1, 5):
        assert meter.tracking()
        records, retracked = meter.records(1, {}, _vote(meter))
        assert records[0]["measured"] == "allocator" and not retracked
        assert records[0]["peak"] == records[0]["device_peak"] == 100 * step
    assert tracker.peaks == 4


def test_auto_on_cpu_and_ops_track_per_operator_first_steps(world_of_one, monkeypatch):
    monkeypatch.setattr(meter_module, "_counter", lambda device: 2**20)
    for device, mode in (("cpu", "auto"), ("cpu", "ops"), ("cuda", "ops")):
        meter = MemoryMeter(_StubTracker(), meter_module.torch.device(device), mode, tracked_steps=1, budget=None)
        kinds = [meter.records(1, {}, _vote(meter))[0][0]["measured"] for _ in range(3)]
        assert kinds == ["tracker", "carried", "carried"], (device, mode)
    budgeted = MemoryMeter(_StubTracker(), meter_module.torch.device("cpu"), "ops", tracked_steps=1, budget=10**9)
    assert [budgeted.records(1, {}, _vote(budgeted))[0][0]["measured"] for _ in range(3)] == ["tracker"] * 3


def test_which_measurement_each_mode_uses():
    model = meter_module.nn.Linear(2, 2)
    optimizer = meter_module.torch.optim.SGD(model.parameters(), lr=0.1)
    cuda, cpu = meter_module.torch.device("cuda", 0), meter_module.torch.device("cpu")
    assert isinstance(rank_tracker(model, optimizer, cuda, 0, "auto", None), AllocatorTracker)
    for device, mode in ((cuda, "ops"), (cuda, "full"), (cpu, "auto"), (cpu, "full")):
        assert rank_tracker(model, optimizer, device, 0, mode, None).per_operator, (device, mode)


@pytest.mark.multiproc
def test_metrics_say_which_steps_were_measured(tmp_path):
    res = meshfit("train", "--run-dir", str(tmp_path), "--set", "train.steps=5", "--set", "train.device=cpu",
                  "--set", "train.memory_tracked_steps=2")
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["mem"][0]["measured"] for r in records] == ["tracker"] * 2 + ["carried"] * 3
    assert all(r["mem"][0]["rss_peak"] > 0 for r in records)
    off = meshfit("train", "--run-dir", str(tmp_path / "off"), "--set", "train.steps=2", "--set",
                  "train.device=cpu", "--set", "train.memory_tracking=off")
    assert off.returncode == 0, off.stderr
    records = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    assert [r["mem"][0]["measured"] for r in records] == ["counter"] * 2
    assert all(r["peak_mem_bytes"] == r["mem"][0]["rss_peak"] > 0 for r in records)


@pytest.mark.multiproc
def test_tracking_off_with_a_cpu_budget_is_refused(tmp_path):
    res = meshfit("train", "--run-dir", str(tmp_path), "--set", "train.steps=1", "--set", "train.device=cpu",
                  "--set", "train.memory_tracking=off", "--set", "train.memory_budget=1GiB")
    assert res.returncode == 2 and "train.memory_tracking=off" in res.stderr and "Traceback" not in res.stderr
