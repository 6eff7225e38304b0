"""Resume: bit-exact under the same layout, and under other layouts and world sizes (gloo ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_jobs import PARITY_BASE, parity_config, resume_layouts_job

from meshfit.config import ConfigError, load_config
from meshfit.runs.export import read_model
from meshfit.train.launch import launch
from meshfit.train.optim import lr_factor
from meshfit.util.ranks import run_ranks, snapshot
from meshfit.util.units import fmt_bytes

LAYOUTS = {
    "ddp": ["parallel.dp_replicate=2"],
    "zero3": ["parallel.dp_shard=2", "checkpoint.async_save=true"],  # async saves resume exactly too
    "tp": ["parallel.tp=2", "parallel.sp=true"],
    "pp": ["parallel.pp=2", "pipeline.schedule=1f1b"],
}


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_five_steps_resume_five_steps_equals_ten_steps(tmp_path: Path) -> None:
    """Every loss and the final parameters are bit-identical to an uninterrupted run, per layout."""
    configs = {name: parity_config(*overrides) for name, overrides in LAYOUTS.items()}
    results = run_ranks(resume_layouts_job, 2, configs, str(tmp_path), timeout_s=280)[0]
    for name, result in results.items():
        assert result["first"]["end_step"] == 5 and result["second"]["start_step"] == 5, name
        assert result["full"]["losses"] == result["first"]["losses"] + result["second"]["losses"], name
        full, _, _ = read_model(tmp_path / name / "full" / "checkpoints" / "step-00000010")
        split, _, _ = read_model(tmp_path / name / "split" / "checkpoints" / "step-00000010")
        assert full.keys() == split.keys() and len(full) > 0
        unequal = [k for k in full if not torch.equal(full[k], split[k])]
        assert not unequal, f"{name}: final parameters differ in {unequal}"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_resume_under_other_layouts_and_world_sizes(tmp_path: Path) -> None:
    """ZeRO-3 ×4 → ZeRO-1 ×2 × tp 2 → DDP ×2 → pp 2 → one process, 3 steps each, against one process for 15
    steps."""
    base = [*PARITY_BASE, "train.steps=15"]
    reference = launch(load_config(None, base), tmp_path / "reference")
    assert reference.ok, reference.message
    legs = [(["parallel.dp_shard=4"], 4), (["parallel.dp_shard=2", "parallel.zero_stage=1", "parallel.tp=2"], 4),
            (["parallel.dp_replicate=2"], 2), (["parallel.pp=2"], 2), ([], None)]
    losses, layouts = [], []
    for i, (overrides, nproc) in enumerate(legs):
        resume = ["checkpoint.resume=true"] if i else []
        outcome = launch(load_config(None, [*base, *overrides, *resume, f"train.stop_after={3 * (i + 1)}"]),
                         tmp_path / "run", nproc)
        assert outcome.ok, outcome.message
        assert outcome.result["start_step"] == 3 * i and outcome.result["end_step"] == 3 * (i + 1)
        losses += outcome.result["losses"]
        layouts.append(outcome.result["layout"])
    assert layouts == ["dp_shard=4", "dp_shard=2 × tp=2", "dp_replicate=2", "pp=2", "single rank"]
    assert losses == pytest.approx(reference.result["losses"], abs=1e-5, rel=0)


def test_a_changed_global_batch_is_refused_with_the_reason_and_nothing_changes(tmp_path: Path) -> None:
    """The data position counts global sequences: another dp size is fine, another global batch is not.
    The refusal comes before any rank starts and leaves the run's files as they were."""
    base = [*PARITY_BASE, "train.steps=4", "train.stop_after=2"]
    assert launch(load_config(None, base), tmp_path).ok
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match="train.global_batch: saved 8, now 4"):
        launch(load_config(None, [*base, "train.global_batch=4", "checkpoint.resume=true"]), tmp_path)
    with pytest.raises(ConfigError, match=r"model.n_layers: saved 2, now 3"):
        launch(load_config(None, [*base, "model.n_layers=3", "checkpoint.resume=true"]), tmp_path)
    assert snapshot(tmp_path) == before


