"""`meshfit demo`: the seed scenario runs end to end and reports what it measured."""

import json

import pytest

from meshfit.demo import DEMO_BUDGET
from meshfit.units import parse_bytes
from test_cli import meshfit

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]


def test_demo_progression(tmp_path):
    res = meshfit("demo", "--run-dir", str(tmp_path), timeout=390)
    assert res.returncode == 0, res.stderr
    summary = {e["layout"]: e for e in json.loads((tmp_path / "summary.json").read_text())}
    budget = parse_bytes(DEMO_BUDGET)
    for name in ("ddp", "ddp-4x-batch", "zero1", "zero2"):
        entry = summary[name]
        assert entry["fits"] is False and entry["final_loss"] is None, name
        assert entry["peak_mem_bytes"] is not None, entry["error"]
        assert entry["peak_mem_bytes"] > budget  # measured without the budget
        assert "memory budget exceeded" in entry["error"]
    for name in ("zero3", "fsdp-ac", "tp", "pp", "3d"):
        entry = summary[name]
        assert entry["fits"] is True and entry["final_loss"] is not None, name
        assert entry["peak_mem_bytes"] <= budget
    # A larger local batch needs more memory, not less; every stage needs less than the one before.
    assert summary["ddp-4x-batch"]["peak_mem_bytes"] > summary["ddp"]["peak_mem_bytes"]
    order = [summary[n]["peak_mem_bytes"] for n in ("ddp", "zero1", "zero2", "zero3", "fsdp-ac")]
    assert order == sorted(order, reverse=True)
    ddp = max(summary["ddp"]["mem"], key=lambda m: m["peak"])
    # DDP's model states alone (weights + grads + AdamW moments) exceed the budget.
    assert ddp["params"] + ddp["max"]["grads"] + ddp["max"]["optim"] > budget
    # The layouts that fit trained the same model on the same data: the same losses.
    assert summary["zero3"]["final_loss"] == pytest.approx(summary["fsdp-ac"]["final_loss"], abs=1e-5)
    for name in ("tp", "pp", "3d"):
        assert summary[name]["final_loss"] == pytest.approx(summary["zero3"]["final_loss"], abs=1e-5)
    assert len(summary["3d"]["mem"]) == 8 and {tuple(m["stages"]) for m in summary["3d"]["mem"]} == {(0,), (1,)}
    # The plan printed first predicted every layout's most-loaded rank within 10% of what was measured.
    for name, entry in summary.items():
        assert entry["predicted_peak_mem_bytes"] == pytest.approx(entry["peak_mem_bytes"], rel=0.10), name
    assert "the plan" in res.stdout and "predicted (planner) vs measured" in res.stdout
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    assert "per-rank memory" in res.stdout and "zero3" in res.stdout
