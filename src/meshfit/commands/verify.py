"""`meshfit verify`: a dry run of one layout's real code at its full world size, one process on fake
tensors, next to the planner's prediction."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from meshfit.commands.cluster_flags import PlanInputError, resolve_cluster
from meshfit.commands.plan_flags import (
    add_plan_arguments,
    check_layout,
    layout_from_args,
    refusing_bad_input,
    resolve_model,
    resolve_workload,
)
from meshfit.hardware.catalog import headroom_words, is_cpu
from meshfit.util.units import fmt_bytes, fmt_count

NAME = "verify"


def add_parser(sub: Any, epilog: str) -> argparse.ArgumentParser:
    verify = sub.add_parser("verify", help="dry-run one layout's real code at full world size with fake tensors",
                            formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    add_plan_arguments(verify, single_layout=True)
    return verify


def run(args: argparse.Namespace) -> int:
    if not args.layout:
        print("error: meshfit verify needs --layout KEY=VAL,… (e.g. dp_shard=64,zero_stage=3)", file=sys.stderr)
        return 2
    return refusing_bad_input(cmd_verify, args)


def cmd_verify(args: argparse.Namespace) -> int:
    from meshfit.dryrun.verify import verify_layout
    from meshfit.planner.memory.estimate import estimate_memory, usable_bytes

    if args.compile:
        raise PlanInputError("--compile: meshfit verify's dry run runs under the memory tracker, where "
                             "torch.compile does not run, so it can only measure eager blocks (the planner "
                             "assumes compiled blocks keep the same memory); verify without --compile")
    name, model = resolve_model(args.model, args.dims)
    layout = layout_from_args(args)
    cluster = resolve_cluster(args, rates=False)
    if args.nodes is None and args.gpus_per_node is None:
        # No cluster given: the dry run measures the layout's own world size, on --gpu's memory.
        cluster = dataclasses.replace(cluster, nodes=1, gpus_per_node=layout.world_size)
    workload = resolve_workload(args, model, layout.world_size)
    check_layout(model, layout, workload, cluster)
    predicted = estimate_memory(model, layout, workload).as_dict()
    console = Console(stderr=True)
    progress = None if args.json else (lambda msg: console.print(f"[dim]{msg}[/dim]"))
    if progress is not None:
        from meshfit.models.config import num_params

        console.print(f"meshfit verify: {name} ({fmt_count(num_params(model))} params), layout {layout.describe()}, "
                      f"world size {layout.world_size}, seq {workload.seq_len}, global batch "
                      f"{workload.global_batch}, {workload.precision}: a dry run of the real code on fake tensors",
                      highlight=False, soft_wrap=True)
    result = verify_layout(model, layout, workload, progress=progress)
    if args.json:
        print(json.dumps({"model": name, "layout": layout.to_dict(), "world_size": layout.world_size,
                          "rank": result.rank, "per_rank_total": result.per_rank, "predicted": predicted,
                          "measured": result.measured,
                          "gpu": cluster.gpu.name, "usable_bytes": int(usable_bytes(cluster.gpu)),
                          "fits": result.measured["total"] <= usable_bytes(cluster.gpu),
                          "wall_s": result.wall_s, "max_rss_bytes": result.max_rss_bytes}, indent=1))
        return 0
    out = Console(width=None if Console().is_terminal else 120)
    # The title as whole phrases on lines of their own: a table title wraps at the table's width (about
    # 50 columns here), mid-phrase.
    out.print(f"[bold]{escape(name)}, {layout.describe()} at {layout.world_size} ranks: rank {result.rank}[/bold]\n"
              "predicted vs measured by a fake-tensor run of the real code", highlight=False, soft_wrap=True)
    table = Table()
    for col in ("component", "predicted", "measured", "error"):
        table.add_column(col, justify="left" if col == "component" else "right")
    for key in ("params", "grads", "optim", "activations", "buffers", "total"):
        p, m = predicted[key], result.measured[key]
        err = f"{(p - m) / m:+.1%}" if m else "-"
        table.add_row(key, fmt_bytes(p), fmt_bytes(m), err)
    out.print(table)
    usable = usable_bytes(cluster.gpu)
    peak = result.measured["total"]
    verdict = (f"fits: {fmt_bytes(peak)} of {fmt_bytes(usable)} usable" if peak <= usable else
               f"does not fit: {fmt_bytes(peak)} needed, {fmt_bytes(usable)} usable ({fmt_bytes(peak - usable)} "
               "too much)")
    device = "each CPU rank" if is_cpu(cluster.gpu) else cluster.gpu.name
    out.print(f"{device}: {verdict}\n({headroom_words(cluster.gpu)})\ndry run: {result.wall_s:.1f} s, "
              f"{fmt_bytes(result.max_rss_bytes)} peak process memory", highlight=False, soft_wrap=True)
    return 0
