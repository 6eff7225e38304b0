"""What a start may do to a run directory, decided before anything is written.

A run directory holds one run: config.yaml, metrics.jsonl, result.json, checkpoints/ (and failures/,
tensorboard/, wandb/, mlruns/, trackers.json, warnings.log). A new run into a directory that holds another
run's files is refused unless the user says `--resume` (continue it) or `--overwrite` (replace it); a resume
is checked against the checkpoint it would load (every file against its SHA-256, then model and batch shape
from its marker), so a refused start changes nothing on disk and the ranks load what was checked. Schedule
keys changed at a resume are named here, once, before any rank starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshfit.config import Config, ConfigError
from meshfit.train import checkpoint_store as store
from meshfit.train import trackers
from meshfit.util import run_lock
from meshfit.util.jsonfile import json_object_or_none

# What makes a directory a run's: a new run would replace or mix with these.
RUN_FILES = ("config.yaml", "metrics.jsonl", "result.json", "checkpoints")
# Removed with them by --overwrite (reports, logs and plots of the replaced run).
RUN_EXTRAS = ("failures", "tensorboard", "warnings.log", "config-step-*.yaml", "metrics-superseded-*.jsonl",
              "show-*.png", "launch.log", ".result.json.tmp", *trackers.RUN_DIR_ENTRIES)
# Keys whose change at a resume reshapes the learning-rate schedule.
SCHEDULE_KEYS = ("steps", "warmup_steps", "lr", "min_lr_ratio")
# Keys whose change at a resume the saved data position cannot follow.
SHAPE_KEYS = ("global_batch", "seq_len")


def checkpoint_root(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def check_location(run_dir: Path, flag: str = "--run-dir") -> None:
    """The directory can be created and written; names the file in the way otherwise."""
    from meshfit.util.paths import PathError, check_out_dir

    try:
        check_out_dir(run_dir, flag)
    except PathError as exc:
        raise ConfigError(str(exc)) from None


@contextlib.contextmanager
def held(run_dir: Path) -> Iterator[None]:
    """`run_dir` held by this process for the block (util/run_lock.py): ConfigError naming the process
    that holds it instead. Taken before the directory is judged, so two starts cannot both pass."""
    check_location(run_dir)  # before the lock makes the folder
    lock = contextlib.ExitStack()
    try:
        lock.enter_context(run_lock.hold(run_dir))
    except run_lock.RunDirBusy as exc:
        raise ConfigError(str(exc)) from None
    with lock:
        yield


def run_contents(run_dir: Path, root: Path) -> list[str]:
    """A short description of each run file present (empty: no run here)."""
    run_dir = Path(run_dir)
    found = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        found.append(f"metrics.jsonl ({_count_lines(metrics)} steps)")
    result = run_dir / "result.json"
    if result.is_file():
        found.append(f"result.json ({_result_status(result)})")
    steps = [number for number, _ in store.step_folders(root)]
    if steps:
        found.append(f"checkpoints of step {', '.join(map(str, sorted(steps)))} in {root}")
    if (run_dir / "config.yaml").is_file():
        found.append("config.yaml")
    return found


def _count_lines(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def _result_status(path: Path) -> str:
    result = json_object_or_none(path)
    return "unreadable" if result is None else str(result.get("status", "finished"))


def guard_new_run(cfg: Config, run_dir: Path, resume: bool, overwrite: bool) -> list[Path]:
    """Refuse a start that would mix with or replace another run, unless asked; returns what --overwrite
    is to remove (removed by `clear` once every other check passed)."""
    if resume and overwrite:
        raise ConfigError("--resume continues the run in --run-dir and --overwrite replaces it: give one")
    root = checkpoint_root(cfg, run_dir)
    check_location(run_dir)
    if cfg.checkpoint.dir:
        check_location(root, "checkpoint.dir")
    contents = run_contents(run_dir, root)
    if not contents:
        return []
    pinned = cfg.checkpoint.resume_from
    if resume and pinned and not _inside(Path(pinned), root):
        # Continuing another run's checkpoint here would trim this run's metrics and shelve its checkpoints.
        raise ConfigError(f"--resume-from {pinned} is not a checkpoint of the run in --run-dir {run_dir} "
                          f"({'; '.join(contents)}): continue it in a new --run-dir, or replace this run with "
                          "--overwrite")
    if resume:
        return []
    if not overwrite:
        raise ConfigError(f"--run-dir {run_dir} already holds a run ({'; '.join(contents)}). Continue it with "
                          "--resume, replace it with --overwrite, or choose another --run-dir")
    targets = [path for pattern in (*RUN_FILES, *RUN_EXTRAS) for path in Path(run_dir).glob(pattern)]
    if cfg.checkpoint.dir:  # only the checkpoints in a shared folder, never the folder itself
        targets += [folder for _, folder in store.step_folders(root)] + [
            p for p in (root / "superseded", root / store.DAMAGED) if p.exists()]
    return sorted(set(targets))


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


def clear(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def model_differences(marker: dict[str, Any], model: Any) -> list[str]:
    """`model.key: saved …, now …` for each field of the built model that differs from the checkpoint's."""
    # Fields added since a checkpoint was written take their defaults (e.g. no vocabulary padding).
    defaults = {f.name: f.default for f in dataclasses.fields(type(model)) if f.default is not dataclasses.MISSING}
    saved = {**defaults, **marker.get("model_config", {})}
    now = dataclasses.asdict(model)
    return [f"model.{k}: saved {saved.get(k)!r}, now {now[k]!r}" for k in now if saved.get(k) != now[k]]


