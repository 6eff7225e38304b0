"""The terminal's progress line: elapsed time and ETA stay visible at any usual width."""

import io
import re

import pytest
from rich.console import Console

from meshfit.train.metrics import MetricsLog, progress_bar

STEP = {"step": 999, "loss": 1.23456, "grad_norm": 0.1234, "lr": 3e-3, "tokens_per_s": 123456.0,
        "peak_mem_bytes": 1000 * 2**20, "step_time_s": 0.5}


def _line(width: int, total: int) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=True, color_system=None)
    log = MetricsLog(None, total)
    log.progress = progress_bar(console)
    log.task = log.progress.add_task("train", total=total, completed=STEP["step"] - 1, info="")
    log.record(STEP)
    console.print(log.progress.make_tasks_table(log.progress.tasks))
    return buf.getvalue().rstrip("\n")


@pytest.mark.parametrize("width", [100, 80, 60])
def test_elapsed_and_eta_are_never_cut(width):
    line = _line(width, total=1000)
    assert "\n" not in line and len(line) <= width
    assert re.search(r"999/1000 \d+:\d\d:\d\d eta (\d+:\d\d:\d\d|-:--:--) loss 1\.2346", line), line


def test_every_figure_fits_100_columns():
    line = _line(100, total=1000)
    for figure in ("loss 1.2346", "gnorm 0.123", "lr 3.0e-03", "123456 tok/s", "peak 1000.0 MiB"):
        assert figure in line, line
