"""W&B and MLflow beside metrics.jsonl (metrics.wandb, metrics.mlflow): the same scalars as TensorBoard at each
step, the config once, the same tracker run continued by --resume and a new one after --overwrite, and a
missing package refused before any rank starts. Offline: W&B in WANDB_MODE=offline, MLflow in a file store."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshfit.commands.main import main
from meshfit.config import load_config
from meshfit.train.metrics import tensorboard_scalars
from meshfit.train.trackers import TRACKERS_FILE, record_id, recorded_id

TINY = ["--set", "model.preset=tiny", "--set", "train.seq_len=32", "--set", "train.steps=4"]
TRACKER_ENV = ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR", "WANDB_MODE", "WANDB_QUIET", "WANDB_BASE_URL",
               "WANDB_API_KEY", "WANDB_INIT_TIMEOUT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME",
               "MLFLOW_ALLOW_FILE_STORE")


@pytest.fixture
def tracker_env(monkeypatch):
    """None of the trackers' variables from outside; whatever a test or meshfit sets is undone after it."""
    for key in TRACKER_ENV:
        monkeypatch.setenv(key, "")  # recorded as absent before, so undone to absent
        monkeypatch.delenv(key)
    return monkeypatch


def _train(run: Path, *flags: str) -> None:
    assert main(["train", *TINY, "--run-dir", str(run), *flags]) == 0


def _train_then_resume(run: Path, logger: str) -> tuple[list[dict], str]:
    """Steps 1-2, then --resume for steps 3-4; metrics.jsonl's records and the recorded tracker run id."""
    _train(run, "--set", f"metrics.{logger}=true", "--set", "train.stop_after=2")
    first = json.loads((run / TRACKERS_FILE).read_text())[logger]["id"]
    _train(run, "--resume", "--set", "train.stop_after=null")
    assert json.loads((run / TRACKERS_FILE).read_text())[logger]["id"] == first
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    return records, first


def _expected(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Each scalar's (step, value) points as metrics.jsonl has them, under TensorBoard's tags."""
    points: dict[str, list[tuple[int, float]]] = {}
    for rec in records:
        for tag, value in tensorboard_scalars(rec).items():
            points.setdefault(tag, []).append((rec["step"], value))
    return points


def test_missing_package_is_one_error_line_before_the_ranks_start(tmp_path, capsys, monkeypatch):
    installs = {"wandb": "pip install 'meshfit[wandb]'", "mlflow": "pip install 'meshfit[mlflow]'",
                "tensorboard": "pip install tensorboard"}
    for logger, install in installs.items():
        monkeypatch.setitem(sys.modules, logger, None)  # its import refused, as if not installed
        run = tmp_path / logger
        code = main(["train", *TINY, "--set", f"metrics.{logger}=true", "--run-dir", str(run)])
        assert code == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: metrics.{logger}=true needs the {logger} package: {install} (or set metrics.{logger}=false)"]
        assert not run.exists()  # refused before anything was written


def test_config_keys_default_off_and_named():
    metrics = load_config().metrics
    assert (metrics.wandb, metrics.mlflow, metrics.wandb_project, metrics.mlflow_tracking_uri) == (False, False,
                                                                                                     None, None)
    cfg = load_config(None, ["metrics.wandb=true", "metrics.wandb_project=llm", "metrics.run_name=a"])
    assert (cfg.metrics.wandb, cfg.metrics.wandb_project, cfg.metrics.run_name) == (True, "llm", "a")


def test_a_run_moved_to_another_project_starts_a_new_tracker_run(tmp_path, capsys):
    record_id(tmp_path, "wandb", "abc", {"project": "p", "entity": None})
    record_id(tmp_path, "mlflow", "xyz", {"tracking_uri": "file:///s", "experiment": "e"})
    assert recorded_id(tmp_path, "wandb", {"project": "p", "entity": None}) == "abc"
    assert recorded_id(tmp_path, "mlflow", {"tracking_uri": "file:///s", "experiment": "e"}) == "xyz"
    assert recorded_id(tmp_path, "wandb", {"project": "q", "entity": None}) is None
    assert "metrics.wandb: this run logged to {'project': 'p'" in capsys.readouterr().err
    assert recorded_id(tmp_path / "elsewhere", "wandb", {"project": "p", "entity": None}) is None


@pytest.mark.timeout(240)
def test_mlflow_logs_each_step_and_a_resume_continues_its_run(tmp_path, tracker_env):
    from mlflow.tracking import MlflowClient

    run = tmp_path / "ml"
    records, run_id = _train_then_resume(run, "mlflow")
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())  # the default store
    expected = _expected(records)
    assert {"train/loss", "train/lr", "perf/tokens_per_s", "memory/peak_mem_bytes"} <= set(expected)
    for tag, points in expected.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, tag)] == points, tag
    logged = client.get_run(run_id)
    assert (logged.info.status, logged.info.run_name) == ("FINISHED", "ml")
    # The config once, as the run began (MLflow refuses a param to change): stop_after of the first launch.
    assert logged.data.params["train.stop_after"] == "2" and logged.data.params["model.preset"] == "tiny"
    experiment = client.get_experiment_by_name("meshfit")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]

    # A store outside the run directory outlives --overwrite: the new run is a new MLflow run there.
    shared = MlflowClient(tracking_uri=(tmp_path / "store").as_uri())
    for flag in ("--resume", "--overwrite"):
        _train(run, flag, "--set", "metrics.mlflow=true", "--set", f"metrics.mlflow_tracking_uri={tmp_path / 'store'}",
               "--set", "train.steps=5")
    runs = shared.search_runs([shared.get_experiment_by_name("meshfit").experiment_id])
    assert len(runs) == 2 and run_id not in {r.info.run_id for r in runs}
    assert json.loads((run / TRACKERS_FILE).read_text())["mlflow"]["id"] == runs[0].info.run_id  # the newest
    assert not (run / "mlruns").exists()  # the replaced run's own store went with it


def _wandb_records(wandb_dir: Path) -> list[tuple[str, list[dict]]]:
    """(folder, its records) of each offline run W&B wrote, oldest first, read by W&B's own reader."""
    out = []
    for folder in sorted((wandb_dir / "wandb").glob("offline-run-*")):
        read = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)],
                              capture_output=True, text=True, timeout=60, check=True)
        out.append((folder.name, [json.loads(line) for line in read.stdout.splitlines()]))
    return out


