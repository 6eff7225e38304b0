"""`meshfit plan`: rank every layout of a model on a cluster by predicted per-rank memory and step time."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from meshfit.commands.cluster_flags import PlanInputError, resolve_cluster
from meshfit.commands.flags import positive_int
from meshfit.commands.plan_flags import (
    add_plan_arguments,
    check_layout,
    layout_from_args,
    refuse_cpu_offload,
    refusing_bad_input,
    resolve_model,
    resolve_seq_len,
    resolve_workload,
)
from meshfit.hardware.catalog import CPU, device_noun, is_cpu, mfu_basis
from meshfit.layout.layout import Workload
from meshfit.util.paths import check_out_file
from meshfit.util.units import fmt_bytes, fmt_count, fmt_duration

NAME = "plan"


def add_parser(sub: Any, epilog: str) -> argparse.ArgumentParser:
    plan = sub.add_parser("plan", help="rank every layout of a model on a cluster by predicted memory and speed",
                          formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    add_plan_arguments(plan, single_layout=False)
    plan.add_argument("--explain", action="store_true", help="explain which techniques are needed and why")
    plan.add_argument("--top", type=positive_int, default=None, metavar="N",
                      help="rows in the table (default 10) / candidates in --json (default all)")
    return plan


def run(args: argparse.Namespace) -> int:
    return refusing_bad_input(cmd_plan, args)


def _layout_table(plan, rows, title: str) -> Table:
    table = Table(title=title)
    for col in ("#", "layout", "fits", "peak/rank", "params", "grads", "optim", "acts", "buffers", "step time",
                "tokens/s", "MFU"):
        table.add_column(col, justify="left" if col in ("layout", "fits") else "right")
    for i, c in enumerate(rows, 1):
        m = c.memory.as_dict()
        table.add_row(str(i), c.layout.describe(), "[green]yes[/green]" if c.fits else "[red]no[/red]",
                      fmt_bytes(m["total"]), *(fmt_bytes(m[k]) for k in ("params", "grads", "optim", "activations",
                                                                         "buffers")),
                      fmt_duration(c.time.total_s), f"{c.time.tokens_per_s:,.0f}", f"{c.time.mfu:.0%}")
    return table


def _say_how_sure(console: Console, gpu: Any, times: list[float], compiled: bool) -> None:
    """What the step times rest on, their measured error, and the fitting rows they cannot order."""
    from meshfit.planner.timing.basis import close_runs, time_basis

    basis = time_basis(gpu, compiled)
    resting = "".join(f"; {r}" for r in basis.rests_on)
    lacking = f"; without {', '.join(basis.lacks)}" if basis.lacks else ""
    console.print(f"Step times: {basis.label} (measured error up to ±{basis.error:.0%}){resting}{lacking}.",
                  highlight=False)
    for first, last in close_runs(times, basis.error):
        console.print(f"  #{first + 1}–#{last + 1} are within ±{basis.error:.0%} of each other: the model "
                      "cannot tell which is faster.", highlight=False)


def _refuse_untrainable(args: argparse.Namespace, seq: int) -> None:
    """--out writes a plan for `meshfit train --plan`: refuse a workload that command would refuse."""
    from meshfit.planner.planfile import check_trainable

    try:
        check_trainable(Workload(seq_len=seq, global_batch=1, precision=args.precision, optimizer=args.optimizer))
    except ValueError as exc:
        raise PlanInputError(f"--out writes a plan for `meshfit train --plan`, which would refuse this one: {exc}; "
                             "or plan without --out") from None


def cmd_plan(args: argparse.Namespace) -> int:
    from meshfit.planner.explain import explain
    from meshfit.planner.planfile import write_plan
    from meshfit.planner.search import Plan, evaluate, search

    name, model = resolve_model(args.model, args.dims)
    seq = resolve_seq_len(args, model)  # before --gpu cpu calibrates this machine
    if args.out is not None:  # checked before the search, which may take a while
        check_out_file(args.out, "--out", args.overwrite, "plan.json", make_parents=True)
        _refuse_untrainable(args, seq)
    # Flags are checked before the cluster: --gpu cpu without --hardware calibrates this machine first.
    layout = layout_from_args(args) if args.layout else None
    if layout is not None:  # before --gpu cpu calibrates this machine
        refuse_cpu_offload(layout, (args.gpu or "").strip().lower() == CPU)
    cluster = resolve_cluster(args)
    workload = resolve_workload(args, model, cluster.world_size)
    if layout is not None:
        check_layout(model, layout, workload, cluster)
        plan = Plan(model=model, model_name=name, workload=workload, cluster=cluster,
                    candidates=[evaluate(model, layout, workload, cluster)])
    else:
        plan = search(model, workload, cluster, model_name=name, activation_checkpointing=args.activation_checkpointing,
                      micro_batch=args.micro_batch)
    if not plan.candidates:
        raise PlanInputError("no layout can run this workload on this cluster (check that --global-batch is a "
                             "multiple of the data-parallel degrees, that --micro-batch divides the per-rank batch "
                             "and that the model's heads divide the GPUs per node)")
    chosen = plan.candidates[0]
    if args.out:
        write_plan(args.out, plan, chosen)
    if args.json:
        print(json.dumps(plan.to_json(top=args.top), indent=1))
        return 0
    console = Console(width=None if Console().is_terminal else 160)
    usable = plan.to_json(top=0)["cluster"]["usable_bytes"]
    gpu = cluster.gpu
    where = (f"{cluster.world_size} CPU ranks ({cluster.nodes} × {cluster.gpus_per_node})" if is_cpu(gpu) else
             f"{cluster.nodes} × {cluster.gpus_per_node} {gpu.name}")
    console.print(f"[bold]{name}[/bold] ({fmt_count(plan.to_json(top=0)['model']['params'])} params) on "
                  f"{where}, seq {workload.seq_len}, global batch "
                  f"{workload.global_batch} sequences, {workload.precision}, {workload.optimizer}: "
                  f"{len(plan.fitting)} of {len(plan.candidates)} layouts fit in {fmt_bytes(usable)} usable per "
                  f"{device_noun(gpu, 1)}")
    console.print(_layout_table(plan, plan.candidates[:args.top or 10], "best layouts (most-loaded rank; "
                                                                        "fitting ones by throughput)"))
    _say_how_sure(console, gpu, [c.time.total_s for c in plan.candidates[:args.top or 10] if c.fits],
                  plan.workload.compiled)
    if gpu.profile is not None:  # a measured rate, not a datasheet peak: say so, as it can read near 100%
        console.print(f"MFU is relative to {mfu_basis(gpu)}: a layout that loses little to communication, "
                      "bubbles and recompute reads near 100%.", highlight=False)
    failing = sorted((c for c in plan.candidates if not c.fits), key=lambda c: -c.time.tokens_per_s)[:5]
    if failing:
        console.print("[bold]Faster layouts that do not fit[/bold]:")
        for c in failing:
            console.print(f"  {c.layout.describe()}: {c.time.tokens_per_s:,.0f} tokens/s would be possible, but it "
                          f"{c.why}")
    if args.explain:
        console.print()
        console.print(explain(plan), highlight=False, markup=False)
    if args.out:
        console.print(f"plan written to {args.out}: run it with `meshfit train --plan {args.out}`")
    return 0
