"""Start a training run: in this process (one rank), under an outer torchrun, or as N local ranks.

N local ranks go through torch's own torchrun machinery (torch.distributed.launcher.elastic_launch with the
c10d rendezvous on a free local port), so a run behaves the same as under `torchrun --nproc-per-node N`.
Whatever happens, the caller gets one Outcome: the rank-0 result, or one failure naming the rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshfit.config import Config
from meshfit.config.model_source import DEFAULT_PRESET, RUN_FIELDS
from meshfit.data.fingerprint import data_identity
from meshfit.train import checkpoint_store as store
from meshfit.train import preflight
from meshfit.train.shape import RunShape, resolve_run
from meshfit.train.trackers import check_installed
from meshfit.util.jsonfile import json_object_or_none
from meshfit.util.lifeline import LAUNCHER_ENV, kill_children


@dataclass
class Outcome:
    ok: bool
    result: dict[str, Any] | None = None
    failure: dict[str, Any] | None = None  # the first failing rank's record (see faults.failure_record)
    failed_ranks: tuple[int, ...] = ()
    exit_codes: dict[int, int] = field(default_factory=dict)  # local ranks that exited non-zero (--nproc)
    notes: list[str] = field(default_factory=list)  # e.g. failures a restart recovered from
    signal: str = ""  # the signal that reached the launcher (SIGINT, SIGTERM), if one did
    began: bool = False  # training began in this launch (its config.yaml was written)

    @property
    def message(self) -> str:
        if self.ok or not self.failure:
            if self.ok:
                return ""
            if self.signal and self.began:
                return (f"stopped by {self.signal} during training, but the ranks did not finish their step and "
                        "save within train.timeout_s; --resume continues from the last complete checkpoint")
            codes = ", ".join(f"rank {r}: {_exit_text(c)}" for r, c in sorted(self.exit_codes.items()))
            return "training failed on a rank without an error report" + (f" ({codes})" if codes else " (killed?)")
        others = [r for r in self.failed_ranks if r != self.failure["rank"]]
        label = "rank" if len(others) == 1 else "ranks"
        also = f" ({label} {', '.join(map(str, others))} failed too)" if others else ""
        # A rank killed by a signal writes no report: the others' reports only say that a peer vanished
        # (gloo's "Connection reset by peer"), so the dead rank comes first.
        died = [f"rank {r} died, {_exit_text(c)}{_SIGNAL_CAUSES.get(-c, '')}"
                for r, c in sorted(self.exit_codes.items()) if c < 0 and r not in self.failed_ranks]
        if died:
            return (f"{'; '.join(died)}. Then rank {self.failure['rank']} failed: "
                    f"{self.failure['message'].splitlines()[0]}{also}")
        return self.failure["message"] + also


# What usually sends the signal a rank died of.
_SIGNAL_CAUSES = {signal.SIGKILL: " (the out-of-memory killer, or kill -9; `dmesg` names the killer's victims)",
                  signal.SIGSEGV: " (a crash in native code)", signal.SIGBUS: " (a crash in native code)",
                  signal.SIGABRT: " (native code aborted)"}


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def rank_threads(nproc: int) -> int:
    """Intra-op threads per local rank: ranks share the cores (without this each would start one thread
    per core and oversubscribe them); OMP_NUM_THREADS, when set, decides."""
    from meshfit.train.capacity import usable_cores

    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else max(1, usable_cores() // nproc)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def model_name(preset: str | None, model: Any, init_from: str | None = None) -> str:
    """The preset's name when `model` has its shape (a plan file spells every dimension out), else the
    family of a custom shape; kernel, vocabulary padding and dropout do not change which model it is.
    `preset` None: the model of init_from's config.json (or the default preset)."""
    from meshfit.models.presets import PRESETS

    def shape_of(m: Any) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(m).items() if k not in RUN_FIELDS}

    names = [preset, *PRESETS]  # the config's own preset first
    same = next((name for name in names if name in PRESETS and shape_of(PRESETS[name]) == shape_of(model)), None)
    if same is not None:
        return same
    if preset is None and init_from:
        from meshfit.models.hf_weights import hf_model_type

        try:
            kind = hf_model_type(model)  # the Hugging Face family whose block it has
        except ValueError:
            kind = model.family
        return f"{kind} of {init_from}"
    return f"custom {model.family} (preset {preset or DEFAULT_PRESET} reshaped)"


