"""Distributed checkpoints of a run with torch.distributed.checkpoint (DCP), loadable under any layout.

What is saved: model and optimizer states under their plain parameter names (torch's state-dict helpers
remove DDP/FSDP/activation-checkpointing wrappers; pipeline stages are renamed back to the whole model's
names; the optimizer state is flattened to one entry per parameter), the LR schedule, the data position
(in global sequences, so it holds under any data-parallel size), the step and each rank's RNG state. Every
rank writes only its own shards; DCP reshards on load, so a checkpoint saved under one layout resumes under
another (FSDP, TP, PP, one process). Folders, markers and damage checks: see checkpoint_store.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import time
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from meshfit.config import Config
from meshfit.train import checkpoint_reader
from meshfit.train import checkpoint_store as store
from meshfit.train.checkpoint_store import CheckpointError
from meshfit.train.optim import continue_schedule
from meshfit.train.preflight import SCHEDULE_KEYS, SHAPE_KEYS, model_differences
from meshfit.util.units import fmt_bytes

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# A pipeline rank's model is a ModuleList of its stages: names start with the stage's index in that list.
_STAGE_PREFIX = re.compile(r"^((?:state|param_groups)\.)?\d+\.")


def _plain_names(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    renamed, back = {}, {}
    for key, value in state.items():
        plain = _STAGE_PREFIX.sub(lambda m: m.group(1) or "", key, count=1)
        renamed[plain], back[plain] = value, key
    return renamed, back


def _model_state(run: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """Model and optimizer state dicts under the whole model's parameter names, and the map back."""
    model_sd, optim_sd = get_state_dict(run.model, run.optimizer, options=_OPTIONS)
    if run.pipe is None:
        return model_sd, optim_sd, {}
    model_sd, back_m = _plain_names(model_sd)
    optim_sd, back_o = _plain_names(optim_sd)
    return model_sd, optim_sd, {**back_m, **back_o}


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _full_state(run: Any, step: int) -> tuple[dict[str, Any], dict[str, str]]:
    model_sd, optim_sd, back = _model_state(run)
    state = {
        "model": model_sd, "optim": optim_sd,
        "train": {"step": step, "scheduler": run.scheduler.state_dict(), "data": run.batches.state_dict()},
        "rng": {f"rank{run.env.rank}": _rng_state(run.env.device)},
    }
    return state, back


def launched_data(cfg: Config) -> dict[str, Any]:
    """The data identity the launcher computed (and what a --new-data resume changed); computed here when
    no launcher did (a run started in-process)."""
    from meshfit.data.fingerprint import data_identity

    text = os.environ.get(store.DATA_ENV)
    return json.loads(text) if text else {"identity": data_identity(cfg.data, cfg.train.seed), "changed": []}


def _marker_info(run: Any, step: int, data: dict[str, Any] | None) -> dict[str, Any]:
    return {"step": step, "time": time.time(), "world_size": run.env.world_size, "data": data,
            "layout": run.shape.dims.describe(), "zero_stage": run.shape.zero_stage,
            "model": run.cfg.model.model_dump(exclude={"init_from"}),
            "model_config": dataclasses.asdict(run.shape.model),
            "train": {key: getattr(run.cfg.train, key) for key in (*SHAPE_KEYS, *SCHEDULE_KEYS)}}


