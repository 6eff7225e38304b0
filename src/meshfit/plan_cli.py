"""`meshfit plan` and `meshfit verify`: shared flags (model, cluster, workload, layout) and the two commands."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from meshfit.models.config import ATTENTIONS
from meshfit.parallel.recompute import AC_MODES
from meshfit.plan_cluster import DEFAULT_GPU, PlanInputError, resolve_cluster
from meshfit.planner.hardware import CPU, GPUS, Cluster, device_noun, headroom_words, is_cpu, mfu_basis
from meshfit.planner.layout import (OPTIMIZERS, PRECISIONS, Layout, Workload, parse_assignments,
                                    parse_layout)
from meshfit.names import did_you_mean
from meshfit.paths import check_out_file
from meshfit.units import fmt_bytes, fmt_count, fmt_duration, parse_bytes


# Flag types: argparse then refuses a bad value naming the flag (exit 2), before anything is computed.
def _number(kind: type, what: str, ok: Callable[[float], bool]) -> Callable[[str], Any]:
    """An argparse type: `kind(text)` that passes `ok`, else an error saying `expected {what}`."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value
    return parse


positive_int = _number(int, "a positive integer", lambda v: v >= 1)
positive_float = _number(float, "a positive number", lambda v: v > 0)
probability = _number(float, "a probability in [0, 1)", lambda v: 0 <= v < 1)


def memory_size(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 64GiB, got {text!r}")
    return value


def add_plan_arguments(parser: argparse.ArgumentParser, *, single_layout: bool) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="llama3-8b", metavar="PRESET|config.json",
                   help="a preset name (e.g. llama3-70b, gpt3-175b) or a Hugging Face config.json (default llama3-8b)")
    g.add_argument("--dims", default="", metavar="KEY=VAL,…",
                   help="custom dimensions on top of --model, e.g. dim=5120,n_layers=40,n_heads=40")
    g = parser.add_argument_group("cluster")
    g.add_argument("--gpu", default=None,
                   help=f"GPU model: {', '.join(GPUS)} (default {DEFAULT_GPU}), or cpu: CPU ranks as "
                        "`meshfit train` runs them, each under the budget --gpu-memory")
    g.add_argument("--hardware", type=Path, metavar="FILE",
                   help="measured rates from `meshfit calibrate --out FILE`, in place of the datasheet figures and "
                        "efficiency constants")
    # None when not given: verify then measures the --layout's world size instead of checking it.
    g.add_argument("--nodes", type=positive_int, default=None, help="nodes (default 1)")
    g.add_argument("--gpus-per-node", type=positive_int, default=None, help="GPUs per node (default 8)")
    g.add_argument("--gpu-memory", type=memory_size, metavar="SIZE", help="override the GPU's memory, e.g. 64GiB")
    g.add_argument("--gpu-tflops", type=positive_float, metavar="T", help="override the dense bf16 peak, TFLOP/s")
    g.add_argument("--intra-node-gbps", type=positive_float, metavar="GB/s",
                   help="override the per-GPU intra-node bandwidth")
    g.add_argument("--inter-node-gbps", type=positive_float, metavar="GB/s",
                   help="override the per-GPU inter-node bandwidth")
    g = parser.add_argument_group("workload")
    g.add_argument("--seq-len", type=positive_int, default=4096, help="sequence length in tokens (default 4096)")
    g.add_argument("--global-batch", type=positive_int, default=None, metavar="SEQUENCES",
                   help="sequences per optimizer step (default: 4 per GPU)")
    g.add_argument("--global-batch-tokens", type=positive_int, default=None, metavar="TOKENS",
                   help="global batch in tokens instead (a multiple of --seq-len)")
    g.add_argument("--micro-batch", type=positive_int, default=None,
                   help="sequences per forward pass (default: all choices)")
    g.add_argument("--precision", choices=PRECISIONS, default="mixed",
                   help="fp32 | mixed (bf16 compute, fp32 master weights and states) | bf16 (pure)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    g.add_argument("--attention", choices=ATTENTIONS, default="flash",
                   help="eager stores attention scores; flash (SDPA) does not")
    g.add_argument("--dropout", type=probability, default=0.0, metavar="P", help="dropout probability (default 0)")
    g.add_argument("--compile", action="store_true",
                   help="blocks under torch.compile (train.compile): their element-wise kernels fused" +
                        ("; not for verify, whose dry run runs the blocks eagerly" if single_layout else ""))
    g.add_argument("--activation-checkpointing", choices=AC_MODES, default=None,
                   help="fix the checkpointing mode (default: evaluate all)")
    g = parser.add_argument_group("output")
    g.add_argument("--layout", default=None, metavar="KEY=VAL,…",
                   help="evaluate exactly this layout (keys of the parallel/pipeline config, e.g. "
                        "dp_shard=64,zero_stage=2)" + (" — required" if single_layout else ""))
    g.add_argument("--json", action="store_true", help="print JSON instead of tables")
    if not single_layout:  # verify writes no file
        g.add_argument("--out", type=Path, metavar="FILE", help="write the plan (chosen layout) to FILE")
        g.add_argument("--overwrite", action="store_true", help="replace an existing --out file")


