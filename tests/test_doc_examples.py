"""Every command of README.md and docs/*.md that launches training runs as written, at tiny scale.

Each command is quoted here as the documentation writes it (the test checks the quote is still there), then
run with the documentation's placeholders filled in for one machine: one node of 2 ranks, a free port for
the rendezvous, a run.toml of the tiny model, and `--set train.steps=…` / `train.stop_after` appended where a
command would otherwise train for its default number of steps. One torchrun launch starts the run that the
checkpoint examples then resume; the demo (also documented) has its own test, tests/test_demo.py.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshfit.util.ranks import free_port

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[1]
DOCS = {path.relative_to(ROOT).as_posix(): path.read_text()
        for path in (ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")))}

RUN_TOML = """\
[model]
preset = "tiny"
[train]
steps = 6
seq_len = 32
[checkpoint]
interval = 1
keep_latest = 10
"""

# As documented (continuation lines joined).
TORCHRUN = ('torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint '
            '"$head:29500" --rdzv-id "$SLURM_JOB_ID" -m meshfit train --config run.toml --run-dir '
            '"runs/$SLURM_JOB_ID"')
TORCHRUN_MULTINODE = ("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 "
                      "--rdzv-id my-run -m meshfit train --config run.toml --run-dir /shared/runs/my-run")
RESUME = "meshfit train --config run.toml --run-dir runs/exp1 --resume"
RESUME_TP = "meshfit train --config run.toml --run-dir runs/exp1 --resume --nproc 4 --set parallel.tp=2"
RESUME_FROM = ("meshfit train --config run.toml --run-dir runs/exp1 --resume-from "
               "runs/exp1/checkpoints/step-00000200")
PLAN = "meshfit plan --model tiny --gpus-per-node 2 --seq-len 64 --global-batch 8 --precision fp32 --out plan.json"
TRAIN_PLAN = "meshfit train --plan plan.json --nproc 2"
TENSORBOARD = "meshfit train --set metrics.tensorboard=true --run-dir runs/exp1"
EXPORT = "meshfit export runs/exp1 --out hf/exp1"
INIT_FROM = "meshfit train --set model.init_from=hf/exp1"
EVAL = "meshfit eval runs/exp1 --data val.npy --seq-len 256 --windows 8"
EVAL_HF = "meshfit eval hf/exp1 --data val.npy --seq-len 256 --windows 8 --nproc 2 --layout tp=2 --json"


def _documented(command: str) -> None:
    joined = {name: re.sub(r"\s*\\\n\s*", " ", text) for name, text in DOCS.items()}
    assert any(command in text for text in joined.values()), f"no longer documented: {command}"


def _run(command: str, cwd: Path, *extra: str, timeout: int = 240, as_run: str = "") -> subprocess.CompletedProcess:
    """Run a documented `command` (or `as_run`, the same with its placeholders filled in) with `extra`."""
    _documented(command)
    words = (as_run or command).split()
    if words[0] == "meshfit":
        words = [sys.executable, "-m", "meshfit", *words[1:]]
    elif words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    return subprocess.run([*words, *extra], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _one_node(command: str, job: str) -> str:
    """The torchrun command on this machine: one node, 2 ranks, a free port on localhost."""
    return (command.replace('"$SLURM_NNODES"', "1").replace("--nnodes 2", "--nnodes 1")
            .replace("--nproc-per-node 8", "--nproc-per-node 2").replace('"$head:29500"', f"127.0.0.1:{free_port()}")
            .replace("$HEAD_NODE:29500", f"127.0.0.1:{free_port()}").replace('"$SLURM_JOB_ID"', job)
            .replace('"runs/$SLURM_JOB_ID"', f"runs/{job}").replace("/shared/runs/my-run", f"runs/{job}"))


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_torchrun_and_checkpoint_examples(tmp_path):
    """Slurm's torchrun starts runs/exp1 (2 ranks, 2 steps) with the default degrees; the checkpoint
    examples continue it: one rank, then 4 ranks with tp=2, then from an earlier checkpoint."""
    (tmp_path / "run.toml").write_text(RUN_TOML)
    _documented(TORCHRUN_MULTINODE)  # the same launch as Slurm's, with another rendezvous id
    res = _run(TORCHRUN, tmp_path, "--set", "train.stop_after=2", timeout=300, as_run=_one_node(TORCHRUN, "exp1"))
    assert res.returncode == 0, res.stderr
    assert "layout dp_shard=2, zero_stage=3, 2 ranks" in res.stderr
    done = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("done:")]
    assert done == ["done: steps 1–2, final loss " + done[0].split("final loss ")[1]], done  # once, rank 0's
    run = tmp_path / "runs" / "exp1"
    res = _run(RESUME, tmp_path, "--set", "train.stop_after=3")
    assert res.returncode == 0 and "done: steps 3–3" in res.stdout, res.stderr
    res = _run(RESUME_TP, tmp_path)
    assert res.returncode == 0 and "done: steps 4–6" in res.stdout, res.stderr
    assert "layout dp_shard=2 × tp=2, zero_stage=3, 4 ranks" in res.stderr
    # The documented folder names step 200 of a longer run; this run's step 4 stands in for it.
    res = _run(RESUME_FROM, tmp_path, as_run=RESUME_FROM.replace("step-00000200", "step-00000004"))
    assert res.returncode == 0 and "done: steps 5–6" in res.stdout, res.stderr
    assert _steps(run) == [1, 2, 3, 4, 5, 6]
    res = _run(EXPORT, tmp_path)
    assert res.returncode == 0, res.stderr
    # The run's latest checkpoint and its export, on 8 windows of a token file, in one process and under TP 2.
    np.save(tmp_path / "val.npy", np.arange(8 * 256 + 1, dtype=np.uint16) % 256)
    res = _run(EVAL, tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("loss ") and "over 8 windows × 256 tokens" in res.stdout, \
        res.stderr
    exported = json.loads(_run(EVAL_HF, tmp_path).stdout)
    assert exported["world_size"] == 2 and f"loss {exported['loss']:.4f} " in res.stdout
    res = _run(INIT_FROM, tmp_path, "--set", "train.steps=1", "--run-dir", "runs/init")
    assert res.returncode == 0 and "done: steps 1–1" in res.stdout, res.stderr


@pytest.mark.timeout(400)
def test_plan_tensorboard_and_default_nproc_examples(tmp_path):
    assert _run(PLAN, tmp_path).returncode == 0
    res = _run(TRAIN_PLAN, tmp_path, "--set", "train.steps=2")
    assert res.returncode == 0 and "done: steps 1–2" in res.stdout, res.stderr
    res = _run(TENSORBOARD, tmp_path, "--set", "train.steps=2")
    assert res.returncode == 0 and list((tmp_path / "runs" / "exp1" / "tensorboard").iterdir()), res.stderr
    # `--nproc N` with the default config: data parallelism takes the ranks (dp_shard, ZeRO-3).
    res = subprocess.run([sys.executable, "-m", "meshfit", "train", "--nproc", "2", "--set", "train.steps=2",
                          "--run-dir", "runs/default"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0 and "layout dp_shard=2, zero_stage=3, 2 ranks" in res.stderr, res.stderr


@pytest.mark.timeout(300)
def test_under_torchrun_the_last_lines_are_meshfits(tmp_path):
    """Degrees that do not fit the world size: torchrun's summary ends with meshfit's line as the cause."""
    (tmp_path / "run.toml").write_text(RUN_TOML)
    res = _run(TORCHRUN_MULTINODE, tmp_path, "--set", "parallel.tp=4", as_run=_one_node(TORCHRUN_MULTINODE, "bad"))
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    cause = lines[lines.index("Root Cause (first observed failure):"):]
    assert cause[-1].startswith("=====") and cause[-2].startswith("  traceback : error: parallel.dp_shard is "
                                                                  "unset"), cause
    assert "world size is 2" in cause[-2]
    assert not (tmp_path / "runs" / "bad").exists()