def test_a_changed_schedule_is_named_and_followed_from_the_first_resumed_step(
        tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    base = [*PARITY_BASE, "train.steps=6", "train.stop_after=3"]
    assert launch(load_config(None, base), tmp_path).ok
    capfd.readouterr()
    cfg = load_config(None, [*PARITY_BASE, "train.steps=12", "train.lr=1e-3", "checkpoint.resume=true"])
    outcome = launch(cfg, tmp_path)
    assert outcome.ok, outcome.message
    err = capfd.readouterr().err
    assert "changed learning-rate schedule (train.steps 6 → 12, train.lr 0.003 → 0.001): from the first resumed step" in err
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected = [1e-3 * lr_factor(step - 1, 2, 12, cfg.train.min_lr_ratio) for step in range(4, 13)]
    assert [r["lr"] for r in records[3:]] == pytest.approx(expected, rel=1e-12)
    assert (tmp_path / "config-step-3.yaml").read_text().count("steps: 6") == 1  # the config it replaced


def test_resume_with_no_checkpoint_says_it_starts_at_step_0(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    outcome = launch(load_config(None, [*PARITY_BASE, "train.steps=2", "checkpoint.resume=true"]), tmp_path / "new")
    assert outcome.ok and outcome.result["start_step"] == 0
    said = capfd.readouterr()
    assert f"--resume: {tmp_path / 'new' / 'checkpoints'} does not exist; starting at step 0" in said.err
    # The start banner, then (not a terminal) one plain progress line per step with the ETA.
    assert (f"meshfit train: model tiny, 107K params (2 layers, dim 64), layout single rank, 1 rank, fp32; steps "
            f"up to 2 from step 1 of 2, global batch 8 × 64 tokens; run directory {tmp_path / 'new'}") in said.err
    lines = [line for line in said.out.splitlines() if line.startswith("step ")]
    assert [line.split("|")[0].split()[1] for line in lines] == ["1/2", "2/2"]
    assert lines[0].rsplit("| eta ", 1)[1].endswith(("µs", "ms", " s")) and lines[1].endswith("| eta 0 s")


def test_a_failed_start_changes_nothing_and_a_failure_after_it_says_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every checkpoint damaged: the resume is refused before any rank starts, naming each damaged file,
    and nothing on disk changes (no checkpoint is moved, no report written). A run that fails after its
    first step records `"status": "failed"` in result.json."""
    base = [*PARITY_BASE, "train.steps=4", "checkpoint.interval=2"]
    assert launch(load_config(None, base), tmp_path).ok
    shards = sorted((tmp_path / "checkpoints").glob("step-*/__0_0.distcp"))
    for shard in shards:
        shard.write_bytes(b"damaged")
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match="--resume: no intact checkpoint to resume from") as refused:
        launch(load_config(None, [*base, "train.steps=6", "checkpoint.resume=true"]), tmp_path)
    assert all(f"checkpoint file {shard} is truncated or damaged" in str(refused.value) for shard in shards)
    assert snapshot(tmp_path) == before
    monkeypatch.setenv("MESHFIT_FAULT", "inf-loss:rank=0:step=2")
    outcome = launch(load_config(None, [*base, "train.steps=3"]), tmp_path / "failing")
    assert not outcome.ok and "rank 0" in outcome.message
    result = json.loads((tmp_path / "failing" / "result.json").read_text())
    assert result["status"] == "failed" and result["end_step"] == 1 and "non-finite" in result["error"].lower()


def test_runs_are_never_mixed_or_wiped_by_a_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another run's checkpoint, or nothing to continue from, is refused where a run already has steps;
    a rewind keeps the records it re-runs; a restart by torchrun continues the run without --resume."""
    base = [*PARITY_BASE, "train.steps=4", "checkpoint.interval=2"]
    for name in ("a", "b"):
        assert launch(load_config(None, base), tmp_path / name).ok
    before = snapshot(tmp_path)
    other = tmp_path / "a" / "checkpoints" / "step-00000004"
    with pytest.raises(ConfigError, match="is not a checkpoint of the run in --run-dir"):
        launch(load_config(None, [*base, "checkpoint.resume=true", f"checkpoint.resume_from={other}"]), tmp_path / "b")
    no_checkpoints = [*base, "checkpoint.resume=true", f"checkpoint.dir={tmp_path / 'empty'}"]
    with pytest.raises(ConfigError, match="holds a finished run .* there is nothing to continue from"):
        launch(load_config(None, no_checkpoints), tmp_path / "b")
    assert snapshot(tmp_path) == before
    # Rewind run b to step 2: steps 3-4 run again; their first records move aside, not away.
    rewind = [*base, "checkpoint.resume=true", f"checkpoint.resume_from={tmp_path / 'b/checkpoints/step-00000002'}"]
    assert launch(load_config(None, rewind), tmp_path / "b").ok
    shelved = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics-superseded-2.jsonl").read_text().splitlines()]
    assert shelved == [3, 4]
    assert [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    # torchrun restarted the ranks (restart count 1): the same command, without --resume, continues run a.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    outcome = launch(load_config(None, [*base, "train.steps=6"]), tmp_path / "a")
    assert outcome.ok and outcome.result["start_step"] == 4 and outcome.result["end_step"] == 6


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_long_checkpoint_write_says_what_it_writes_and_how_long_it_took(tmp_path, background):
    """The console names a large save before it starts and its size and time when it is done."""
    from dist_jobs import announced_save_job

    cfg = parity_config("train.steps=2", "parallel.dp_shard=2", "parallel.zero_stage=3",
                        f"checkpoint.async_save={str(background).lower()}")
    printed = run_ranks(announced_save_job, 2, cfg, str(tmp_path))[0]
    folder = tmp_path / "checkpoints" / "step-00000002"
    written = sum(p.stat().st_size for p in folder.iterdir() if p.name != "meshfit.json")
    assert f"[checkpoint] writing step 2 to {folder}: model, optimizer states" in printed, printed
    assert " from 2 rank(s))" in printed and (" in the background…" in printed) == background, printed
    line = next(x for x in printed.splitlines() if x.startswith("[checkpoint] step 2: "))
    assert f" written to {folder} " in line and fmt_bytes(written) in line, (line, written)
    assert ("finished in the background" in line) == background, line
