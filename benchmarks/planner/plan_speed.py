"""How fast the planner ranks layouts: every candidate of large models on large clusters.

Run: python benchmarks/planner/plan_speed.py
Prints, per scenario, the layouts evaluated (memory estimate + step time each), how many fit, the
wall time of the search and the time per candidate. Goal: ≥ 10,000 candidates ranked in < 2 s.
"""

from __future__ import annotations

import time

from meshfit.hardware.catalog import Cluster
from meshfit.layout.layout import Workload
from meshfit.models.presets import get_preset
from meshfit.planner.search import search

SCENARIOS = [
    ("llama3-8b", Cluster("H100-SXM", nodes=8, gpus_per_node=8), Workload(seq_len=8192, global_batch=256)),
    ("llama3-70b", Cluster("H100-SXM", nodes=8, gpus_per_node=8), Workload(seq_len=8192, global_batch=256)),
    ("llama3-70b", Cluster("H100-SXM", nodes=32, gpus_per_node=8), Workload(seq_len=8192, global_batch=1024)),
    ("llama3-405b", Cluster("H100-SXM", nodes=64, gpus_per_node=8), Workload(seq_len=8192, global_batch=2048)),
]


def main() -> None:
    print(f"{'model':12s} {'cluster':18s} {'evaluated':>9s} {'fit':>6s} {'seconds':>8s} {'µs/layout':>10s}")
    for name, cluster, workload in SCENARIOS:
        model = get_preset(name)
        start = time.perf_counter()
        plan = search(model, workload, cluster, model_name=name)
        elapsed = time.perf_counter() - start
        n = len(plan.candidates)
        where = f"{cluster.nodes}×{cluster.gpus_per_node} {cluster.gpu.name}"
        print(f"{name:12s} {where:18s} {n:9d} {len(plan.fitting):6d} {elapsed:8.2f} {1e6 * elapsed / n:10.1f}")


if __name__ == "__main__":
    main()
