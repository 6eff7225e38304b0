"""`meshfit show`'s PNG plots: one series per run overlaid (loss, tokens/s, …) and per-rank memory by
category; the expert load of Mixture-of-Experts runs (show_moe.py). A name already taken gets a suffix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from meshfit.runs import show_moe
from meshfit.runs.run_dir import MEM_CATEGORIES, ShowError


class RunView(Protocol):
    """What a plot reads of a run (show.RunView): its step records and its legend label."""

    records: list[dict[str, Any]]

    @property
    def label(self) -> str: ...

_MIB = 2**20


def _free_path(path: Path) -> Path:
    """`path`, or path-2, path-3 ... when it exists: earlier plots are never overwritten."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def _save(fig: Figure, target: Path, bottom: float = 0.0) -> Path:
    """`bottom`: the share of the figure's height kept free for a legend below the panels."""
    FigureCanvasAgg(fig)  # Agg: no display needed, and no global pyplot state shared with other callers
    fig.tight_layout(rect=(0, bottom, 1, 1))
    try:
        fig.savefig(target, dpi=110)
    except OSError as exc:
        raise ShowError(f"cannot write {target}: {exc}") from None
    return target


def _styles(n: int) -> list[dict[str, str]]:
    # Line styles as well as colors: runs with equal values (common in memory) would hide each other.
    return [{"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[i % 4]} for i in range(n)]


def plot_series(runs: list[RunView], key: str, ylabel: str, title: str, path: Path) -> Path:
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    speed = key in ("tokens_per_s", "step_time_s")
    for run, style in zip(runs, _styles(len(runs))):
        ax.plot([r["step"] for r in run.records], [r[key] for r in run.records], **style, label=run.label)
        # Steps the per-operator memory tracker ran are slower: marking them explains the dips in speed.
        tracked = [r for r in run.records if any(m.get("measured") == "tracker" for m in r.get("mem") or [])]
        if speed and tracked:
            ax.plot([r["step"] for r in tracked], [r[key] for r in tracked], "o", color=style["color"],
                    fillstyle="none")
        evaluated = [r for r in run.records if "val_loss" in r]
        if key == "loss" and evaluated:  # validation loss: markers over the training curve, same color
            ax.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], "D", color=style["color"],
                    markersize=4, label=f"{run.label} (val)")
    if speed:
        title += " (○ = memory tracker on, slower)"
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    step_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def step_axis(ax: Any) -> None:
    """Ticks on whole steps only (matplotlib's default puts 1.5 between steps 1 and 2)."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def constant_range(ax: Any, values: list[float]) -> None:
    """A panel whose values never change (all-zero gradients between steps, parameters that stay put)
    gets the range 0 … a quarter above the value: autoscaling would stretch a flat line over the whole
    panel with ticks like ±0.04, which reads as data."""
    if values and max(values) - min(values) <= 1e-9 * max(1.0, abs(max(values))):
        top = max(values)
        ax.set_ylim(0, top * 1.25 if top > 0 else 1)


def plot_memory(runs: list[RunView], path: Path) -> Path:
    """One panel per category, x = step: every rank of every run, one color per run (ranks of a run in
    the same color: a layout shows up as a band, and an unbalanced one, e.g. a pipeline, as its spread)."""
    present = [c for c in MEM_CATEGORIES
               if any(c in m for run in runs for r in run.records for m in r.get("mem") or [])]
    cols = 3
    rows = -(-len(present) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows + 0.6))
    for i, category in enumerate(present):
        ax = fig.add_subplot(rows, cols, i + 1)
        values = []
        for run, style in zip(runs, _styles(len(runs))):
            world = max((len(r.get("mem") or []) for r in run.records), default=0)
            for rank in range(world):
                points = [(r["step"], r["mem"][rank].get(category, 0) / _MIB) for r in run.records
                          if len(r.get("mem") or []) > rank]
                values += [y for _, y in points]
                ax.plot(*zip(*points), **style, alpha=0.8, linewidth=1.2,
                        label=f"{run.label}, {world} rank{'s' * (world != 1)}" if rank == 0 else None)
        ax.set(title="total at the peak" if category == "peak" else category, xlabel="step", ylabel="MiB")
        step_axis(ax)
        constant_range(ax, values)
        ax.grid(alpha=0.3)
    fig.suptitle("per-rank memory by category at each rank's step peak (one line per rank)")
    handles, labels = fig.axes[0].get_legend_handles_labels() if fig.axes else ([], [])
    fig.legend(handles, labels, loc="lower center", fontsize=8, ncol=2)
    legend_inches = 0.15 + 0.22 * -(-len(labels) // 2)
    return _save(fig, path, bottom=legend_inches / fig.get_figheight())


def write_plots(runs: list[RunView], out: Path) -> list[tuple[Path, Path]]:
    """Writes the three plots into `out`; returns (written, wanted) paths: they differ when a file of the
    wanted name was already there (kept, the plot got the next free name)."""
    with_steps = [r for r in runs if r.records]
    if not with_steps:
        return []
    wanted = [out / f"show-{name}.png" for name in ("loss", "throughput", "memory")]
    loss, speed, memory = (_free_path(w) for w in wanted)
    written = [
        plot_series(with_steps, "loss", "loss", "loss", loss),
        plot_series(with_steps, "tokens_per_s", "tokens/s", "throughput", speed),
        plot_memory(with_steps, memory),
    ]
    if show_moe.has_moe(with_steps):  # Mixture-of-Experts runs: expert load per layer
        wanted.append(out / "show-experts.png")
        written.append(show_moe.plot_moe_load(with_steps, _free_path(wanted[-1]), _save))
    return list(zip(written, wanted))
