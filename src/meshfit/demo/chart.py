"""PNG charts of measured per-rank memory (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.patches import Patch  # noqa: E402

_PARTS = (("params", "parameters", "#4c72b0"), ("grads", "gradients", "#dd8452"),
          ("optim", "optimizer states", "#55a868"), ("activations", "activations", "#c44e52"),
          ("other", "other (buffers)", "#8172b3"))
UNBUDGETED = "measured without budget"  # the label of a layout that went over: its figures come from a rerun


def bar_label(entry: dict[str, Any]) -> str:
    """The x-axis label of a layout's bar: its name and how many ranks it ran on."""
    ranks = entry.get("ranks")
    return f"{entry['layout']}\n({ranks} rank{'s' if ranks != 1 else ''})" if ranks else entry["layout"]


def bar_note(entry: dict[str, Any]) -> str:
    """The note above a layout's bar: it fits, or it went over and was measured in a run without the budget."""
    return "fits" if entry["fits"] else f"over\n{UNBUDGETED}"


def memory_chart(entries: list[dict[str, Any]], budget: int, path: Path) -> None:
    """Stacked bars: the most-loaded rank's breakdown at its peak, per layout, with the budget line. The bars
    of layouts that went over the budget are hatched: they were measured in a run without it."""
    mib = 2**20
    names = [bar_label(e) for e in entries]
    worst = [max(e["mem"], key=lambda m: m["peak"]) if e["mem"] else {} for e in entries]
    hatches = ["" if e["fits"] else "//" for e in entries]
    fig, ax = plt.subplots(figsize=(1.6 * len(entries) + 2, 5))
    bottom = [0.0] * len(entries)
    for key, label, color in _PARTS:
        values = [w.get(key, 0) / mib for w in worst]
        bars = ax.bar(names, values, bottom=bottom, color=color, edgecolor="white", linewidth=0.5)
        for bar, hatch in zip(bars, hatches):
            bar.set_hatch(hatch)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(budget / mib, color="black", linestyle="--", linewidth=1)
    ax.text(len(entries) - 0.55, budget / mib, f"budget {budget / mib:.0f} MiB", va="bottom", ha="right", fontsize=9)
    for i, e in enumerate(entries):
        ax.text(i, bottom[i], bar_note(e), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max([budget / mib, *bottom]) * 1.22)
    ax.set_ylabel("MiB per rank (most-loaded rank, at its peak)")
    ax.set_title("Per-rank memory by layout (measured)")
    handles: list[Any] = [Patch(facecolor=color) for _, _, color in _PARTS]
    labels = [label for _, label, _ in _PARTS]
    if not all(e["fits"] for e in entries):
        handles.append(Patch(facecolor="white", edgecolor="grey", hatch="//"))
        labels.append(f"over the budget: {UNBUDGETED}")
    ax.legend(handles, labels, fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