def tell_torchrun(message: str) -> None:
    """Under an outer torchrun, hand this rank's error line to torchrun, whose closing summary then shows it
    as the failure's cause (`traceback : error: …`) instead of a pointer to its documentation.

    torchrun names the file in TORCHELASTIC_ERROR_FILE; the JSON is the layout its own @record handler
    writes, with the one line where that handler puts the Python traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not under_torchrun() or not path:
        return
    record = {"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                            "timestamp": str(int(time.time()))}}}
    try:
        Path(path).write_text(json.dumps(record))
    except OSError:
        pass  # torchrun then says what it says without it; the line is on the console already


def banner(cfg: Config, shape: RunShape, run_dir: Path, world: int, start_step: int | None) -> str:
    """One line before training: what runs, where, and for how long."""
    from meshfit.models.config import num_params
    from meshfit.util.units import fmt_count

    model = shape.model
    stage = f", zero_stage={shape.zero_stage}" if shape.dims.dp * shape.dims.cp > 1 else ""
    steps = cfg.train.steps if cfg.train.stop_after is None else min(cfg.train.steps, cfg.train.stop_after)
    first = "" if start_step is None else f" from step {start_step + 1}"
    precision = "bf16 mixed" if shape.mixed_precision else "fp32"
    # Switches that change what a step costs or where the weights come from, named when on.
    switches = [text for on, text in ((cfg.parallel.offload, "offloaded to host memory"),
                                      (cfg.train.compile, "compiled blocks"),
                                      (cfg.model.init_from, f"weights from {cfg.model.init_from}")) if on]
    return (f"meshfit train: model {model_name(cfg.model.preset, model, cfg.model.init_from)}, {fmt_count(num_params(model))} params ({model.n_layers} "
            f"layers, dim {model.dim}), layout {shape.dims.describe()}{stage}, {world} rank"
            f"{'s' if world > 1 else ''}, {precision}{''.join(', ' + text for text in switches)}; steps up to "
            f"{steps}{first} of {cfg.train.steps}, global batch {cfg.train.global_batch} × {cfg.train.seq_len} "
            f"tokens; run directory {run_dir}")


def collect(run_dir: Path, exit_codes: dict[int, int] | None = None, since: float = 0.0) -> Outcome:
    """The run's outcome from what the ranks of the launch that started at `since` left in run_dir:
    result.json, failures/rank<N>.json (older files are an earlier launch's and are not read).

    Failures of an earlier attempt that a restart recovered from become notes of a successful outcome."""
    reports = sorted(
        (r for p in (run_dir / "failures").glob("rank*.json") if (r := json_object_or_none(p)) and r.get("time", 0) >= since),
        key=lambda r: r["time"]) if (run_dir / "failures").is_dir() else []
    result = json_object_or_none(run_dir / "result.json")
    if result is not None and result.get("finished_at", 0) < since:
        result = None  # an earlier launch's result: this one ended before writing its own
    attempt = result.get("attempt", 0) if result else None
    current = [r for r in reports if result is None or r.get("attempt", 0) >= attempt]
    if current:  # the failure that ended the run: the last attempt's (earlier ones were restarted from)
        last = max(r.get("attempt", 0) for r in current)
        current = [r for r in current if r.get("attempt", 0) == last]
    if current:
        return Outcome(ok=False, failure=current[0], failed_ranks=tuple(sorted(r["rank"] for r in current)),
                       exit_codes=exit_codes or {})
    if result is not None and result.get("status") != "failed":
        notes = [f"recovered: attempt {r.get('attempt', 0)} failed on rank {r['rank']} ({r['message']}); "
                 f"restart {attempt} resumed from the last complete checkpoint" for r in reports[:1]]
        if attempt and not reports:
            notes.append(f"recovered: restart {attempt} resumed from the last complete checkpoint after a rank died")
        return Outcome(ok=True, result=result, notes=notes)
    failure = {"rank": -1, "message": result["error"]} if result and result.get("error") else None
    return Outcome(ok=False, failure=failure, exit_codes=exit_codes or {})


def _launch_local(run_dir: Path, config_file: Path, nproc: int, max_restarts: int = 0,
                  save_timeout_s: float = 600.0, module: str = "meshfit.train.worker") -> tuple[dict[int, int], str]:
    """Run the ranks (`python -m module RUN_DIR CONFIG --launched` each); returns the exit codes of those
    that failed (empty when all succeeded) and the name of the signal that reached this launcher ("" when
    none)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from meshfit.train import local_rendezvous

    os.environ.setdefault("OMP_NUM_THREADS", str(rank_threads(nproc)))
    # torch's elastic agent logs its own view of every shutdown (e.g. "Received 2 death signal"); the
    # outcome is reported once, from the ranks' reports. Its loggers set their own levels: quiet each.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # Every store of the launch listens on 127.0.0.1 alone (local_rendezvous.py); port 0: a free one.
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
        rdzv_backend=local_rendezvous.register(), rdzv_endpoint=f"{local_rendezvous.LOOPBACK}:0",
        local_addr=local_rendezvous.LOOPBACK, max_restarts=max_restarts, monitor_interval=0.1,
        start_method="spawn",
        # After a signal, torch waits this long for the ranks to finish their step and save before it
        # kills them (its default, 30 s, is shorter than a large model's save).
        shutdown_timeout=int(save_timeout_s),
        signals_to_handle="SIGTERM,SIGHUP,SIGQUIT",  # SIGINT: ctrl_c below
    )
    # The ranks run in their own sessions (torch starts them so): a signal reaches them through this
    # launcher, which torch's agent passes on and then waits for them to save and stop. Ctrl-C is passed
    # on as SIGTERM: a rank still starting its interpreter then ends silently (SIGINT would print
    # Python's KeyboardInterrupt traceback), and a training rank stops and saves alike.
    received: list[str] = []

    def ctrl_c(signum: int, frame: Any) -> None:
        received.append("SIGINT")
        raise SignalException("Ctrl-C", sigval=signal.SIGTERM)

    previous = signal.signal(signal.SIGINT, ctrl_c)
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks end when this process does (lifeline.py)
    try:
        elastic_launch(config, sys.executable)("-m", module, str(run_dir), str(config_file), "--launched")
    except ChildFailedError as exc:
        # The ranks' own reports in run_dir/failures say what happened; exit codes cover ranks that died.
        return {failure.local_rank: failure.exitcode for failure in exc.failures.values()}, "".join(received)
    except SignalException as exc:
        return {}, received[0] if received else signal.Signals(exc.sigval).name
    finally:
        signal.signal(signal.SIGINT, previous)
        os.environ.pop(LAUNCHER_ENV, None)
        # torch's agent ends the ranks of a launch that fails; not those it had started when starting
        # another failed (e.g. out of processes or memory). The config file names this launch's ranks.
        kill_children(str(config_file))
    return {}, "".join(received)


