"""Local ranks and the machine: more than it holds are refused before any starts (unless --oversubscribe),
and no rank outlives its launch, however the launch ends."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import meshfit.calibrate.measure
import meshfit.demo.run
import meshfit.train.launch
from meshfit.commands.main import main
from meshfit.train import capacity
from meshfit.util.ranks import RankFailed, run_ranks

GIB = 2**30


class Started(Exception):
    """A launcher was reached: ranks would have started."""


@pytest.fixture
def no_ranks(monkeypatch):
    """Every path that starts ranks raises Started instead; the machine has 2 cores and 20 GiB free."""
    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(meshfit.train.launch, "_launch_local", started)
    monkeypatch.setattr(meshfit.calibrate.measure, "calibrate", started)
    monkeypatch.setattr(meshfit.demo.run, "run_demo", started)
    monkeypatch.setattr(capacity, "usable_cores", lambda: 2)
    monkeypatch.setattr(capacity, "available_memory", lambda: 20 * GIB)


@pytest.mark.parametrize("command", [["train", "--nproc", "16"], ["calibrate", "--nproc", "16"],
                                     ["train", "--nproc", "100000"], ["calibrate", "--nproc", "100000"]])
def test_more_ranks_than_cores_are_refused_before_any_starts(no_ranks, capsys, tmp_path, command):
    assert main([*command, "--run-dir", str(tmp_path / "r")] if command[0] != "calibrate" else command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --nproc {command[2]}: this machine holds at most 8 "
                                               "local ranks at once (2 cores × 4 ranks per core)"), err
    assert "--oversubscribe" in err[0]
    assert not (tmp_path / "r").exists()


def test_the_demos_eight_rank_layout_counts(no_ranks, monkeypatch, capsys):
    monkeypatch.setattr(capacity, "usable_cores", lambda: 1)
    assert main(["demo", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "error: the demo's layouts run up to 8 ranks: this machine holds at most 4" in err


def test_memory_limits_ranks_too(no_ranks, monkeypatch, capsys):
    monkeypatch.setattr(capacity, "usable_cores", lambda: 64)
    monkeypatch.setattr(capacity, "available_memory", lambda: GIB)
    assert main(["calibrate", "--nproc", "16"]) == 2
    err = capsys.readouterr().err
    assert "holds at most 10 local ranks at once (1.0 GiB of available memory, at least 100.0 MiB per rank)" in err


@pytest.mark.parametrize("command", [["train", "--nproc", "16", "--set", "train.global_batch=16"],
                                     ["calibrate", "--nproc", "16"], ["demo", "--nproc", "4"]])
def test_oversubscribe_lets_them_start(no_ranks, monkeypatch, tmp_path, command):
    monkeypatch.setattr(capacity, "usable_cores", lambda: 1)  # 4 ranks at most: the demo's 8 are too many
    with pytest.raises(Started):
        main([*command, "--oversubscribe"] + (["--run-dir", str(tmp_path / "r")] if command[0] != "calibrate"
                                              else []))


def test_within_the_limit_nothing_is_refused(no_ranks, tmp_path):
    with pytest.raises(Started):
        main(["train", "--nproc", "8", "--run-dir", str(tmp_path / "r")])


# ---- no rank left behind -----------------------------------------------------------------------------


def _tagged(tag: str) -> list[int]:
    """Processes started with PROBE_TAG=tag in their environment (inherited by every descendant)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if f"PROBE_TAG={tag}".encode() in entry.joinpath("environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _gone(tag: str, within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:  # leave the machine clean whatever the test found
        os.kill(pid, signal.SIGKILL)
    return left


def _meshfit(tag: str, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshfit", *args], env=dict(os.environ, PROBE_TAG=tag, **env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("command, processes", [
    (["train", "--nproc", "2", "--set", "train.steps=500"], 3),  # the launcher and 2 ranks
    (["calibrate", "--nproc", "2"], 5),  # + multiprocessing's fork server and resource tracker
], ids=["train", "calibrate"])
def test_a_killed_launcher_takes_its_ranks_along(tmp_path, command, processes):
    """As when the out-of-memory killer picks the launcher: nothing is left waiting for it."""
    tag = uuid.uuid4().hex
    args = [*command, "--run-dir", str(tmp_path / "r")] if command[0] == "train" else command
    launcher = _meshfit(tag, *args)
    # Training ranks: once they train (the first step is logged); calibrate's: once forked.
    ready = (lambda: (tmp_path / "r" / "metrics.jsonl").exists()) if command[0] == "train" else (lambda: True)
    deadline = time.monotonic() + 120
    while not (len(_tagged(tag)) >= processes and ready()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_tagged(tag)) >= processes and ready(), "the ranks did not start"
    launcher.kill()
    launcher.wait()
    assert _gone(tag, within_s=10) == []


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault, said, last", [
    ("kill", "killing this rank at step 2", "killed by SIGKILL (the out-of-memory killer, or kill -9"),
    ("segfault", "reads address 0 at step 2", "killed by SIGSEGV (a crash in native code)"),
])
def test_a_failed_launch_leaves_no_process(tmp_path, fault, said, last):
    tag = uuid.uuid4().hex
    # Rank 1 dies at step 2; torch's agent then ends rank 0, and the launcher reports the failure.
    launcher = _meshfit(tag, "train", "--nproc", "2", "--set", "train.steps=4", "--run-dir", str(tmp_path / "r"),
                        MESHFIT_FAULT=f"{fault}:rank=1:step=2")
    _, err = launcher.communicate(timeout=150)
    assert launcher.returncode == 1 and said in err, err
    # The last line names the rank that died and its signal, before what the other rank then saw.
    assert err.strip().splitlines()[-1].startswith(f"error: rank 1 died, {last}"), err
    assert _gone(tag, within_s=5) == []


def _fail_on_rank_1(pid_dir: str) -> None:
    import torch.distributed as dist

    Path(pid_dir, str(os.getpid())).touch()
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")
    dist.barrier()  # rank 0 waits for a peer that never comes


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_run_ranks_ends_every_rank_when_one_fails(tmp_path):
    with pytest.raises(RankFailed, match="rank 1 fails"):
        run_ranks(_fail_on_rank_1, 2, str(tmp_path), timeout_s=60)
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert len(pids) == 2
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_ranks_started_before_a_failing_start_are_ended(tmp_path, monkeypatch):
    """The second rank cannot be started (as when the machine is out of processes or memory): the first,
    already running, is ended, and the launch fails with one message instead of a traceback."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    from meshfit.config import load_config
    from meshfit.train.launch import launch

    started = []
    real_popen = subprocess_handler.Popen

    def popen(*args, **kwargs):
        if started:
            raise OSError(11, "Resource temporarily unavailable")
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess_handler, "Popen", popen)
    outcome = launch(load_config(None, ["train.steps=2"]), tmp_path / "r", nproc=2)
    assert not outcome.ok
    assert outcome.message == "could not start 2 local ranks: [Errno 11] Resource temporarily unavailable"
    assert len(started) == 1 and started[0].poll() is not None  # ended (and reaped)
    assert not Path(f"/proc/{started[0].pid}").exists()
