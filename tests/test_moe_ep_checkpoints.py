"""Checkpoints of expert-parallel runs across layouts and out to Hugging Face: a tiny-moe run saved in one
process after 5 of 10 steps resumes under ep 2 on 2 ranks with the losses of the uninterrupted run (ep 2 →
ep 1 is in test_moe_expert_parallel.py), and a run saved under ep 2 exports with `meshfit export` to a
Qwen3-MoE folder whose transformers logits are the logits of the saved model read back under ep 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from dist_jobs import parity_config
from moe_ep_jobs import resume_and_export_job, save_halfway_job

from meshfit.commands.main import main
from meshfit.util.ranks import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

BASE = ["model.preset=tiny-moe", "model.moe_bias_update_rate=0.001"]
EP2 = ["parallel.dp_shard=2", "parallel.ep=2"]
# Exported: q/k norms per head make tiny-moe (first block dense) a Qwen3-MoE; no expert bias, which no
# Hugging Face MoE architecture routes with.
EXPORTED = ["model.preset=tiny-moe", "model.qk_norm=true", "train.steps=3", *EP2]


def test_one_process_run_resumes_under_ep2_and_an_ep2_checkpoint_exports_to_transformers(tmp_path: Path) -> None:
    # One process whose micro-batches are one rank's batch of the 2-rank run (see test_moe_expert_parallel).
    single = parity_config(*BASE, "train.micro_batch=4")
    ref = run_ranks(save_halfway_job, 1, single, str(tmp_path / "run"), 5, timeout_s=180)[0]
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    out = run_ranks(resume_and_export_job, 2, (parity_config(*BASE, *EP2), str(tmp_path / "run")),
                    (parity_config(*EXPORTED), str(tmp_path / "ep2")), tokens.tolist(), timeout_s=300)[0]

    assert len(ref["first"]) == 5 and len(out["resumed"]) == 5
    assert max(abs(a - b) for a, b in zip(ref["first"] + out["resumed"], ref["full"], strict=True)) <= 1e-5

    assert main(["export", str(tmp_path / "ep2"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3_moe"
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = back(input_ids=tokens).logits
    assert (logits - torch.from_numpy(out["logits"])).abs().max().item() < 1e-5
