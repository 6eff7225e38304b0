"""Resume: bit-exact under the same layout, and under other layouts and world sizes (gloo ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_jobs import PARITY_BASE, parity_config, resume_layouts_job
from meshfit.config import load_config
from meshfit.data.errors import DataError
from meshfit.export import read_model
from meshfit.testing import run_ranks
from meshfit.train.launch import launch

LAYOUTS = {
    "ddp": ["parallel.dp_replicate=2"],
    "zero3": ["parallel.dp_shard=2", "checkpoint.async_save=true"],  # async saves resume exactly too
    "tp": ["parallel.tp=2", "parallel.sp=true"],
    "pp": ["parallel.pp=2", "pipeline.schedule=1f1b"],
}


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


@pytest.mark.timeout(300)
def test_resume_under_other_layouts_and_world_sizes(tmp_path: Path) -> None:
    """ZeRO-3 ×4 → ZeRO-1 ×2 × tp 2 → DDP ×2 × tp 2 → pp 2 → one process, 3 steps each, against one process
    for 15 steps."""
    base = [*PARITY_BASE, "train.steps=15"]
    reference = launch(load_config(None, base), tmp_path / "reference")
    assert reference.ok, reference.message
    legs = [(["parallel.dp_shard=4"], 4), (["parallel.dp_shard=2", "parallel.zero_stage=1", "parallel.tp=2"], 4),
            (["parallel.dp_replicate=2", "parallel.tp=2"], 4), (["parallel.pp=2"], 2), ([], None)]
    losses, layouts = [], []
    for i, (overrides, nproc) in enumerate(legs):
        resume = ["checkpoint.resume=true"] if i else []
        outcome = launch(load_config(None, [*base, *overrides, *resume, f"train.stop_after={3 * (i + 1)}"]),
                         tmp_path / "run", nproc)
        assert outcome.ok, outcome.message
        assert outcome.result["start_step"] == 3 * i and outcome.result["end_step"] == 3 * (i + 1)
        losses += outcome.result["losses"]
        layouts.append(outcome.result["layout"])
    assert layouts == ["dp_shard=4", "dp_shard=2 × tp=2", "dp_replicate=2 × tp=2", "pp=2", "single rank"]
    assert losses == pytest.approx(reference.result["losses"], abs=1e-5, rel=0)


def test_a_changed_global_batch_is_refused_with_the_reason(tmp_path: Path) -> None:
    """The data position counts global sequences: another dp size is fine, another global batch is not."""
    base = [*PARITY_BASE, "train.steps=4", "train.stop_after=2"]
    assert launch(load_config(None, base), tmp_path).ok
    outcome = launch(load_config(None, [*base, "train.global_batch=4", "checkpoint.resume=true"]), tmp_path)
    assert not outcome.ok
    assert outcome.failure["error"] == DataError.__name__
    assert "saved with global_batch=8, now 4" in outcome.message


def test_resuming_another_model_is_refused_naming_the_fields(tmp_path: Path) -> None:
    base = [*PARITY_BASE, "train.steps=2"]
    assert launch(load_config(None, base), tmp_path).ok
    outcome = launch(load_config(None, [*base, "model.n_layers=3", "checkpoint.resume=true"]), tmp_path)
    assert not outcome.ok and "holds another model" in outcome.message
    assert "model.n_layers: saved 2, now 3" in outcome.message
