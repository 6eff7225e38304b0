"""The `meshfit` command end to end, each in its own process: launches, the memory budget, bad input, data
sources."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from meshfit.commands.main import build_parser

pytestmark = pytest.mark.multiproc  # every test starts the command (and its ranks) as processes

TINY = ["--set", "model.preset=tiny", "--set", "train.steps=3", "--set", "train.seq_len=32"]


def meshfit(*args, cwd=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "meshfit", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def test_help_is_clear():
    text = build_parser().format_help()
    assert "train" in text and "demo" in text and "torchrun" in text
    train_help = meshfit("train", "--help").stdout
    for flag in ("--config", "--set", "--nproc", "--run-dir"):
        assert flag in train_help


@pytest.mark.timeout(240)
def test_budget_both_sides(tmp_path):
    over = meshfit("train", *TINY, "--set", "parallel.dp_replicate=2", "--nproc", "2",
                   "--set", "train.memory_budget=2MiB", "--run-dir", str(tmp_path / "over"))
    assert over.returncode != 0
    err = over.stderr.strip().splitlines()[-1]
    assert err.startswith("error: memory budget exceeded on rank ")
    assert re.search(r"during (forward|backward|optimizer step): needed .* \(\d+ bytes\)", err)
    assert "but the budget is 2.0 MiB (2097152 bytes)" in err
    for part in ("params", "grads", "optim", "activations", "other"):
        assert part in err
    ok = meshfit("train", *TINY, "--set", "parallel.dp_replicate=2", "--nproc", "2",
                 "--set", "train.memory_budget=64MiB", "--run-dir", str(tmp_path / "ok"))
    assert ok.returncode == 0, ok.stderr
    records = [json.loads(line) for line in (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for rec in records:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "peak_mem_bytes", "mem", "mfu"} <= set(rec)
        assert len(rec["mem"]) == 2 and rec["peak_mem_bytes"] == max(m["peak"] for m in rec["mem"])
        for m in rec["mem"]:
            assert {"params", "grads", "optim", "activations_other", "peak"} <= set(m)
            assert m["peak"] <= 64 * 2**20
    assert (tmp_path / "ok" / "config.yaml").read_text().count("memory_budget: 67108864") == 1


def test_bad_config_rejected_before_ranks_start(tmp_path):
    res = meshfit("train", *TINY, "--set", "parallel.dp_replicate=3", "--nproc", "2",
                  "--run-dir", str(tmp_path / "r"))
    assert res.returncode == 2
    assert "world size is 2" in res.stderr
    assert not (tmp_path / "r").exists()  # nothing was started
    assert meshfit("train", "--nproc", "0").returncode == 2


@pytest.mark.timeout(240)
def test_token_file_and_text_sources(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 256, size=5000).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", tokens)
    res = meshfit("train", *TINY, "--set", "data.source=tokens", "--set", f"data.path={tmp_path / 'tokens.npy'}",
                  "--run-dir", str(tmp_path / "a"))
    assert res.returncode == 0, res.stderr
    (tmp_path / "book.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    res = meshfit("train", *TINY, "--set", "data.source=text", "--set", f"data.path={tmp_path / 'book.txt'}",
                  "--set", "train.precision=bf16", "--run-dir", str(tmp_path / "b"))
    assert res.returncode == 0, res.stderr
    bad = tmp_path / "bad.npy"
    np.save(bad, np.full(100, 999, dtype=np.int32))
    res = meshfit("train", *TINY, "--set", "data.source=tokens", "--set", f"data.path={bad}",
                  "--run-dir", str(tmp_path / "c"))
    assert res.returncode != 0 and "bad.npy" in res.stderr and "999" in res.stderr


@pytest.mark.timeout(240)
def test_runs_under_an_outer_torchrun(tmp_path):
    """The multi-node path: plain torchrun starts the ranks, meshfit joins them."""
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "meshfit",
                          "train", *TINY, "--set", "parallel.dp_replicate=2", "--run-dir", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and len(records[0]["mem"]) == 2


@pytest.mark.timeout(240)
def test_budget_error_under_an_outer_torchrun(tmp_path):
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "meshfit",
                          "train", *TINY, "--set", "parallel.dp_replicate=2", "--set", "train.memory_budget=2MiB",
                          "--run-dir", str(tmp_path / "r")], capture_output=True, text=True, timeout=240)
    assert res.returncode != 0
    assert "memory budget exceeded on rank" in res.stderr
