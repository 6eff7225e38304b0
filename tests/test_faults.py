"""Faults on CPU ranks: a killed rank under restart, kills during saves, damaged checkpoints, NaN/Inf,
SIGTERM and a hung rank. Faults are injected with MESHFIT_FAULT (see meshfit.train.faults)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from dist_jobs import PARITY_BASE, nonfinite_cases_job, parity_config, train_job

from meshfit.config import ConfigError, load_config
from meshfit.train import checkpoint_store as store
from meshfit.train.launch import launch
from meshfit.util.ranks import run_ranks, snapshot

# Every test here starts rank processes (torchrun launches, subprocesses or forked children).
pytestmark = pytest.mark.multiproc

DDP = [*PARITY_BASE, "train.steps=30", "parallel.dp_replicate=2", "checkpoint.interval=2"]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _cli(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "meshfit", "train", *(x for item in overrides for x in ("--set", item))]


def _env(fault: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MESHFIT_FAULT"}
    if fault:
        env["MESHFIT_FAULT"] = fault
    return env


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """30 uninterrupted steps on 2 DDP ranks."""
    run_dir = tmp_path_factory.mktemp("reference")
    outcome = launch(load_config(None, DDP), run_dir, 2)
    assert outcome.ok, outcome.message
    return outcome.result["losses"]


@pytest.mark.timeout(240)
def test_a_killed_rank_restarts_and_ends_with_the_same_losses(tmp_path: Path, ddp_reference: list[float],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHFIT_FAULT", "kill:rank=1:step=7")
    outcome = launch(load_config(None, DDP), tmp_path, 2, max_restarts=1)
    assert outcome.ok, outcome.message
    assert outcome.result["attempt"] == 1 and outcome.result["start_step"] == 6  # last complete: step 6
    assert outcome.notes and "recovered" in outcome.notes[0]
    assert _losses(tmp_path) == ddp_reference  # steps 1–6 from the first attempt, 7–30 after the restart


@pytest.mark.timeout(240)
def test_sigterm_saves_and_exits_0(tmp_path: Path) -> None:
    proc = subprocess.Popen([*_cli(*DDP), "--nproc", "2", "--run-dir", str(tmp_path)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    result = json.loads((tmp_path / "result.json").read_text())
    stopped_at = result["end_step"]
    assert result["stopped"] == f"SIGTERM after step {stopped_at}" and stopped_at < 30
    assert result["status"] == "interrupted" and result["signal"] == "SIGTERM"
    assert store.verify(Path(result["checkpoint"]))["step"] == stopped_at
    # (that the run then resumes to the uninterrupted losses is checked after Ctrl-C, below)


@pytest.mark.timeout(240)
def test_ctrl_c_at_any_moment_ends_every_rank_without_a_traceback(tmp_path: Path,
                                                                    ddp_reference: list[float]) -> None:
    """Ctrl-C reaches the launcher and every rank (the terminal signals the whole process group): while
    the ranks start, nothing is written and the exit code is 130; mid-training every rank saves and the
    exit code is 130; the run then resumes to the uninterrupted run's losses."""
    def interrupt(ready: Callable[[], bool]) -> tuple[int, str]:
        proc = subprocess.Popen([*_cli(*DDP), "--nproc", "2", "--run-dir", str(tmp_path)], env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not ready():
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
        return proc.returncode, out

    def ranks_started() -> bool:  # the rank processes exist: they are importing torch (seconds) or building
        found = subprocess.run(["pgrep", "-f", f"meshfit.train.worker {tmp_path}"], capture_output=True)
        return found.returncode == 0

    code, out = interrupt(ranks_started)
    assert code == 130 and "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "interrupted (SIGINT)" in out and not (tmp_path / "metrics.jsonl").exists()
    metrics = tmp_path / "metrics.jsonl"
    code, out = interrupt(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3)
    assert code == 130 and "Traceback" not in out, out
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "interrupted" and result["signal"] == "SIGINT" and 3 <= result["end_step"] < 30
    assert f"stopped by SIGINT after step {result['end_step']}" in out
    resumed = subprocess.run([*_cli(*DDP), "--nproc", "2", "--run-dir", str(tmp_path), "--resume"], env=_env(),
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(tmp_path) == ddp_reference
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "finished"


def _train_in_child(run_dir: str, overrides: list[str], fault: str) -> None:
    """One rank in a child process, with MESHFIT_FAULT set (see test_kills_during_saves...)."""
    os.environ["MESHFIT_FAULT"] = fault
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the process ends below
    launch(load_config(None, overrides), Path(run_dir))
    os._exit(0)


@pytest.mark.timeout(300)
def test_kills_during_saves_never_leave_an_incomplete_checkpoint_to_resume(tmp_path: Path) -> None:
    """One rank, a checkpoint every step; 10 SIGKILLs at random points of a save (seeded), each followed by
    a resume; the final run's losses equal an uninterrupted run's. The ranks are forked from a server that
    has imported meshfit once (multiprocessing's forkserver), so each start takes a fraction of a second."""
    base = [*PARITY_BASE, "train.steps=14", "checkpoint.interval=1"]
    reference = launch(load_config(None, base), tmp_path / "reference")
    assert reference.ok
    save_s = max(reference.result["checkpoint_save_s"])
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["meshfit.train.launch", "meshfit.train.trainer"])
    rng = random.Random(7)
    run_dir, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    interrupted = 0
    for i in range(10):
        latest = store.complete_checkpoints(root)
        step = int(latest[0].name.removeprefix("step-")) + 1 if latest else 1
        fault = f"kill-in-save:rank=0:step={step}:delay={rng.uniform(0, save_s):.4f}"
        child = ctx.Process(target=_train_in_child,
                            args=(str(run_dir), [*base, *(["checkpoint.resume=true"] if i else [])], fault))
        child.start()
        child.join(timeout=120)
        assert child.exitcode == -signal.SIGKILL
        half_written = [f for _, f in store.step_folders(root) if not (f / store.MARKER).exists()]
        interrupted += bool(half_written)
        folder, _ = store.choose(root)
        assert folder is None or folder not in half_written
    # Several kills landed inside a save, before its marker (how many depends on the machine's load: the
    # delays are drawn from the reference run's save time).
    assert interrupted >= 3
    final = launch(load_config(None, [*base, "checkpoint.resume=true"]), run_dir)
    assert final.ok, final.message
    assert _losses(run_dir) == reference.result["losses"]


@pytest.mark.timeout(240)
def test_a_damaged_checkpoint_is_moved_aside_named_and_never_written_over(tmp_path: Path,
                                                                         capfd: pytest.CaptureFixture) -> None:
    """2 ranks; one flipped byte in rank 1's shard of the newest checkpoint (step 6). The resume names the
    file, moves the whole checkpoint (rank 0's intact shard too) to checkpoints/damaged/ with its bytes as
    they were, starts from step 4 (and its banner says so) and saves steps 6 and 8 in new folders. Ranks
    that choose without the launcher (as after a restart) do the same; a damaged pinned one is refused."""
    base = [*PARITY_BASE, "train.steps=6", "checkpoint.interval=2", "parallel.dp_shard=2"]
    assert launch(load_config(None, base), tmp_path, 2).ok
    latest = tmp_path / "checkpoints" / "step-00000006"
    shard = latest / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    damaged = {p.name: p.read_bytes() for p in latest.iterdir()}
    capfd.readouterr()
    resumed = launch(load_config(None, [*base, "train.steps=8", "checkpoint.resume=true"]), tmp_path, 2)
    assert resumed.ok and resumed.result["start_step"] == 4
    err = capfd.readouterr().err
    aside = tmp_path / "checkpoints" / "damaged" / "step-00000006"
    assert (f"warning: skipped the damaged checkpoint step-00000006 (checkpoint file {shard} is corrupt: its "
            f"SHA-256 differs from the one saved); resuming from step-00000004; moved it to {aside}") in err
    assert "steps up to 8 from step 5 of 8" in err  # the banner: the step the run really starts at
    assert {"__0_0.distcp", "__1_0.distcp", store.MARKER} <= set(damaged)
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == damaged
    assert [store.verify(tmp_path / "checkpoints" / f"step-0000000{n}")["step"] for n in (6, 8)] == [6, 8]
    assert not (tmp_path / "checkpoints" / "superseded").exists()  # not shelved: kept whatever keep_latest
    # Ranks that choose for themselves (restarted ones, no launcher check) move a damaged one aside alike.
    newest = tmp_path / "checkpoints" / "step-00000008"
    (newest / "__0_0.distcp").write_bytes(b"damaged")
    ranks = run_ranks(train_job, 2, parity_config(*base[len(PARITY_BASE):], "train.steps=10",
                                                  "checkpoint.resume=true"), str(tmp_path), timeout_s=200)
    assert ranks[0]["start_step"] == 6 and (tmp_path / "checkpoints" / "damaged" / "step-00000008").is_dir()
    newest = tmp_path / "checkpoints" / "step-00000010"
    marker = newest / store.MARKER
    marker.write_text(marker.read_text()[:40])  # a damaged marker, pinned: an error, no fallback
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=f"checkpoint file {marker} is corrupt"):  # before any rank starts
        launch(load_config(None, [*base, "train.steps=12", f"checkpoint.resume_from={newest}"]), tmp_path, 2)
    assert snapshot(tmp_path) == before


