"""train.compile: torch.compile per block, parity with eager in three layouts, compile time kept apart,
the memory tracker's eager steps, the checks before a run, and what the planner makes of it.

Compiling costs tens of seconds per graph on this machine, so the compiled runs are few (three) and share
one inductor cache (TORCHINDUCTOR_CACHE_DIR), set for this module and inherited by every rank.
"""

import json
import os
import tempfile
from pathlib import Path

import pytest
from dist_jobs import parity_config, train_job

from meshfit.config import ConfigError, load_config
from meshfit.hardware.catalog import Cluster
from meshfit.layout.layout import Layout, Workload
from meshfit.models.presets import get_preset
from meshfit.planner.planfile import plan_sections
from meshfit.planner.timing.estimate import COMPILED_ELEMENTWISE, step_time
from meshfit.train.shape import resolve_run
from meshfit.train.steady import steady_records
from meshfit.util.ranks import run_ranks

PARITY = 1e-5  # fp32


@pytest.fixture(scope="module", autouse=True)
def inductor_cache():
    """One inductor cache for every compiled run of this module (ranks inherit the environment)."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / "meshfit-tests-inductor")
    yield
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def _losses_pair(world: int, *overrides: str, run_dir: Path | None = None):
    eager = run_ranks(train_job, world, parity_config("train.steps=4", *overrides), timeout_s=300)[0]
    compiled = run_ranks(train_job, world, parity_config("train.steps=4", "train.compile=true", *overrides),
                         str(run_dir) if run_dir else None, timeout_s=420)[0]
    delta = max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"], strict=True))
    return eager, compiled, delta


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_one_process_with_op_recompute_matches_eager_and_reports_compile_time_once(tmp_path):
    # One tracked step (eager blocks, with a breakdown), then the step that compiles, then compiled steps.
    eager, compiled, delta = _losses_pair(1, "parallel.activation_checkpointing=op", "train.memory_tracked_steps=1",
                                          run_dir=tmp_path)
    assert delta <= PARITY, (eager["losses"], compiled["losses"])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["blocks"] == "eager"
    assert records[0]["mem"][0]["measured"] == "tracker" and records[0]["mem"][0]["breakdown_blocks"] == "eager"
    assert records[0]["mem"][0]["activations"] > 0
    compiling = [r["step"] for r in records if r.get("compile_s")]
    assert compiling == [2], compiling  # the first untracked step compiles; no step after it does
    # The compiler's own memory (RSS) does not send the steps after it back under the tracker (eager).
    assert [r["step"] for r in records if r.get("blocks") == "eager"] == [1]
    assert compiled["compile_s"] == pytest.approx(records[1]["compile_s"]) and compiled["compile_s"] > 0
    # Steady figures leave out step 1, the compiling step and every eager (tracked) step.
    steady = [r for r in records[1:] if "compile_s" not in r and r.get("blocks") != "eager"]
    assert steady, [(r["step"], r.get("blocks")) for r in records]
    assert compiled["mean_step_time_s"] == pytest.approx(sum(r["step_time_s"] for r in steady) / len(steady))
    assert "compile_s" not in eager


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_zero3_over_context_parallel_ranks_matches_eager():
    # ZeRO-3 shards over the two cp ranks; each compiled block gathers K/V across them (functional
    # collectives, traced into the graph) and masks with booleans (parallel/context_parallel.py).
    _, compiled, delta = _losses_pair(2, "parallel.cp=2", "parallel.zero_stage=3", "train.memory_tracking=off")
    assert delta <= PARITY
    assert compiled["compile_s"] > 0


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_tensor_and_sequence_parallel_on_two_ranks_matches_eager():
    _, compiled, delta = _losses_pair(2, "parallel.tp=2", "parallel.sp=true", "parallel.loss_parallel=true",
                                      "train.memory_tracking=off")
    assert delta <= PARITY
    assert compiled["compile_s"] > 0


def test_refused_when_every_step_would_run_under_the_memory_tracker():
    with pytest.raises(ConfigError, match="memory_tracking=full tracks every step"):
        resolve_run(load_config(None, ["train.compile=true", "train.memory_tracking=full"]), 1)
    with pytest.raises(ConfigError, match="memory_budget on CPU"):
        resolve_run(load_config(None, ["train.compile=true", "train.memory_budget=1GiB", "train.device=cpu"]), 1)
    assert resolve_run(load_config(None, ["train.compile=true"]), 1).zero_stage == 0


def test_refused_without_a_cpp_compiler(monkeypatch):
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", ("/nonexistent/g++",))
    with pytest.raises(ConfigError, match=r"needs a C\+\+ compiler .*tried /nonexistent/g\+\+"):
        resolve_run(load_config(None, ["train.compile=true", "train.device=cpu"]), 1)
    resolve_run(load_config(None, ["train.device=cpu"]), 1)  # without compile nothing is asked of it


def test_steady_records_leave_out_warm_up_compiling_and_eager_steps():
    recs = [{"step": 1, "blocks": "eager"}, {"step": 2, "compile_s": 9.0}, {"step": 3}, {"step": 4}]
    assert [r["step"] for r in steady_records(recs)] == [3, 4]
    assert [r["step"] for r in steady_records([{"step": 1}, {"step": 2}])] == [2]
    assert [r["step"] for r in steady_records([{"step": 1}, {"step": 2, "compile_s": 1.0}])] == [2]


def test_planner_fuses_the_blocks_element_wise_work_and_plans_compiled_runs():
    model, cluster = get_preset("llama3-8b"), Cluster("H100-SXM", nodes=1, gpus_per_node=8)
    layout = Layout(dp_shard=8, zero_stage=3, micro_batch=1, activation_checkpointing="op")
    eager_wl = Workload(seq_len=4096, global_batch=8)
    compiled_wl = Workload(seq_len=4096, global_batch=8, compiled=True)
    eager, compiled = step_time(model, layout, eager_wl, cluster), step_time(model, layout, compiled_wl, cluster)
    assert compiled.elementwise_s < eager.elementwise_s
    assert compiled.elementwise_s > COMPILED_ELEMENTWISE * eager.elementwise_s  # embeddings and loss stay eager
    assert compiled.recompute_s < eager.recompute_s  # op-level recompute re-runs only element-wise work
    assert compiled.total_s < eager.total_s
    assert plan_sections(model, compiled_wl, layout)["train"]["compile"] is True
    assert "compile" not in plan_sections(model, eager_wl, layout)["train"]


def test_verify_refuses_compile_and_explain_says_what_it_buys(capsys):
    from meshfit.commands.main import main

    assert main(["verify", "--model", "tiny", "--compile", "--layout", "dp_shard=2,zero_stage=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --compile:") and "verify without --compile" in err
    assert main(["plan", "--model", "llama3-8b", "--explain"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "compiled blocks (train.compile" in out and "Assumed: the blocks' fused element-wise kernels" in out
