"""Planning a layout before renting the cluster: hardware catalog and analytic per-rank memory.

Pure arithmetic on plain numbers and dataclasses (no torch import), so it runs anywhere and can reason
about models far too large to build.
"""

from __future__ import annotations

from meshfit.planner.hardware import GPU, GPUS, Cluster, get_gpu
from meshfit.planner.memory import (
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    activation_bytes_per_layer,
    activation_terms_per_layer,
    model_state_bytes,
    pipeline_in_flight_microbatches,
)

__all__ = [
    "GPU",
    "GPUS",
    "OPTIMIZERS",
    "PRECISIONS",
    "RECOMPUTE",
    "SCHEDULES",
    "Cluster",
    "activation_bytes_per_layer",
    "activation_terms_per_layer",
    "get_gpu",
    "model_state_bytes",
    "pipeline_in_flight_microbatches",
]
