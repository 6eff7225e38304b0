"""Activation recompute policies: what a transformer block keeps for backward and what it recomputes.

* ``none``: every saved tensor is kept.
* ``op``: op-level selective checkpointing (torch's ``create_selective_checkpoint_contexts``): every block
  keeps its input and the outputs of its matmuls, attention kernels and collectives; norms, activations,
  dropout and other element-wise ops are recomputed in backward (torchtitan's selective "op" policy,
  keeping every matmul).
* ``attention``: the attention core (scores, softmax, its dropout; or the fused kernel) is recomputed from
  q, k and v, everything else is kept (Korthikanti et al. 2022's selective recomputation).
* ``selective``: every ``ac_every``-th block of each pipeline stage is checkpointed in full.
* ``full``: every block keeps only its input and re-runs its forward in backward.
"""

from __future__ import annotations

from collections.abc import Iterable

AC_MODES = ("none", "op", "attention", "selective", "full")
AC_EVERY = 2  # parallel.ac_every's default, which the planner assumes
# Policies whose operators are counted directly (planner/timing/op_count.py) and whose compiled launches a
# hardware profile holds; "selective" mixes "full" (every second block of each stage) and "none".
COUNTED_POLICIES = ("none", "full", "op", "attention")


def checkpointed_blocks(n_layers: int, mode: str, every: int = AC_EVERY) -> list[int]:
    """Indices of a stage's (or an unpipelined model's) blocks checkpointed whole: all ("full", "op"),
    every k-th ("selective"), none. The trainer applies it to each pipeline stage's blocks."""
    if mode in ("full", "op"):
        return list(range(n_layers))
    if mode == "selective":
        return [i for i in range(n_layers) if i % every == every - 1] if every > 1 else list(range(n_layers))
    return []


def rerun_blocks(stage_layers: Iterable[int], mode: str) -> int:
    """Blocks of these stages whose whole forward runs again in backward ("full", "selective")."""
    if mode not in ("full", "selective"):
        return 0
    return sum(len(checkpointed_blocks(n, mode)) for n in stage_layers)