def launch_local(work_dir: Path, config_file: Path, nproc: int, module: str,
                 timeout_s: float) -> tuple[dict[int, int], str]:
    """`nproc` local ranks of another entry point than training's (`meshfit eval`'s), through the same
    machinery: the failed ranks' exit codes and the signal that reached this launcher, as `_launch_local`."""
    return _launch_local(work_dir, config_file, nproc, save_timeout_s=timeout_s, module=module)


def launch(cfg: Config, run_dir: Path, nproc: int | None = None, max_restarts: int = 0,
           overwrite: bool = False, notes: list[str] | None = None) -> Outcome:
    """Validate, then train with `nproc` local ranks (None: one, or the ranks of an outer torchrun).

    Nothing is written before every check passed (preflight.py): a new run into a directory holding
    another run is refused unless `overwrite` (or checkpoint.resume continues it). `max_restarts`: with
    local ranks, restart them all up to that many times after a failure; each restart resumes from the
    latest complete checkpoint. `notes`: lines printed before the start line once every check passed."""
    run_dir = Path(run_dir)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else (nproc or 1)
    shape = resolve_run(cfg, world)  # raises ConfigError before any rank starts
    check_installed(cfg.metrics)  # on every rank of an outer torchrun: none waits for a rank 0 that failed
    resuming = cfg.checkpoint.resume or cfg.checkpoint.resume_from is not None
    # Rank 0 alone judges the run directory under an outer torchrun (another rank could see it half
    # cleared); a restart by torchrun (restart count > 0) continues the run it restarts, as a resume.
    leader = not under_torchrun() or int(os.environ.get("RANK", 0)) == 0
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    with contextlib.ExitStack() as held:
        if leader:  # one process at a time in a run directory, from its checks to the end of the run
            held.enter_context(preflight.held(run_dir))
        removed, resume = [], preflight.Resume()
        data = data_identity(cfg.data, cfg.train.seed) if leader else None  # what a checkpoint records it trained on
        if leader and not restarted:
            removed = preflight.guard_new_run(cfg, run_dir, resuming, overwrite)
            resume = preflight.check_resume(cfg, run_dir, shape.model, data) if resuming else resume
        if leader:  # every check passed: a damaged checkpoint the resume skips moves aside, named
            lines = [*(notes or []), *resume.lines, *preflight.set_aside_damaged(cfg, run_dir, resume)]
            for line in [*lines, banner(cfg, shape, run_dir, world, resume.step)]:
                print(line, file=sys.stderr, flush=True)
        if leader and cfg.data.source == "text":
            from meshfit.data.files import tokenizer_note

            if note := tokenizer_note(cfg.data.tokenizer, shape.model.vocab_size):
                print(note, file=sys.stderr, flush=True)
        # The ranks load the checkpoint checked above without hashing its files again.
        verified = {store.VERIFIED_ENV: store.launcher_token(resume.folder)} if resume.folder else {}
        if data is not None:
            verified[store.DATA_ENV] = json.dumps({"identity": data, "changed": resume.data_changed})
        with _environ(verified):
            return _start(cfg, run_dir, nproc, max_restarts, removed)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set (the ranks inherit it), as it was afterwards."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start(cfg: Config, run_dir: Path, nproc: int | None, max_restarts: int, removed: list[Path]) -> Outcome:
    from meshfit.train.worker import INTERRUPTED, run_worker

    since = time.time()
    if removed:
        preflight.clear(removed)
        print(f"--overwrite: removed the earlier run's {', '.join(str(p) for p in removed)}",
              file=sys.stderr, flush=True)
    if under_torchrun():
        # Every rank of an outer torchrun lands here with the same config and trains it; rank 0 writes.
        run_worker(run_dir, cfg)
        return collect(run_dir, since=since)
    if not nproc or nproc == 1:
        code = run_worker(run_dir, cfg, quiet=True)
        return _outcome(run_dir, collect(run_dir, since=since), "SIGINT" if code == INTERRUPTED else "", since)
    with tempfile.TemporaryDirectory(prefix="meshfit-launch-") as tmp:
        # The ranks read the validated config from here: run_dir/config.yaml is only replaced once
        # training begins (a failed start leaves the run's files as they were).
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(cfg.to_yaml())
        try:
            codes, received = _launch_local(run_dir, config_file, nproc, max_restarts, cfg.train.timeout_s)
        except OSError as exc:  # e.g. fork or exec refused: no more processes or memory for them
            return Outcome(ok=False, failure={"rank": -1, "message": f"could not start {nproc} local ranks: {exc}"})
    return _outcome(run_dir, collect(run_dir, codes, since), received, since)