class Checkpointer:
    """Saves this rank's part of the run's checkpoints and resumes from them. Every rank calls every method
    at the same step (they are collective)."""

    def __init__(self, cfg: Config, rank: int, run_dir: Path | None, faults: Any = None) -> None:
        section = cfg.checkpoint
        self.section = section
        self.rank = rank
        self.root = Path(section.dir) if section.dir else (Path(run_dir) / "checkpoints" if run_dir else None)
        self.faults = faults
        self.pending: tuple[int, Path, Future, Any] | None = None
        self.last_saved: int | None = None
        self.last_folder: Path | None = None
        self.save_seconds: list[float] = []  # how long each save blocked training
        # What the run trains on, as rank 0 records it in each checkpoint's marker.
        self.data = launched_data(cfg) if rank == 0 and self.root is not None else None
        # Async saves coordinate on their own group, so their background collectives never interleave
        # with the training step's.
        self.group = dist.new_group(backend="gloo") if section.async_save and self.root else None

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def due(self, step: int) -> bool:
        return self.enabled and self.section.interval > 0 and step % self.section.interval == 0

    # -- saving ---------------------------------------------------------------------------------------

    def save(self, run: Any, step: int) -> Path:
        """Save the run after `step` optimizer steps (asynchronously when checkpoint.async_save)."""
        self.wait()
        start = time.perf_counter()
        folder = store.step_dir(self.root, step)
        if self.rank == 0:
            moved, deleted = store.set_aside_newer(self.root, step, self.section.keep_latest)
            if moved:
                _say(0, f"this run continues from an earlier step: set aside the checkpoints "
                        f"{', '.join(p.name for p in moved)} in {moved[0].parent} (checkpoint.keep_latest="
                        f"{self.section.keep_latest} are kept there)")
            if deleted:
                _say(0, f"deleted older set-aside checkpoints: {', '.join(str(p) for p in deleted)}")
            if folder.exists():  # an interrupted save of this step by an earlier attempt: never mix the two
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
        dist.barrier()
        state, _ = _full_state(run, step)
        timer = self.faults.during_save(step) if self.faults else None
        info = _marker_info(run, step, self.data["identity"] if self.data else None)
        background = self.group is not None
        total = _all_ranks_bytes(state, run.env.device)
        announce = total >= ANNOUNCE_BYTES
        if announce:  # a long write: say what it is before the console goes quiet
            _say(self.rank, f"writing step {step} to {folder}: model, optimizer states, schedule, data position "
                            f"and RNG states ({fmt_bytes(total)} from {dist.get_world_size()} rank(s))"
                            f"{' in the background' if background else ''}…")
        writer = self.faults.storage_writer(step, folder) if self.faults else None
        try:
            if background:
                response = dcp.async_save(state, checkpoint_id=folder, process_group=self.group,
                                          storage_writer=writer)
                self.pending = (step, folder, getattr(response, "upload_completion", response), info, start,
                                announce)
            else:
                dcp.save(state, checkpoint_id=folder, storage_writer=writer)
                self._finalize(step, folder, info, start, announce, background=False)
        except (Exception, CheckpointException) as exc:  # DCP's own error is a BaseException
            raise self._failed(step, folder, exc) from None
        self.save_seconds.append(time.perf_counter() - start)
        if timer is not None:
            timer.join()  # the injected kill fires during the save, or just after it
        return folder

    def unfinished(self) -> bool:
        """This rank still writes an async save (the trainer agrees on all ranks before finalizing)."""
        return self.pending is not None and not self.pending[2].done()

    def finalize_pending(self) -> None:
        """Called on every rank once every rank's async save is done."""
        if self.pending is not None:
            step, folder, future, info, start, announce = self.pending
            self.pending = None
            try:
                future.result()  # raises what the background save raised
                self._finalize(step, folder, info, start, announce, background=True)
            except (Exception, CheckpointException) as exc:
                raise self._failed(step, folder, exc) from None

    def wait(self) -> None:
        """Wait for an async save and finalize it (collective)."""
        if self.pending is not None:
            futures.wait([self.pending[2]])
            self.finalize_pending()

    def _failed(self, step: int, folder: Path, exc: BaseException) -> CheckpointError:
        """A save that failed (no space, no permission, a broken disk) on any rank, as every rank sees it:
        rank 0 removes its partial folder (the space it holds may be what the run's result needs), and the
        error names the cause and the checkpoints kept."""
        if self.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        kept = [number for number, path in store.step_folders(self.root) if path != folder]
        resume = (f"--resume continues from step {max(kept)}" if kept else "no earlier checkpoint exists")
        return CheckpointError(f"the checkpoint of step {step} could not be written to {folder}: {_cause(exc)}; "
                               f"its partial folder was removed, the checkpoints of "
                               f"{'steps ' + ', '.join(map(str, sorted(kept))) if kept else 'no step'} are kept "
                               f"({resume} once the cause is fixed)")

    def _finalize(self, step: int, folder: Path, info: dict[str, Any], start: float, announce: bool,
                  background: bool) -> None:
        # Each rank hashes the files it wrote; rank 0 adds the rest and writes the marker last.
        mine = store.digest_files(folder, sorted(p.name for p in folder.glob(f"__{self.rank}_*")))
        gathered: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, mine)
        if self.rank == 0:
            files = {k: v for part in gathered for k, v in part.items()}
            rest = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in files
                          and not p.name.startswith("."))
            files.update(store.digest_files(folder, rest + [".metadata"]))
            store.write_marker(folder, info, files)
            store.prune(self.root, self.section.keep_latest, folder)
            seconds = time.perf_counter() - start
            if announce or seconds >= ANNOUNCE_S:
                written = sum((folder / name).stat().st_size for name in files)
                # In the background training went on meanwhile: the time is not the write's alone.
                took = (f"finished in the background {seconds:.1f} s after it began" if background else
                        f"in {seconds:.1f} s ({fmt_bytes(written / max(seconds, 1e-9))}/s)")
                _say(0, f"step {step}: {fmt_bytes(written)} in {len(files)} files written to {folder} {took}")
        self.last_saved, self.last_folder = step, folder

    # -- resuming -------------------------------------------------------------------------------------

    def wanted(self, restarted: bool) -> bool:
        return self.section.resume_from is not None or (self.enabled and (self.section.resume or restarted))

    def restore(self, run: Any, restarted: bool = False) -> int:
        """Load the checkpoint to resume from, if resuming; returns the step it continues from (0: fresh)."""
        if not self.wanted(restarted):
            return 0
        folder, marker, error = self._choose()
        if error:
            raise CheckpointError(error)
        if folder is None:
            if restarted:  # a plain --resume was told so by the launcher, before any rank started
                _say(self.rank, f"no complete checkpoint in {self.root} yet; starting at step 0")
            return 0
        _check_compatible(folder, marker, run)
        same_world = marker["world_size"] == run.env.world_size
        step = self._load(run, folder, same_world)
        _say(self.rank, f"resumed from {folder} (step {step}, saved as {marker['layout']})")
        return step

    def _choose(self) -> tuple[Path | None, dict[str, Any] | None, str]:
        # Rank 0 checks the files once (unless the launcher just did) and tells the others what to load.
        choice: list[Any] = [None, None, ""]
        if self.rank == 0:
            pinned = Path(self.section.resume_from) if self.section.resume_from else None
            try:
                folder, marker, damaged = store.pick(self.root, pinned, store.trusted_by_launcher())
                choice = [str(folder) if folder else None, marker, ""]
            except CheckpointError as exc:
                damaged, choice = [], [None, None, str(exc)]
            if damaged:  # a restarted run (the launcher moves what it finds damaged before any rank starts)
                for line in store.set_aside_damaged(self.root, damaged, folder):
                    _say(0, line)
        dist.broadcast_object_list(choice, src=0)
        return (Path(choice[0]) if choice[0] else None), choice[1], choice[2]

    def _load(self, run: Any, folder: Path, same_world: bool) -> int:
        state, back = _full_state(run, 0)
        if not same_world:
            # RNG states belong to ranks; under another world size they are re-seeded from the step.
            del state["rng"]
        _read(state, folder, "run")
        model_sd = {back.get(k, k): v for k, v in state["model"].items()}
        optim_sd = {back.get(k, k): v for k, v in state["optim"].items()}
        set_state_dict(run.model, run.optimizer, model_state_dict=model_sd,
                       optim_state_dict=optim_sd, options=_OPTIONS)
        train = state["train"]
        run.scheduler.load_state_dict(train["scheduler"])
        # The saved position in the schedule, under this run's schedule (steps, warmup and lr may differ).
        continue_schedule(run.optimizer, run.scheduler, run.cfg.train)
        run.batches.load_state_dict(train["data"])
        step = int(train["step"])
        if same_world:
            rng = state["rng"][f"rank{run.env.rank}"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], run.env.device)
        else:
            torch.manual_seed(run.cfg.train.seed + step)
        return step