def resolve_model(spec: str, dims: str):  # -> (name, ModelConfig)
    from meshfit.models.config import ModelConfig
    from meshfit.models.hf import model_from_hf_config
    from meshfit.models.presets import PRESETS

    if spec.endswith(".json") or Path(spec).is_file():
        try:
            name, model = Path(spec).parent.name or spec, model_from_hf_config(spec)
        except ValueError as exc:  # the message starts with the file's name
            raise PlanInputError(f"--model {exc}") from None
    elif spec in PRESETS:
        name, model = spec, PRESETS[spec]
    else:
        raise PlanInputError(f"--model {spec!r}: not a preset or a config.json file; {did_you_mean(spec, PRESETS)}"
                             f"presets: {', '.join(PRESETS)}")
    try:
        changes = parse_assignments(dims, ModelConfig, "--dims")
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
    if changes:
        name, model = f"{name}+custom", dataclasses.replace(model, **changes)
    try:
        model.validate()
    except ValueError as exc:
        raise PlanInputError(f"{'--dims' if changes else '--model ' + spec}: {exc}") from None
    return name, model


def resolve_workload(args: argparse.Namespace, world: int) -> Workload:
    batch = args.global_batch
    if args.global_batch_tokens is not None:
        if batch is not None:
            raise PlanInputError("give --global-batch (sequences) or --global-batch-tokens, not both")
        if args.global_batch_tokens % args.seq_len:
            raise PlanInputError(f"--global-batch-tokens={args.global_batch_tokens} is not a multiple of "
                                 f"--seq-len={args.seq_len}")
        batch = args.global_batch_tokens // args.seq_len
    workload = Workload(seq_len=args.seq_len, global_batch=batch or 4 * world, precision=args.precision,
                        optimizer=args.optimizer, attention=args.attention, dropout=args.dropout,
                        compiled=args.compile)
    workload.check()
    return workload


