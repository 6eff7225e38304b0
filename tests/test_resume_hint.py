"""The stop line's resume command works as printed, however the run was started (--set, --config, --plan):
a resume given neither --config nor --plan continues with the run's own config.yaml."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest


def _meshfit(*args: str, fault: str = "", cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MESHFIT_FAULT"}
    if fault:
        env["MESHFIT_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "meshfit", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=200)


def _start_args(way: str, tmp_path: Path) -> list[str]:
    small = ["model.preset=small", "model.n_layers=2", "train.seq_len=32", "train.steps=4"]
    if way == "set":
        return [*(x for item in small for x in ("--set", item)), "--nproc", "2"]
    if way == "config":
        (tmp_path / "run.yaml").write_text("model:\n  preset: small\n  n_layers: 2\n"
                                           "train:\n  seq_len: 32\n  steps: 4\n")
        return ["--config", str(tmp_path / "run.yaml")]
    plan = _meshfit("plan", "--model", "tiny", "--gpus-per-node", "2", "--seq-len", "64", "--global-batch", "8",
                    "--precision", "fp32", "--layout", "dp_shard=2,zero_stage=3", "--out",
                    str(tmp_path / "plan.json"), cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    return ["--plan", str(tmp_path / "plan.json"), "--set", "train.steps=4", "--nproc", "2"]


@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("way", ["set", "config", "plan"])
def test_the_printed_resume_command_continues_the_run(tmp_path: Path, way: str) -> None:
    run_dir = tmp_path / "run"
    stopped = _meshfit("train", *_start_args(way, tmp_path), "--run-dir", str(run_dir),
                       fault="sigterm:rank=0:step=2", cwd=tmp_path)
    assert stopped.returncode == 0, stopped.stderr
    line = stopped.stdout.strip().splitlines()[-1]
    found = re.search(r"continue with (meshfit train .*)$", line)
    assert line.startswith("stopped by SIGTERM after step 2") and found, line
    command = shlex.split(found.group(1))
    assert command[:3] == ["meshfit", "train", "--resume"] and ("--nproc" in command) == (way != "config")
    resumed = _meshfit(*command[1:], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"--resume: the run's own settings from {run_dir / 'config.yaml'}" in resumed.stderr
    assert resumed.stdout.strip().splitlines()[-1].startswith("done: steps 3–4"), resumed.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["start_step"], result["end_step"]) == (2, 4)