def _check_pinned(folder: Path) -> None:
    """--resume-from takes one step-N folder: say so, with the right folder, when given another path."""
    example = "a step-N checkpoint folder such as RUN_DIR/checkpoints/step-00000010"
    if not folder.exists():
        raise ConfigError(f"--resume-from {folder} does not exist; give {example}")
    if not folder.is_dir():
        raise ConfigError(f"--resume-from {folder} is a file; give {example}")
    for root, run in ((folder / "checkpoints", folder), (folder, folder.parent)):
        complete = store.complete_checkpoints(root)
        if complete and not (folder / store.MARKER).exists():
            raise ConfigError(f"--resume-from {folder} is not one checkpoint but a folder of them: give one, e.g. "
                              f"{complete[0]} (the latest), or continue the run with --resume --run-dir {run}")


@dataclasses.dataclass
class Resume:
    """What a resume will do, decided before any rank starts."""

    lines: list[str] = dataclasses.field(default_factory=list)  # to print before the banner
    step: int | None = None  # the step it continues from (0: no checkpoint yet, a fresh start)
    folder: Path | None = None  # the checkpoint it loads, its files verified
    damaged: list[tuple[Path, str]] = dataclasses.field(default_factory=list)  # skipped: (folder, what is wrong)
    data_changed: list[str] = dataclasses.field(default_factory=list)  # accepted with --new-data


def check_resume(cfg: Config, run_dir: Path, model: Any, data: dict[str, Any] | None = None) -> Resume:
    """Choose and verify the checkpoint a resume loads: every file against the SHA-256 in its marker
    (checkpoint_store.pick), the newest intact one for --resume, the pinned one for --resume-from. Raises
    ConfigError when that one is damaged (or every one is) or holds another model or batch shape; changes
    nothing on disk (`set_aside_damaged` does, once every check passed)."""
    pinned = Path(cfg.checkpoint.resume_from) if cfg.checkpoint.resume_from else None
    if pinned:
        _check_pinned(pinned)
    root = checkpoint_root(cfg, run_dir)
    try:
        folder, marker, damaged = store.pick(root, pinned)
        if folder is not None:
            from meshfit.train.checkpoint_reader import read_metadata  # torch: only when resuming

            read_metadata(folder)  # its index through the allow-list, before any rank reads it
    except store.CheckpointError as exc:
        raise ConfigError(f"{'--resume-from' if pinned else '--resume'}: {exc}") from None
    if folder is None:
        where = "does not exist" if not root.exists() else "holds no complete checkpoint"
        result = Path(run_dir) / "result.json"
        if result.is_file() and _result_status(result) == "finished":
            # A finished run without checkpoints (checkpoint.at_end=false): starting over would replace it.
            raise ConfigError(f"--resume: {root} {where}, but --run-dir {run_dir} holds a finished run "
                              f"({'; '.join(run_contents(run_dir, root))}): there is nothing to continue "
                              "from. Replace it with --overwrite, or choose another --run-dir")
        # An attempt that died before its first checkpoint (a requeued job): its records are kept aside.
        return Resume([f"--resume: {root} {where}; starting at step 0"], 0)
    problems = model_differences(marker, model)
    saved_train = marker.get("train", {})
    problems += [f"train.{key}: saved {saved_train[key]!r}, now {getattr(cfg.train, key)!r} (the saved data "
                 "position counts sequences of the saved shape)"
                 for key in SHAPE_KEYS if key in saved_train and saved_train[key] != getattr(cfg.train, key)]
    if problems:
        own = Path(run_dir) / "config.yaml"
        hint = (f"; `--resume --run-dir {run_dir}` without --config or --plan resumes with the run's own "
                f"settings ({own})" if own.is_file() else "")
        raise ConfigError(f"cannot resume from {folder}: it was saved by another run shape; set these as saved "
                          f"(or start a new run in another --run-dir){hint}:\n  " + "\n  ".join(problems))
    changed = [f"train.{key} {saved_train[key]!r} → {getattr(cfg.train, key)!r}" for key in SCHEDULE_KEYS
               if key in saved_train and saved_train[key] != getattr(cfg.train, key)]
    lines = [f"warning: resuming with a changed learning-rate schedule ({', '.join(changed)}): from the first "
             "resumed step on, the learning rate follows the new schedule"] if changed else []
    data_changed = _data_changes(cfg, folder, marker, data)
    if data_changed:
        lines.append(f"warning: --new-data: continuing on other data than {folder} was saved on "
                     f"({'; '.join(data_changed)}); the first resumed step's metrics record it")
    step = marker["step"] if isinstance(marker["step"], int) else None
    return Resume(lines, step, folder, damaged, data_changed)


def _data_changes(cfg: Config, folder: Path, marker: dict[str, Any], data: dict[str, Any] | None) -> list[str]:
    """How the data differs from what the checkpoint trained on; ConfigError unless --new-data. A saved
    data position counts sequences of the saved data: in other data it points at other tokens."""
    from meshfit.data.fingerprint import identity_differences

    saved = marker.get("data")
    if not isinstance(saved, dict) or data is None:  # a checkpoint from before data was recorded
        return []
    differences = identity_differences(saved, data)
    if differences and not cfg.checkpoint.new_data:
        raise ConfigError(f"cannot resume from {folder} on this data: it was saved on other data; give the "
                          "data it trained on, or continue on this data with --new-data:\n  "
                          + "\n  ".join(differences))
    return differences


def set_aside_damaged(cfg: Config, run_dir: Path, resume: Resume) -> list[str]:
    """Once every check passed: move the damaged checkpoints the resume skips to checkpoints/damaged/;
    the lines that say so."""
    return store.set_aside_damaged(checkpoint_root(cfg, run_dir), resume.damaged, resume.folder) \
        if resume.damaged else []
