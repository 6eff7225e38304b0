"""`meshfit demo`: the seed scenario runs end to end and reports what it measured."""

import json

import pytest

from meshfit.units import parse_bytes
from meshfit.demo import DEMO_BUDGET
from test_cli import meshfit

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]


def test_demo_shows_ddp_failing_and_bigger_batch_costing_more(tmp_path):
    res = meshfit("demo", "--run-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    summary = {e["layout"]: e for e in json.loads((tmp_path / "summary.json").read_text())}
    budget = parse_bytes(DEMO_BUDGET)
    ddp, big = summary["ddp"], summary["ddp-4x-batch"]
    for entry in (ddp, big):
        assert entry["fits"] is False and entry["final_loss"] is None
        assert entry["peak_mem_bytes"] > budget  # measured without the budget, one step
        assert "memory budget exceeded" in entry["error"]
    assert big["peak_mem_bytes"] > ddp["peak_mem_bytes"]
    worst = max(ddp["mem"], key=lambda m: m["peak"])
    # DDP's model states alone (weights + grads + AdamW moments) exceed the budget.
    assert worst["params"] + worst["max"]["grads"] + worst["max"]["optim"] > budget
    assert "per-rank memory" in res.stdout and "ddp" in res.stdout
