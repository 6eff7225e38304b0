"""`meshfit show RUN_DIR...`: one summary table row per run, and PNG plots that overlay the runs.

Reads only what `meshfit train` leaves in a run directory (metrics.jsonl, result.json, config.yaml), so it
works on finished, stopped, failed and still-running runs, and on a machine without torch's ranks.
Every problem with the input is a ShowError whose message names the path and what was expected.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from meshfit.layout.rules import data_parallel_rest, default_zero_stage
from meshfit.parallel.dims import MESH_DIMS
from meshfit.runs import run_dir as runfiles
from meshfit.runs import show_moe
from meshfit.runs.plots import write_plots
from meshfit.runs.run_dir import REQUIRED_KEYS, ShowError, read_config, read_result
from meshfit.train.steady import steady_records
from meshfit.util.paths import PathError, read_text
from meshfit.util.units import fmt_bytes

METRICS = "metrics.jsonl"
_MIB = 2**20


@dataclass
class RunView:
    """What one run directory holds, read once."""

    path: Path
    records: list[dict[str, Any]]
    result: dict[str, Any] | None
    config: dict[str, Any]
    status: str

    @property
    def name(self) -> str:
        return self.path.name or self.path.resolve().name  # "." has no name of its own

    @property
    def world_size(self) -> int | None:
        if self.result and self.result.get("world_size"):
            return int(self.result["world_size"])
        mem = self.records[-1].get("mem") if self.records else None
        return len(mem) if mem else None

    @property
    def layout(self) -> str:
        return layout_label(self.result, self.config, self.world_size)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.layout})"


# ---- reading ------------------------------------------------------------------------------------------


def _check_run_dir(path: Path) -> Path:
    """The run's metrics.jsonl, or a ShowError saying why `path` is not a run directory."""
    if not path.exists():
        raise ShowError(f"{path} does not exist: expected a run directory of `meshfit train` (its --run-dir)")
    if path.is_file():
        hint = f" (here: {path.parent})" if path.name == METRICS else ""
        raise ShowError(f"{path} is a file: expected a run directory of `meshfit train`, the folder that holds "
                        f"{METRICS}{hint}")
    metrics = path / METRICS
    if not metrics.is_file():
        # A demo folder holds one run per layout: point at them instead of just refusing.
        try:
            inner = sorted(p.name for p in path.iterdir() if (p / METRICS).is_file())
        except OSError:
            inner = []  # unreadable: the message below still says what is missing
        shown = ", ".join(inner[:5]) + (f" … ({len(inner)} in all)" if len(inner) > 5 else "")
        hint = f"; it holds run directories: {shown}" if inner else " (a run writes it once training starts)"
        raise ShowError(f"{path} has no {METRICS}: expected a run directory of `meshfit train`{hint}")
    return metrics


def read_records(metrics: Path) -> list[dict[str, Any]]:
    """The step records of metrics.jsonl; a line that is not a whole record is an error, not skipped,
    because the plots would silently miss that step. The one exception: a last line without its newline
    is a record still being written (or cut short when a rank was killed), as the trainer sees it too;
    it is left out with a note."""
    try:
        text = read_text(metrics, "metrics file of one JSON step record per line")
    except PathError as exc:
        raise ShowError(str(exc)) from None
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not text.endswith("\n"):
                print(f"note: {metrics} line {number} is cut short (a record being written, or a killed rank's); "
                      "left out", file=sys.stderr)
                break
            raise ShowError(f"{metrics} line {number} is not valid JSON (cut short or corrupted): expected one "
                            f"JSON step record per line") from None
        problem = _record_problem(rec)
        if problem:
            # A wrong value names its field and what it should be; a wrong shape gets the whole picture.
            shape = "" if "expected" in problem else (f": expected a JSON object with numbers "
                                                     f"{', '.join(REQUIRED_KEYS)} and a list `mem` of one "
                                                     "object per rank")
            raise ShowError(f"{metrics} line {number} is not a step record ({problem}){shape}")
        records.append(rec)
    return records


