"""`meshfit show` for Mixture-of-Experts runs: how evenly each layer's router spread the tokens.

A step record of such a run (train/records.py) holds, per Mixture-of-Experts layer, the load ``max / mean``
tokens per expert (1.0: balanced; E: every token on one expert), with the step's auxiliary loss and dropped
token copies. The table gives each run's last step; the plot one line per layer over the steps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from rich.table import Table

MOE_KEY = "moe_load"


def has_moe(runs: list[Any]) -> bool:
    return any(MOE_KEY in r for run in runs for r in run.records)


def moe_table(runs: list[Any]) -> Table:
    """Each Mixture-of-Experts run's last step: load per layer, auxiliary loss, dropped token copies."""
    table = Table(title="expert load (last step; max / mean tokens per expert, 1.0 = balanced)")
    for column in ("run", "step", "aux loss", "dropped", "load by layer"):
        table.add_column(column, justify="left" if column in ("run", "load by layer") else "right")
    for run in runs:
        records = [r for r in run.records if MOE_KEY in r]
        if not records:
            continue
        last = records[-1]
        loads = ", ".join(f"{layer}: {load:.2f}" for layer, load in zip(last["moe_layers"], last[MOE_KEY]))
        table.add_row(run.label, str(last["step"]), f"{last['moe_aux_loss']:.4g}", str(last["moe_dropped_tokens"]),
                      loads)
    return table


def plot_moe_load(runs: list[Any], path: Path, save: Callable[[Figure, Path], Path]) -> Path:
    """Load (max / mean tokens per expert) of every layer over the steps, one panel per run; `save` writes
    the figure as `meshfit show` writes its plots."""
    moe_runs = [run for run in runs if any(MOE_KEY in r for r in run.records)]
    fig = Figure(figsize=(8, 3.6 * len(moe_runs)))
    for i, run in enumerate(moe_runs):
        ax = fig.add_subplot(len(moe_runs), 1, i + 1)
        records = [r for r in run.records if MOE_KEY in r]
        layers = records[-1]["moe_layers"]
        for j, layer in enumerate(layers):
            ax.plot([r["step"] for r in records], [r[MOE_KEY][j] for r in records], label=f"layer {layer}",
                    color=f"C{j % 10}", linestyle=("-", "--", ":", "-.")[j // 10 % 4])
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=f"{run.label}: expert load per layer", xlabel="step", ylabel="max / mean tokens")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(layers) <= 20:
            ax.legend(fontsize=7, ncol=4)
    return save(fig, path)
