"""Activation recompute policies: what a transformer block keeps for backward and what it recomputes.

* ``none``: every saved tensor is kept.
* ``op``: op-level selective checkpointing (torch's ``create_selective_checkpoint_contexts``): every block
  keeps its input and the outputs of its matmuls, attention kernels and collectives; norms, activations,
  dropout and other element-wise ops are recomputed in backward (torchtitan's selective "op" policy,
  keeping every matmul).
* ``attention``: the attention core (scores, softmax, its dropout; or the fused kernel) is recomputed from
  q, k and v, everything else is kept (Korthikanti et al. 2022's selective recomputation).
* ``selective``: every ``ac_every``-th block is checkpointed in full.
* ``full``: every block keeps only its input and re-runs its forward in backward.
"""

from __future__ import annotations

AC_MODES = ("none", "op", "attention", "selective", "full")
