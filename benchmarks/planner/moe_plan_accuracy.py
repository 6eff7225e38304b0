"""Mixture-of-Experts layouts: the planner's per-rank peak against `meshfit verify`, component by component.

    python benchmarks/planner/moe_plan_accuracy.py            # small-moe on 4 ranks: ep 1/2/4 × ZeRO 1/2/3,
                                                              # planned, dry run and a real 4-rank CPU run
    python benchmarks/planner/moe_plan_accuracy.py --scale    # Mixtral 8x7B at 64 ranks, Qwen3-30B-A3B at 8-64
    python benchmarks/planner/moe_plan_accuracy.py --only ep=8
    python benchmarks/planner/moe_plan_accuracy.py --scale --measured runs/moe-scale.json  # keep dry runs

Each dry run runs in a fresh process (balanced routing, as the plan's default --moe-imbalance 1). Prints,
per case, predicted / measured GiB (MiB for small-moe) and the error of each component and of the total.

Rows are data (`Case`); columns are functions of a case (`COLUMNS`, name -> bytes by component), so a column
measured another way (a real multi-rank run's tracker peak) is one more entry there. With ``--measured FILE``
every column but the plan's is read from FILE when it holds the case, and written there when measured, so a
changed planner is compared again without dry-running again.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshfit.layout.layout import Layout, Workload
from meshfit.models.presets import get_preset
from meshfit.planner.memory.estimate import estimate_memory

PARTS = ("params", "grads", "optim", "activations", "buffers", "total")


@dataclass(frozen=True)
class Case:
    model: str
    layout: Layout
    workload: Workload

    @property
    def name(self) -> str:
        return f"{self.model} {self.layout.describe()}"


def _z(stage: int, ep: int) -> Layout:
    return Layout(dp_shard=4, zero_stage=stage, ep=ep)


SMALL = [Case("small-moe", _z(stage, ep), Workload(seq_len=512, global_batch=8))
         for ep in (1, 2, 4) for stage in (1, 2, 3)]
_Q = "qwen3-30b-a3b"
SCALE = [
    Case("mixtral-8x7b", Layout(dp_shard=64, zero_stage=3, ep=8), Workload(seq_len=4096, global_batch=64)),
    Case("mixtral-8x7b", Layout(dp_replicate=8, dp_shard=8, zero_stage=3, ep=8),
         Workload(seq_len=4096, global_batch=64)),
    # 4 local experts over 32 edp ranks, and without ep 8 experts over 64 ranks: FSDP splits the experts'
    # rows where the experts do not split evenly (layout/expert_sharding.py).
    Case("mixtral-8x7b", Layout(dp_shard=64, zero_stage=3, ep=2), Workload(seq_len=4096, global_batch=64)),
    Case("mixtral-8x7b", Layout(dp_shard=64, zero_stage=3), Workload(seq_len=4096, global_batch=64)),
    *(Case(_Q, Layout(dp_shard=n, zero_stage=3, ep=ep), Workload(seq_len=4096, global_batch=n))
      for n, eps in ((8, (1, 2, 8)), (16, (4, 16)), (32, (8,)), (64, (16, 64))) for ep in eps),
    # The MoE MLP whole on each tp rank (routing the sequence slice under SP); cp ranks route their chunks.
    *(Case(_Q, Layout(dp_shard=4, zero_stage=3, ep=4, **extra), Workload(seq_len=4096, global_batch=4))
      for extra in ({"tp": 2}, {"tp": 2, "sp": True}, {"cp": 2})),
]


def planned(case: Case) -> dict[str, int]:
    return estimate_memory(get_preset(case.model), case.layout, case.workload).as_dict()


def _verify_in_child(case: Case, out: mp.Queue) -> None:
    from meshfit.dryrun.verify import verify_layout

    out.put(verify_layout(case.model, case.layout, case.workload).measured)


def dry_run(case: Case) -> dict[str, int]:
    """`meshfit verify`'s measured peak, in a fresh process (its own fake world and RSS)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_verify_in_child, args=(case, out))
    proc.start()
    measured = out.get()
    proc.join()
    return measured


def real_run(case: Case) -> dict[str, int]:
    """A real run of the case on local CPU ranks (gloo), 3 steps: the tracker's breakdown of the most-loaded
    rank in the step of its peak (steps 2-3: optimizer states exist), as `meshfit demo` reads it."""
    import tempfile

    from meshfit.demo.trial import peak_step
    from meshfit.dryrun.verify import verify_config
    from meshfit.train.launch import launch

    cfg = verify_config(case.model, case.layout, case.workload)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 3, "log_every": 1})})
    with tempfile.TemporaryDirectory() as tmp:
        outcome = launch(cfg, Path(tmp) / "run", case.layout.world_size)
        if not outcome.ok:
            raise SystemExit(f"{case.name}: the real run failed: {outcome.message}")
        _, mem = peak_step(Path(tmp) / "run", outcome.result)
    worst = max(mem, key=lambda m: m["peak"])
    return {"params": worst["params"], "grads": worst["grads"], "optim": worst["optim"],
            "activations": worst["activations"], "buffers": worst["other"], "total": worst["peak"]}


# The reference column first; every other column is compared with it. Real runs: the small cases only.
COLUMNS: dict[str, Callable[[Case], dict[str, int]]] = {"verify": dry_run, "plan": planned}
REAL = {"real": real_run}


def _error(value: int, reference: int) -> str:
    return f"{(value / reference - 1) * 100:+6.1f}%" if reference else "     -"


def print_row(case: Case, values: dict[str, dict[str, int]], unit: float, unit_name: str) -> None:
    reference_name, reference = next(iter(values.items()))
    print(f"{case.name}  (seq {case.workload.seq_len}, global batch {case.workload.global_batch})", flush=True)
    print(f"  {'':10s}" + "".join(f"{p:>22s}" for p in PARTS))
    for name, got in values.items():
        cells = "".join(f"{got[p] / unit:10.2f} {unit_name}" + (f" {_error(got[p], reference[p])}"
                        if name != reference_name else " " * 8) for p in PARTS)
        print(f"  {name:10s}{cells}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", action="store_true", help="the large models (each dry run 1-3 minutes)")
    parser.add_argument("--only", default="", help="cases whose name contains this text")
    parser.add_argument("--measured", type=Path, default=None, help="JSON file keeping the measured columns")
    args = parser.parse_args()
    cases, (unit, unit_name) = (SCALE, (2**30, "GiB")) if args.scale else (SMALL, (2**20, "MiB"))
    kept = json.loads(args.measured.read_text()) if args.measured and args.measured.exists() else {}
    for case in (c for c in cases if args.only in c.name):
        row = kept.setdefault(case.name, {})
        columns = COLUMNS if args.scale else {**COLUMNS, **REAL}
        for name, column in columns.items():
            if name == "plan" or name not in row:
                row[name] = column(case)
        if args.measured:
            args.measured.write_text(json.dumps(kept, indent=1) + "\n")
        print_row(case, {name: row[name] for name in columns}, unit, unit_name)


if __name__ == "__main__":
    main()