def _began(run_dir: Path, since: float) -> bool:
    config = run_dir / "config.yaml"  # written by rank 0 once training begins (records.begin_run)
    return config.is_file() and config.stat().st_mtime >= since


def _record_failure(run_dir: Path, outcome: Outcome, since: float) -> None:
    """result.json of a run that began training in this launch and then failed where rank 0 could not
    say so itself (killed, stuck in a collective, or stopped by a signal before its save finished)."""
    result = json_object_or_none(run_dir / "result.json")
    if result is not None and result.get("finished_at", 0) >= since:
        return  # rank 0 recorded it
    record = {"status": "failed", "error": outcome.message, "finished_at": time.time(),
              "failed_ranks": list(outcome.failed_ranks)}
    (run_dir / "result.json").write_text(json.dumps(record, indent=2))


def _outcome(run_dir: Path, outcome: Outcome, received: str, since: float) -> Outcome:
    """Say which signal reached the launcher, and record a run that failed after it began training."""
    outcome.signal = received
    outcome.began = _began(run_dir, since)
    result = outcome.result
    if received == "SIGINT" and result and result.get("status") == "interrupted" and result.get("signal") != received:
        # The ranks saw the SIGTERM this launcher passed Ctrl-C on as; the run was stopped by Ctrl-C.
        result.update(signal=received, stopped=f"{received} after step {result['end_step']}")
        (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    if not outcome.ok and outcome.began:  # a failed start leaves the run's files as they were
        _record_failure(run_dir, outcome, since)
    return outcome
