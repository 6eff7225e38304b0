"""PNG charts of measured per-rank memory (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

_PARTS = (("params", "parameters", "#4c72b0"), ("grads", "gradients", "#dd8452"),
          ("optim", "optimizer states", "#55a868"), ("activations", "activations", "#c44e52"),
          ("other", "other (buffers)", "#8172b3"))


def memory_chart(entries: list[dict[str, Any]], budget: int, path: Path) -> None:
    """Stacked bars: the most-loaded rank's breakdown at its peak, per layout, with the budget line."""
    mib = 2**20
    names = [e["layout"] for e in entries]
    worst = [max(e["mem"], key=lambda m: m["peak"]) if e["mem"] else {} for e in entries]
    fig, ax = plt.subplots(figsize=(1.6 * len(entries) + 2, 4.5))
    bottom = [0.0] * len(entries)
    for key, label, color in _PARTS:
        values = [w.get(key, 0) / mib for w in worst]
        ax.bar(names, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(budget / mib, color="black", linestyle="--", linewidth=1)
    ax.text(-0.45, budget / mib, f"budget {budget / mib:.0f} MiB", va="bottom", ha="left", fontsize=9)
    for i, e in enumerate(entries):
        ax.text(i, bottom[i], "fits" if e["fits"] else "over", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("MiB per rank (measured, at the peak)")
    ax.set_title("Per-rank memory by layout")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