def _read(state: dict[str, Any], folder: Path, into: str) -> None:
    """DCP's load of `state` from `folder`, through the allow-list (nothing in a checkpoint runs)."""
    try:
        checkpoint_reader.load(state, folder)
    except checkpoint_reader.UnsafeCheckpoint:
        raise
    except Exception as exc:  # DCP wraps per-rank errors; name the checkpoint with the cause
        raise CheckpointError(f"checkpoint {folder} cannot be loaded into this {into}: {_first_line(exc)}") from exc


def load_model_weights(run: Any, folder: Path) -> None:
    """The model weights of checkpoint `folder` into this rank's laid-out model, resharded from whatever
    layout saved them; nothing else of the run (optimizer, schedule, data position, RNG) is read or
    changed. Collective: every rank calls it. The caller has checked the files and the model's shape."""
    model_sd = get_model_state_dict(run.model)
    model_sd, back = _plain_names(model_sd) if run.pipe is not None else (model_sd, {})
    state = {"model": model_sd}
    _read(state, folder, "model")
    set_model_state_dict(run.model, {back.get(k, k): v for k, v in state["model"].items()})


def _check_compatible(folder: Path, marker: dict[str, Any], run: Any) -> None:
    diff = model_differences(marker, run.shape.model)
    if diff:
        raise CheckpointError(f"checkpoint {folder} holds another model; set the model section as saved:\n  "
                              + "\n  ".join(diff))


# A save of this much state on a rank, or one that takes this long, is announced on the console: it can
# take minutes (20 GB of a 1B model's weights and AdamW states took 46 s on one GPU's host).
ANNOUNCE_BYTES = 1 << 30
ANNOUNCE_S = 10.0


def _all_ranks_bytes(state: dict[str, Any], device: torch.device) -> int:
    """Bytes of the tensors every rank writes (DTensors: each rank's local shards), on every rank: the
    ranks hold different shares (a pipeline's last stage holds the head), and rank 0 speaks for all."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    local = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes
                for t in tree_leaves(state) if isinstance(t, torch.Tensor))
    total = torch.tensor([local], dtype=torch.float64, device=device)  # one small collective per save
    dist.all_reduce(total)
    return int(total.item())


def _cause(exc: BaseException) -> str:
    """The first rank's own error inside DCP's CheckpointException (which lists every rank's traceback)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, failure = min(exc.failures.items(), key=lambda item: item[0])
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"{_first_line(inner)} (rank {rank})"
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[checkpoint] {text}", file=sys.stderr, flush=True)
