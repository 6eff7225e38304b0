"""A Mixture-of-Experts model trains alike on one process and over 2 data-parallel ranks (ZeRO-3, DDP,
ZeRO-3 with every block recomputed): the same losses and gradient norms (fp32, dropless, ≤ 1e-5), the
same tokens per expert and auxiliary loss in every step record. The expert bias is on, so a count summed
over the wrong ranks would change the routing of the next steps."""

import functools
import json
from pathlib import Path

import pytest
from dist_jobs import parity_config, train_job

from meshfit.util.ranks import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

BASE = ["model.preset=tiny-moe", "model.moe_bias_update_rate=0.001"]
LAYOUTS = {
    "zero3": ["parallel.dp_shard=2", "parallel.zero_stage=3"],
    "ddp": ["parallel.dp_replicate=2", "parallel.zero_stage=0"],
    "zero3-ac-full": ["parallel.dp_shard=2", "parallel.activation_checkpointing=full"],
}


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@functools.cache
def _reference(root: str) -> dict:
    # One process, two micro-batches of four: each holds what one of the two ranks holds (the
    # load-balancing loss is a micro-batch's).
    return run_ranks(train_job, 1, parity_config(*BASE, "train.micro_batch=4"), f"{root}/ref")[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_train_as_one_process(tmp_path_factory: pytest.TempPathFactory, layout: str) -> None:
    root = str(tmp_path_factory.getbasetemp() / "moe-layouts")
    ref = _reference(root)
    run = run_ranks(train_job, 2, parity_config(*BASE, *LAYOUTS[layout]), f"{root}/{layout}")[0]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(run["grad_norms"], ref["grad_norms"], strict=True)) <= 1e-5
    ours, theirs = _records(Path(root) / layout), _records(Path(root) / "ref")
    assert [r["moe_tokens_max"] for r in ours] == [r["moe_tokens_max"] for r in theirs]
    assert sum(ours[0]["moe_tokens_mean"]) * 8 == 8 * 64 * 2  # every copy of the global batch counted once
    for a, b in zip(ours, theirs, strict=True):
        assert a["moe_aux_loss"] == pytest.approx(b["moe_aux_loss"], abs=1e-6) and a["moe_aux_loss"] > 0
