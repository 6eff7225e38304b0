"""One process at a time in a run directory: a second start is refused naming the process that runs there,
nothing of the active run is touched, and a lock left by a killed process blocks nothing."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshfit.commands.main import main
from meshfit.train import checkpoint_store as store
from meshfit.util import run_lock

HOLD_AND_DIE = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, b'{"pid": %d, "host": "h", "started_at": 0, "command": "meshfit train"}' % os.getpid())
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_held_directory_is_refused_naming_its_holder(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    with run_lock.hold(run_dir):
        holder = json.loads((run_dir / run_lock.LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(run_lock.RunDirBusy, match=rf"--run-dir {run_dir} is in use by another meshfit run: "
                                                      rf"pid {os.getpid()} on "):
            with run_lock.hold(run_dir):
                pass
    assert not (tmp_path / "runs").exists()  # made for the lock, left empty: removed again


def test_a_lock_left_by_a_killed_process_blocks_nothing(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    died = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, str(run_dir / run_lock.LOCK_FILE)])
    assert died.returncode == -signal.SIGKILL
    assert (run_dir / run_lock.LOCK_FILE).exists()  # its file stays; the kernel dropped its lock
    with run_lock.hold(run_dir):
        assert json.loads((run_dir / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("flags", [["--overwrite"], ["--resume"], []])
def test_train_into_a_held_directory_is_refused_before_it_reads_anything(tmp_path, capsys, flags):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    with run_lock.hold(run_dir):
        code = main(["train", "--set", "train.steps=1", "--run-dir", str(run_dir), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --run-dir {run_dir} is in use by another meshfit run: pid {os.getpid()}")
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def _start(run_dir: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshfit", "train", "--nproc", "2", "--set",
                             "train.steps=100000", "--set", "checkpoint.interval=2", "--run-dir", str(run_dir),
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_second_launch_cannot_touch_a_running_one(tmp_path):
    run_dir = tmp_path / "r"
    first = _start(run_dir)
    try:
        deadline = time.monotonic() + 120
        while _steps(run_dir) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _steps(run_dir) >= 3, "the first run did not train"
        for flags in (["--overwrite"], ["--resume"]):
            second = _start(run_dir, *flags)
            _, err = second.communicate(timeout=120)
            lines = err.strip().splitlines()
            assert second.returncode == 2 and len(lines) == 1, err
            assert f"in use by another meshfit run: pid {first.pid} on " in lines[0], lines[0]
        assert first.poll() is None, "the first run was disturbed"
        steps = _steps(run_dir)
        time.sleep(1)
        assert _steps(run_dir) > steps  # still training, its metrics growing
    finally:
        first.kill()  # as the out-of-memory killer would: no clean-up, the lock file stays
        first.wait()
    # Its ranks end with it (util/lifeline.py); the kernel dropped its lock: a resume starts.
    newest = max(number for number, _ in store.step_folders(run_dir / "checkpoints"))
    resumed = subprocess.run([sys.executable, "-m", "meshfit", "train", "--nproc", "2", "--set",
                              f"train.steps={newest + 1}", "--set", "checkpoint.interval=2", "--run-dir",
                              str(run_dir), "--resume"], capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "result.json").read_text())["end_step"] == newest + 1
    assert not (run_dir / run_lock.LOCK_FILE).exists()  # removed when the resumed run ended
