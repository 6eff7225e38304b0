"""Weights & Biases and MLflow beside metrics.jsonl (metrics.wandb, metrics.mlflow), on rank 0 only.

Each tracker gets every step's scalars under TensorBoard's tags (metrics.tensorboard_scalars), and the
run's config once, when its run is created. The tracker's run id is kept in RUN_DIR/trackers.json, written
before the tracker's run starts and replaced whole: a resumed run (--resume, or torchrun restarting the
ranks after one died) continues the same tracker run; --overwrite removes the file with the rest of the run,
so the new run starts a new one. The packages are imported only here and only when asked for;
`check_installed` names a missing one before any rank starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from meshfit.config import Config, ConfigError
from meshfit.config.sections import MetricsSection
from meshfit.util.jsonfile import json_object_or_none

TRACKERS_FILE = "trackers.json"  # {"wandb": {"id": …, "project": …, "entity": …}, "mlflow": {…}}
MLFLOW_STORE = "mlruns"  # the default MLflow store, in the run directory
# What the trackers leave in a run directory (wandb.init names its folder "wandb"), removed by --overwrite.
RUN_DIR_ENTRIES = (TRACKERS_FILE, "wandb", MLFLOW_STORE)
# Config key -> (the module it needs, what installs it).
PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard"),
            "wandb": ("wandb", "pip install 'meshfit[wandb]'"),
            "mlflow": ("mlflow", "pip install 'meshfit[mlflow]'")}
OFFLINE_HINT = ("where the W&B server cannot be reached, set WANDB_MODE=offline and upload the run later with "
                "`wandb sync`")


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float], walltime: float | None) -> None: ...

    def close(self, ok: bool) -> None: ...


def missing_message(key: str) -> str:
    module, install = PACKAGES[key]
    return f"metrics.{key}=true needs the {module} package: {install} (or set metrics.{key}=false)"


def check_installed(metrics: MetricsSection) -> None:
    """ConfigError naming the first logger asked for whose package is not installed (nothing imported)."""
    for key, (module, _) in PACKAGES.items():
        if getattr(metrics, key) and not _installed(module):
            raise ConfigError(missing_message(key))


def _installed(module: str) -> bool:
    if module in sys.modules:  # None there: an import Python is told to refuse
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def open_trackers(cfg: Config, run_dir: Path) -> list[Tracker]:
    """The trackers `cfg.metrics` asks for, their runs started (or continued, see the module's note)."""
    opened: list[Tracker] = []
    try:
        if cfg.metrics.wandb:
            opened.append(WandbRun(cfg, run_dir))
        if cfg.metrics.mlflow:
            opened.append(MlflowRun(cfg, run_dir))
    except BaseException:
        for tracker in opened:
            tracker.close(ok=False)
        raise
    return opened


def run_name(cfg: Config, run_dir: Path) -> str:
    return cfg.metrics.run_name or Path(run_dir).resolve().name


def recorded_id(run_dir: Path, key: str, place: dict[str, Any]) -> str | None:
    """The run id trackers.json keeps for `key`'s tracker in `place` (project, store); None when there is
    none, or when the config now points elsewhere: that run cannot be continued there, a new one starts."""
    entry = (json_object_or_none(Path(run_dir) / TRACKERS_FILE) or {}).get(key)
    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
        return None
    before = {name: entry.get(name) for name in place}
    if before != place:
        print(f"note: metrics.{key}: this run logged to {before}, now {place}: a new run starts there",
              file=sys.stderr, flush=True)
        return None
    return entry["id"]


def record_id(run_dir: Path, key: str, run_id: str, place: dict[str, Any]) -> None:
    """Keep `run_id` for `key`'s tracker in trackers.json, replacing the file whole (never half-written)."""
    path = Path(run_dir) / TRACKERS_FILE
    doc = {**(json_object_or_none(path) or {}), key: {"id": run_id, **place}}
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)


