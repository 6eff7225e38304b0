"""Bytes per value for each precision and optimizer: the one table the planner's memory and time models read.

* compute: a value the matmuls read and write (activations, gathered weight copies);
* storage: a kept weight, gradient or optimizer-state element.

"mixed" computes in bf16 and keeps fp32 weights, gradients and AdamW moments (what meshfit trains); "bf16"
keeps everything in bf16 (planned only). The ZeRO paper's accounting of mixed precision (Rajbhandari et al.
2020) instead counts 16-bit weights and gradients plus an fp32 master copy with the optimizer states.
"""

from __future__ import annotations

PRECISIONS = ("fp32", "mixed", "bf16")
OPTIMIZERS = ("adamw", "sgd")  # sgd: with momentum

COMPUTE_BYTES = {"fp32": 4, "mixed": 2, "bf16": 2}
STORAGE_BYTES = {"fp32": 4, "mixed": 4, "bf16": 2}
# Optimizer-state tensors per parameter, each in the storage dtype: AdamW's two moments, SGD's momentum.
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1}


def state_bytes(precision: str, optimizer: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes per parameter as meshfit keeps them."""
    s = STORAGE_BYTES[precision]
    return s, s, s * OPTIMIZER_STATES[optimizer]


def paper_state_bytes(precision: str, optimizer: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state K) bytes per parameter in the ZeRO paper's accounting: compute-dtype
    weights and gradients; K holds the states and, when the compute dtype is narrower than the storage
    dtype, the master weights (mixed-precision AdamW: K = 12)."""
    c, s = COMPUTE_BYTES[precision], STORAGE_BYTES[precision]
    master = 1 if c != s else 0
    return c, c, s * (OPTIMIZER_STATES[optimizer] + master)