@pytest.mark.timeout(240)
def test_nan_or_inf_on_one_rank_stops_every_rank_or_skips_the_step() -> None:
    cases = [(parity_config("parallel.dp_replicate=2"), "nan-grad:rank=1:step=3"),
             (parity_config("parallel.dp_shard=2"), "inf-loss:rank=0:step=3"),
             (parity_config("parallel.dp_shard=2", "train.on_nonfinite=skip"), "nan-grad:rank=1:step=3")]
    ranks = run_ranks(nonfinite_cases_job, 2, cases, timeout_s=220)
    for case in (0, 1):  # stop: both ranks at step 3, parameters untouched, the bad rank named
        bad = "rank 1" if case == 0 else "rank 0"
        for rank in ranks:
            assert rank[case]["error_step"] == 3 and rank[case]["unchanged"]
            assert f"at step 3 on {bad}:" in rank[case]["error"]
    for rank in ranks:  # skip: step 3 skipped with parameters untouched, training goes on
        records = rank[2]["records"]
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        assert [bool(r["skipped"]) for r in records] == [False, False, True, False]
        assert rank[2]["unchanged"] and records[3]["loss"] == records[3]["loss"]  # finite again


@pytest.mark.timeout(120)
def test_a_hung_rank_makes_every_rank_exit_non_zero_within_the_timeout(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHFIT_FAULT", "hang:rank=1:step=3")
    cfg = load_config(None, [*PARITY_BASE, "parallel.dp_shard=2", "train.timeout_s=4"])
    outcome = launch(cfg, tmp_path, 2)
    assert not outcome.ok and outcome.failed_ranks == (0, 1)
    assert set(outcome.exit_codes) == {0, 1} and all(code != 0 for code in outcome.exit_codes.values())
    assert "made no progress for 4 s during step 3" in outcome.message
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reports = [json.loads((tmp_path / "failures" / f"rank{r}.json").read_text()) for r in (0, 1)]
    # Each rank gave up at most the timeout (plus scheduling slack) after the last completed step.
    assert all(r["time"] - steps[-1]["time"] < 4 + 3 for r in reports)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_save_that_fails_removes_its_folder_keeps_the_others_and_records_the_failure(
        tmp_path: Path, background: bool) -> None:
    """A full disk during the save after step 4 (on rank 1, as the other rank writes on): one `error:` line,
    no partial folder, step 2's checkpoint intact and resumable, result.json says why."""
    run_dir = tmp_path / "run"
    done = subprocess.run([*_cli("train.steps=6", "checkpoint.interval=2", f"checkpoint.async_save={background}"),
                           "--nproc", "2", "--run-dir", str(run_dir)], env=_env("disk-full-in-save:rank=1:step=4"),
                          capture_output=True, text=True, timeout=200)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and len(errors) == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip().splitlines()[-1] == errors[0]
    assert f"could not be written to {run_dir / 'checkpoints' / 'step-00000004'}: [Errno 28] No space left on " \
           "device (rank 1); its partial folder was removed, the checkpoints of steps 2 are kept" in errors[0]
    assert [number for number, _ in store.step_folders(run_dir / "checkpoints")] == [2]
    store.verify(store.step_dir(run_dir / "checkpoints", 2))  # intact: every file against its SHA-256
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and "[Errno 28] No space left on device" in result["error"]
    assert not (run_dir / ".result.json.tmp").exists()