def flat_params(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: `section.key` -> its value as the config files spell it."""
    out: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out


class WandbRun:
    """A W&B run: project and entity from metrics.wandb_*, files under RUN_DIR/wandb (or $WANDB_DIR).

    WANDB_MODE=offline writes the run there without a server (`wandb sync` uploads it later); each launch
    of a resumed run adds a folder with the same run id there."""

    def __init__(self, cfg: Config, run_dir: Path):
        import wandb

        place = {"project": cfg.metrics.wandb_project or os.environ.get("WANDB_PROJECT") or "meshfit",
                 "entity": cfg.metrics.wandb_entity or os.environ.get("WANDB_ENTITY")}
        run_id = recorded_id(run_dir, "wandb", place)
        fresh = run_id is None
        if fresh:  # chosen here and recorded first: a launch that dies while W&B starts is continued alike
            run_id = secrets.token_hex(6)
            record_id(run_dir, "wandb", run_id, place)
        # Quiet: W&B's closing table of every metric repeats the step lines (WANDB_QUIET=false keeps it).
        settings = wandb.Settings(quiet=True) if "WANDB_QUIET" not in os.environ else None
        try:
            self.run = wandb.init(id=run_id, resume="allow", name=run_name(cfg, run_dir),
                                  dir=None if os.environ.get("WANDB_DIR") else str(run_dir), settings=settings,
                                  config=cfg.model_dump(mode="json") if fresh else None, **place)
        except Exception as exc:  # noqa: BLE001 - wandb raises its own kinds (CommError, UsageError, …)
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RuntimeError(f"metrics.wandb: W&B could not start run {run_id}: {reason}; {OFFLINE_HINT}") \
                from exc

    def log(self, step: int, scalars: dict[str, float], walltime: float | None) -> None:
        # W&B keeps one value per step: steps a restart repeats keep the first attempt's values there.
        self.run.log(scalars, step=step)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


def _local_store(uri: str) -> bool:
    return urlparse(uri).scheme in ("", "file")


class MlflowRun:
    """An MLflow run through MlflowClient (no global active run): tracking URI and experiment from
    metrics.mlflow_*, by default a file store in RUN_DIR/mlruns."""

    def __init__(self, cfg: Config, run_dir: Path):
        uri = (cfg.metrics.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
               or (Path(run_dir) / MLFLOW_STORE).resolve().as_uri())
        if _local_store(uri):
            # MLflow 3 keeps its file store only on request: a local store is what was asked for here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        place = {"tracking_uri": uri,
                 "experiment": cfg.metrics.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "meshfit"}
        self.client = MlflowClient(tracking_uri=uri)
        run_id = recorded_id(run_dir, "mlflow", place)
        try:
            if run_id is None:
                self.run_id = self._create(cfg, run_dir, place)
            else:
                self.run_id = run_id
                self.client.update_run(run_id, status="RUNNING")
        except Exception as exc:  # noqa: BLE001 - MlflowException, or the HTTP client's errors
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RuntimeError(f"metrics.mlflow: MLflow at {uri} could not "
                               f"{'start a run' if run_id is None else f'continue run {run_id}'}: {reason}") \
                from exc

    def _create(self, cfg: Config, run_dir: Path, place: dict[str, Any]) -> str:
        from mlflow.entities import Param

        experiment = self.client.get_experiment_by_name(place["experiment"])
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(place["experiment"])
        run_id = self.client.create_run(experiment_id, run_name=run_name(cfg, run_dir)).info.run_id
        record_id(run_dir, "mlflow", run_id, place)
        # Once: MLflow refuses a param's value to change (a resumed run's settings are in config.yaml).
        params = flat_params(cfg.model_dump(mode="json"))
        self.client.log_batch(run_id, params=[Param(key, value) for key, value in params.items()])
        return run_id

    def log(self, step: int, scalars: dict[str, float], walltime: float | None) -> None:
        from mlflow.entities import Metric

        ms = int(1000 * (walltime if walltime is not None else time.time()))
        self.client.log_batch(self.run_id, metrics=[Metric(tag, float(value), ms, step)
                                                    for tag, value in scalars.items()])

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")