def check_layout(model, layout, workload: Workload, cluster: Cluster | None = None) -> None:
    """Refuse, naming the flags, a layout that cannot run this model and workload (on this cluster)."""
    from meshfit.parallel.context_parallel import cp_degree_error
    from meshfit.parallel.dims import divisors
    from meshfit.parallel.rules import layout_error
    from meshfit.parallel.tensor_parallel import tp_degree_error

    if cluster is not None:
        refuse_cpu_offload(layout, is_cpu(cluster.gpu))
    if cluster is not None and layout.world_size != cluster.world_size:
        raise PlanInputError(f"--layout spans {layout.world_size} {device_noun(cluster.gpu, layout.world_size)} "
                             f"({layout.describe()}: pp × dp_replicate × dp_shard × cp × tp), the cluster "
                             f"{cluster.world_size} (--nodes {cluster.nodes} × --gpus-per-node "
                             f"{cluster.gpus_per_node}): make the two equal")
    if workload.seq_len > model.max_seq_len:
        raise PlanInputError(f"--seq-len {workload.seq_len} exceeds the model's max_seq_len {model.max_seq_len}; "
                             f"use --seq-len ≤ {model.max_seq_len} (or --dims max_seq_len=…)")
    error = cp_degree_error(layout.cp, workload.seq_len) if layout.cp > 1 else None
    error = error or layout_error(dp_shard=layout.dp_shard, dp_replicate=layout.dp_replicate, tp=layout.tp,
                                  pp=layout.pp, zero_stage=layout.zero_stage,
                                  offload=layout.offload, sp=layout.sp, loss_parallel=layout.loss_parallel,
                                  schedule=layout.schedule, virtual_stages=layout.virtual_stages, cp=layout.cp,
                                  mixed_precision=workload.precision != "fp32",
                                  activation_checkpointing=layout.activation_checkpointing, config_names=True)
    seq = "train.seq_len" if layout.cp == 1 else "train.seq_len/cp"
    # Under context parallelism sequence parallelism splits each rank's part of the sequence.
    error = error or (tp_degree_error(model, layout.tp, workload.seq_len // layout.cp, layout.sp, seq)
                      if layout.tp > 1 else None)
    if error:
        error = error.replace("parallel.", "--layout ").replace("pipeline.", "--layout ")
        raise PlanInputError(error.replace("train.seq_len", "--seq-len"))
    dp, batch = layout.dp, workload.global_batch
    if batch % dp:
        raise PlanInputError(f"--global-batch {batch} is not a multiple of the layout's data-parallel degree {dp} "
                             f"(dp_replicate × dp_shard); valid: {', '.join(str(dp * k) for k in range(1, 5))}, …")
    if (batch // dp) % layout.micro_batch:
        raise PlanInputError(f"micro-batch {layout.micro_batch} (--micro-batch, or micro_batch in --layout) does "
                             f"not divide the per-rank batch {batch // dp} (--global-batch {batch} / dp {dp}); "
                             f"valid: {', '.join(map(str, divisors(batch // dp)))}")


def refuse_cpu_offload(layout, cpu: bool) -> None:
    """Offload moves model states from device to host memory; CPU ranks have no other memory to move
    them to, so such a layout would only hide them from the budget (the search plans none on CPU)."""
    if cpu and layout.offload:
        raise PlanInputError("--layout offload=true moves parameters, gradients and optimizer states to host "
                             "memory, but on CPU ranks the host is the same memory (each rank's --gpu-memory "
                             "budget holds them either way): drop offload=true")


def _layout_error(exc: ValueError) -> PlanInputError:
    message = str(exc)  # Layout.check says "layout KEY=…": here the user wrote it as --layout
    return PlanInputError("--" + message if message.startswith("layout ") else message)


def _parse_layout(text: str):
    try:
        return parse_layout(text)
    except ValueError as exc:
        raise _layout_error(exc) from None


# Flags that set a field of the layout as well: (flag, layout key).
_LAYOUT_FLAGS = (("--micro-batch", "micro_batch"), ("--activation-checkpointing", "activation_checkpointing"))


def layout_from_args(args: argparse.Namespace):
    """--layout with --micro-batch / --activation-checkpointing applied; a flag that contradicts a key the
    layout sets itself is refused (never one silently over the other)."""
    text = args.layout or ""
    try:
        written = parse_assignments(text, Layout, "--layout")  # the keys and values as the parser reads them
    except ValueError as exc:
        raise _layout_error(exc) from None
    flags = {key: getattr(args, key) for _, key in _LAYOUT_FLAGS if getattr(args, key) is not None}
    for flag, key in _LAYOUT_FLAGS:
        if key in flags and key in written and written[key] != flags[key]:
            raise PlanInputError(f"{flag} {flags[key]} contradicts {key}={written[key]} in --layout: give it once")
    try:
        return parse_layout(text, base=dataclasses.replace(Layout(), **flags))
    except ValueError as exc:
        raise _layout_error(exc) from None


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
    from meshfit.planner.time_basis import close_runs, time_basis

    basis = time_basis(gpu, compiled)
    resting = "".join(f"; {r}" for r in basis.rests_on)
    lacking = f"; without {', '.join(basis.lacks)}" if basis.lacks else ""
    console.print(f"Step times: {basis.label} (measured error up to ±{basis.error:.0%}){resting}{lacking}.",
                  highlight=False)
    for first, last in close_runs(times, basis.error):
        console.print(f"  #{first + 1}–#{last + 1} are within ±{basis.error:.0%} of each other: the model "
                      "cannot tell which is faster.", highlight=False)


def cmd_plan(args: argparse.Namespace) -> int:
    from meshfit.planner.explain import explain
    from meshfit.planner.planfile import write_plan
    from meshfit.planner.search import Plan, evaluate, search

    if args.out is not None:  # checked before the search, which may take a while
        check_out_file(args.out, "--out", args.overwrite, "plan.json", make_parents=True)
    name, model = resolve_model(args.model, args.dims)
    # Flags are checked before the cluster: --gpu cpu without --hardware calibrates this machine first.
    layout = layout_from_args(args) if args.layout else None
    if layout is not None:  # before --gpu cpu calibrates this machine
        refuse_cpu_offload(layout, (args.gpu or "").strip().lower() == CPU)
    cluster = resolve_cluster(args)
    workload = resolve_workload(args, cluster.world_size)
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


def cmd_verify(args: argparse.Namespace) -> int:
    from meshfit.planner.estimate import estimate_memory, usable_bytes
    from meshfit.planner.verify import verify_layout

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
    workload = resolve_workload(args, layout.world_size)
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


def run(cmd, args: argparse.Namespace) -> int:
    try:
        return cmd(args)
    except (PlanInputError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