def _record_problem(rec: Any) -> str | None:
    """What makes `rec` unusable as a step record, checked up front so a bad value is an error naming
    the line and the field rather than a traceback from deep inside the table or a plot."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}"
    return runfiles.problem(runfiles.StepRecord, rec)


def run_status(run_dir: Path, result: dict[str, Any] | None) -> str:
    """The result's own `status` (finished, interrupted, failed ...) when it has one. Older runs wrote
    result.json without it, and only when a launch ended well; with no result.json the run failed (a rank
    left a report) or is still running or was killed."""
    if result is not None:
        if result.get("status"):
            return str(result["status"])
        return "stopped" if result.get("stopped") else "finished"
    if any((run_dir / "failures").glob("rank*.json")):
        return "failed"
    return "incomplete"


def load_run(path: Path) -> RunView:
    metrics = _check_run_dir(path)
    records = read_records(metrics)
    result = read_result(path / "result.json")
    return RunView(path, records, result, read_config(path / "config.yaml"), run_status(path, result))


# ---- describing -----------------------------------------------------------------------------------------


def _degrees(parallel: dict[str, Any], world: int | None) -> dict[str, int]:
    """The mesh degrees of a config's parallel section, with a -1 ("the rest") resolved when the world
    size is known."""
    names = MESH_DIMS
    degrees = {n: int(parallel.get(n) or 1) for n in names}
    if "dp_shard" in parallel and parallel["dp_shard"] is None:  # unset: data parallelism takes the rest
        degrees["dp_replicate"], degrees["dp_shard"] = data_parallel_rest(
            degrees["dp_replicate"], None, degrees["tp"], degrees["pp"], parallel.get("zero_stage"), degrees["cp"])
    known = 1
    for n in names:
        known *= degrees[n] if degrees[n] > 0 else 1
    for n in names:
        if degrees[n] < 1:
            degrees[n] = world // known if world else 1
    return degrees


def layout_label(result: dict[str, Any] | None, config: dict[str, Any], world: int | None) -> str:
    """e.g. "dp_shard=2 ZeRO-3, AC full": the degrees say where ranks go, the ZeRO stage and the
    options what each rank keeps; runs of one mesh differ only in the latter."""
    parallel = config.get("parallel") or {}
    degrees = _degrees(parallel, world)
    if result and result.get("layout"):
        mesh = str(result["layout"])
    else:
        mesh = " × ".join(f"{n}={d}" for n, d in degrees.items() if d > 1) or "single rank"
    stage = result.get("zero_stage") if result else None
    if stage is None:
        stage = parallel.get("zero_stage")
    if stage is None:
        stage = default_zero_stage(degrees["dp_shard"], degrees["cp"])  # the config's own default
    dp = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["cp"]
    if dp > 1 or stage:
        mesh += f" ZeRO-{stage}" if stage else " DDP"
    extras = []
    if parallel.get("activation_checkpointing") not in (None, "none"):
        extras.append(f"AC {parallel['activation_checkpointing']}")
    if parallel.get("mixed_precision") or (config.get("train") or {}).get("precision") == "bf16":
        extras.append("bf16")
    extras += [key for key in ("sp", "offload") if parallel.get(key)]
    if degrees["pp"] > 1 and (config.get("pipeline") or {}).get("schedule"):
        extras.append(config["pipeline"]["schedule"])
    return ", ".join([mesh, *extras])


def _steady(records: list[dict[str, Any]], key: str) -> list[float]:
    # Warm-up (step 1), compiling and eager-tracked compiled steps left out when we can (train/steady.py).
    return [r[key] for r in steady_records(records) if r.get(key) is not None]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def most_loaded(run: RunView) -> tuple[int, int | None]:
    """(bytes, rank) of the highest per-rank peak over every step."""
    best, rank = 0, None
    for rec in run.records:
        for r, mem in enumerate(rec.get("mem") or []):
            if mem.get("peak", 0) > best:
                best, rank = mem["peak"], r
        if rec["peak_mem_bytes"] > best:  # records without a breakdown still say the peak
            best, rank = rec["peak_mem_bytes"], None
    return best, rank


def summary_row(run: RunView) -> dict[str, str]:
    recs = run.records
    planned = (run.config.get("train") or {}).get("steps")
    tps = _median(_steady(recs, "tokens_per_s"))
    step_s = _median(_steady(recs, "step_time_s"))
    mfus = _median(_steady(recs, "mfu"))
    peak, rank = most_loaded(run)
    return {
        "run": str(run.path), "layout": run.layout,
        "ranks": str(run.world_size or "-"),
        "steps": f"{recs[-1]['step'] if recs else 0} / {planned if planned else '?'}",
        "status": run.status,
        "final loss": f"{recs[-1]['loss']:.4f}" if recs else "-",
        "val loss": _last_val(recs),
        "tokens/s": f"{tps:,.0f}" if tps is not None else "-",
        "step time": f"{step_s * 1e3:.1f} ms" if step_s is not None else "-",
        "MFU": f"{mfus:.1%}" if mfus is not None else "-",
        "peak mem": (fmt_bytes(peak) + (f" (rank {rank})" if rank is not None else "")) if recs else "-",
    }


def _last_val(recs: list[dict[str, Any]]) -> str:
    """The latest validation loss and its step ('-' when the run has not evaluated)."""
    evaluated = [r for r in recs if "val_loss" in r]
    return f"{evaluated[-1]['val_loss']:.4f} @{evaluated[-1]['step']}" if evaluated else "-"


def summary_table(runs: list[RunView]) -> Table:
    rows = [summary_row(r) for r in runs]
    table = Table(title="runs", caption="medians over steps 2+ (without compiling or eager-tracked compiled "
                  "steps); val loss: the latest, @ its step; peak mem: the most-loaded rank over all steps")
    for column in rows[0]:
        table.add_column(column, justify="left" if column in ("run", "layout", "status") else "right")
    for row in rows:
        table.add_row(*(escape(v) for v in row.values()))  # a path like runs/[a] is not rich markup
    return table


# ---- plots ----------------------------------------------------------------------------------------------


def default_out(run_dirs: list[Path]) -> Path:
    return run_dirs[0] if len(run_dirs) == 1 else Path(f"show-{time.strftime('%Y%m%d-%H%M%S')}")


def prepare_out(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise ShowError(f"--out {out} is a file: expected a folder for the plots")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ShowError(f"cannot create the --out folder {out}: {exc}") from None
    return out


def show(run_dirs: list[Path], out: Path | None = None, console: Console | None = None) -> list[Path]:
    """Print the summary table, write the plots; returns the files written. Raises ShowError."""
    runs = [load_run(Path(p)) for p in run_dirs]  # every input checked before anything is printed
    out_dir = Path(out) if out else default_out([Path(p) for p in run_dirs])
    if out or any(r.records for r in runs):  # no empty show-<time> folder when nothing will be plotted
        prepare_out(out_dir)
    console = console or Console(width=None if Console().is_terminal else 160)
    console.print(summary_table(runs))
    if show_moe.has_moe(runs):
        console.print(show_moe.moe_table(runs))
    written = write_plots(runs, out_dir)
    if not written:
        console.print("no step recorded yet in any run: no plots written")
    for path, wanted in written:
        kept = f" ({wanted.name} was already there: kept)" if path != wanted else ""
        console.print(escape(f"wrote {path}{kept}"), highlight=False)
    return [path for path, _ in written]
