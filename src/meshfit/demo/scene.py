"""What every scene after the first does: say what it shows, print the plan, run each layout under the scene's
budget, print what was measured."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from meshfit.demo.tables import measured_table, plan_table
from meshfit.demo.trial import Entry, Trial, run_trial
from meshfit.util.units import fmt_bytes, parse_bytes


def run_scene(intro: str, trials: list[Trial], budget: str, run_dir: Path, console: Console) -> list[Entry]:
    """`intro` is printed first, in bold up to its first period."""
    title, _, rest = intro.partition(". ")
    console.print(f"\n[bold]{title}.[/bold] {rest}")
    console.print(plan_table(trials, parse_bytes(budget)))
    entries = [run_trial(t, run_dir, budget, console) for t in trials]
    console.print(measured_table(entries, fmt_bytes(parse_bytes(budget))))
    return entries
