"""The demo's console: tables of planned and measured MiB per rank, and the texts that explain the losses."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from meshfit.demo.trial import DEMO_STEPS, PROBE_STEPS, Entry, Trial, predict

WIDTH = 100  # console columns: tables and lines fit in this
MIB = 2**20


def _mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def _table(title: str, columns: list[str], left: tuple[str, ...] = ("layout", "fits?")) -> Table:
    table = Table(title=title, title_justify="left", caption_justify="left")
    for col in columns:
        # Cells never wrap: a value is one token ("104.6"), and the table is narrower than WIDTH.
        table.add_column(col, justify="left" if col in left else "right", no_wrap=True, overflow="ellipsis")
    return table


def plan_table(trials: list[Trial], budget: int) -> Table:
    table = _table(f"the plan: predicted MiB per rank (most-loaded rank) vs the {_mib(budget)} MiB budget",
                   ["layout", "ranks", "peak", "params", "grads", "optim", "activ.", "buffers", "fits?"])
    for t in trials:
        m = predict(t).as_dict()
        table.add_row(t.name, str(t.nproc), _mib(m["total"]),
                      *(_mib(m[k]) for k in ("params", "grads", "optim", "activations", "buffers")),
                      "[green]yes[/green]" if m["total"] <= budget else "[red]no[/red]")
    return table


def accuracy_table(entries: list[Entry]) -> Table:
    table = _table("predicted (planner) vs measured MiB per rank",
                   ["layout", "predicted", "measured", "error"])
    for e in entries:
        pred, meas = e.predicted.get("total"), e.peak_mem_bytes
        table.add_row(e.layout, _mib(pred), _mib(meas), f"{(pred - meas) / meas:+.1%}" if meas else "-")
    return table


def measured_table(entries: list[Entry], budget: str) -> Table:
    table = _table(f"measured MiB per rank (most-loaded rank, at its peak) under the {budget} budget",
                   ["layout", "ranks", "fits?", "peak", "params", "grads", "optim", "activ.", "other",
                    "final loss"])
    for e in entries:
        worst = max(e.mem, key=lambda m: m["peak"]) if e.mem else {}
        table.add_row(e.layout, str(e.ranks), "[green]yes[/green]" if e.fits else "[red]no*[/red]",
                      _mib(e.peak_mem_bytes),
                      *(_mib(worst.get(k)) for k in ("params", "grads", "optim", "activations", "other")),
                      f"{e.final_loss:.4f}" if e.final_loss is not None else "-")
    if not all(e.fits for e in entries):
        table.caption = f"* over the budget: measured in a {PROBE_STEPS}-step run without it"
    return table


def parity_text(entries: list[Entry]) -> str | None:
    """Why every layout that fits ends at the same loss, with the measured spread of those losses."""
    losses = [e.final_loss for e in entries if e.fits and e.final_loss is not None]
    if len(losses) < 2:
        return None
    spread = max(losses) - min(losses)
    return (f"Every layout that fits ends at the same loss, {min(losses):.4f} (largest difference between them: "
            f"{spread:.1e}). Each trains the same model, initialised from the same seed, on the same batches "
            f"in the same order; a layout changes only where tensors live and how ranks exchange them, so each "
            f"computes what one device would, up to float rounding (sums added in another order; the parity "
            f"tests hold every layout to 1e-5 of a one-process run).")


def floor_text(floor: dict[str, float] | None, losses: list[float]) -> str | None:
    """What the synthetic data's loss floor is, and how far the demo's short runs are from it."""
    if floor is None:
        return None
    where = f" ({min(losses):.4f} after {DEMO_STEPS} steps)" if losses else ""
    return (f"The loss floor: the data is a synthetic Markov chain over {floor['vocab']} tokens (each token has "
            f"{floor['successors']} likely successors with Dirichlet({floor['alpha']:g}) weights, and a "
            f"{floor['restart']:g} chance of any token instead). Its entropy rate, {floor['floor']:.2f} "
            f"nats/token, is the lowest loss any model can reach on it. Training starts near ln "
            f"{floor['vocab']} = {floor['uniform']:.2f} (a uniform guess); the demo's runs measure memory, so "
            f"their loss{where} has only begun to fall toward the floor.")


def make_console() -> Console:
    """At most WIDTH columns: the terminal's width when narrower; WIDTH when stdout is not a terminal."""
    probe = Console()
    return Console(width=min(probe.width, WIDTH) if probe.is_terminal else WIDTH)