@pytest.mark.multiproc  # wandb.init starts W&B's own service process
@pytest.mark.timeout(240)
def test_wandb_offline_logs_each_step_and_a_resume_continues_its_run(tmp_path, tracker_env):
    tracker_env.setenv("WANDB_MODE", "offline")
    tracker_env.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))
    (tmp_path / "wandb-files").mkdir()
    import wandb

    try:
        records, run_id = _train_then_resume(tmp_path / "wb", "wandb")
    finally:
        wandb.teardown()  # W&B's service process ends with its session, as when a rank exits
    launches = _wandb_records(tmp_path / "wandb-files")
    assert len(launches) == 2 and all(name.endswith(f"-{run_id}") for name, _ in launches)
    runs = [next(r["run"] for r in recs if r["type"] == "run") for _, recs in launches]
    assert [r["run_id"] for r in runs] == [run_id, run_id]
    assert [(r["project"], r["display_name"]) for r in runs] == [("meshfit", "wb")] * 2
    # The config once, when the W&B run was created.
    assert runs[0]["config"]["update"]["train"]["stop_after"] == 2
    assert "train" not in runs[1].get("config", {}).get("update", {})
    history = [r["history"]["item"] for _, recs in launches for r in recs if r["type"] == "history"]
    assert [item["_step"] for item in history] == [1, 2, 3, 4]
    for tag, points in _expected(records).items():
        assert [(item["_step"], item[tag]) for item in history if tag in item] == points, tag


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once it is closed


# W&B reads its variables once per process: a process of its own, as a rank is.
START_WANDB = ("import sys; from meshfit.config import load_config; from meshfit.train.trackers import WandbRun; "
               "WandbRun(load_config(None, ['metrics.wandb=true']), sys.argv[1])")


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_unreachable_wandb_server_fails_the_start_naming_offline_mode(tmp_path, tracker_env):
    tracker_env.setenv("WANDB_MODE", "online")
    tracker_env.setenv("WANDB_API_KEY", "0" * 40)
    tracker_env.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    tracker_env.setenv("WANDB_INIT_TIMEOUT", "2")
    began = time.monotonic()
    res = subprocess.run([sys.executable, "-c", START_WANDB, str(tmp_path)], capture_output=True, text=True,
                         timeout=100)
    assert res.returncode != 0
    assert re.search(r"RuntimeError: metrics\.wandb: W&B could not start run \w+: .*WANDB_MODE=offline", res.stderr)
    assert time.monotonic() - began < 60  # not wandb's default wait of 90 s (WANDB_INIT_TIMEOUT) or more
