"""The flags `meshfit plan` and `meshfit verify` share (model, cluster, workload, layout) and what they
resolve to; each refusal names the flag and what would be valid."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from meshfit.commands.cluster_flags import DEFAULT_GPU, PlanInputError
from meshfit.commands.flags import at_least_one, memory_size, positive_float, positive_int, probability
from meshfit.hardware.catalog import GPUS, Cluster, device_noun, is_cpu
from meshfit.layout.layout import OPTIMIZERS, PRECISIONS, Layout, Workload, parse_assignments, parse_layout
from meshfit.layout.recompute import AC_MODES
from meshfit.models.config import ATTENTIONS
from meshfit.util.did_you_mean import did_you_mean

DEFAULT_SEQ_LEN = 4096  # tokens, when the model has positions for them


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
                   help="measured rates from `meshfit calibrate --out FILE`, in place of the datasheet figures, "
                        "published kernel rates and efficiency constants")
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
    g.add_argument("--seq-len", type=positive_int, default=None,
                   help=f"sequence length in tokens (default {DEFAULT_SEQ_LEN}, or the model's max_seq_len when "
                        "it has fewer positions)")
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
    g.add_argument("--document-mask", action="store_true",
                   help="packed documents kept apart (data.document_mask): counts each micro-batch's attention mask")
    if not single_layout:  # verify's dry run routes balanced: it measures factor 1 only
        g.add_argument("--moe-imbalance", type=at_least_one, default=1.0, metavar="F",
                       help="Mixture-of-Experts models: the most-loaded rank's routed tokens over the balanced "
                            "share, scaling its routed-token buffers, expert GEMMs and all-to-alls under "
                            "expert parallelism (default 1: balanced routing, as the dry run routes and "
                            "published benchmarks force it)")
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
    from meshfit.config.model_source import with_overrides
    from meshfit.models.config import ModelConfig
    from meshfit.models.hf import model_from_hf_config
    from meshfit.models.presets import PRESETS

    if spec.endswith(".json") or Path(spec).is_file():
        try:
            name, model = Path(spec).parent.name or spec, model_from_hf_config(spec)
            name = spec if name in PRESETS else name  # a preset's name stands for the preset's shape
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
        name, model = f"{name}+custom", with_overrides(model, changes)
    try:
        model.validate()
    except ValueError as exc:
        raise PlanInputError(f"{'--dims' if changes else '--model ' + spec}: {exc}") from None
    return name, model


def default_seq_len(model) -> int:
    """--seq-len when not given: DEFAULT_SEQ_LEN tokens, or fewer where the model has fewer positions (or a
    shorter sliding window)."""
    return min(DEFAULT_SEQ_LEN, model.max_seq_len, model.sliding_window or model.max_seq_len)


def resolve_seq_len(args: argparse.Namespace, model) -> int:
    """--seq-len, or its default for `model`; longer than the model's positions is refused, by the check
    `meshfit train` makes (layout/model_fit.py)."""
    from meshfit.layout.model_fit import seq_len_error

    seq = args.seq_len or default_seq_len(model)
    if error := seq_len_error(seq, model, "--seq-len", "--dims max_seq_len=…"):
        raise PlanInputError(error)
    return seq


def resolve_workload(args: argparse.Namespace, model, world: int) -> Workload:
    """The workload of the flags for `model` on `world` ranks."""
    seq = resolve_seq_len(args, model)
    batch = args.global_batch
    if args.global_batch_tokens is not None:
        if batch is not None:
            raise PlanInputError("give --global-batch (sequences) or --global-batch-tokens, not both")
        if args.global_batch_tokens % seq:
            raise PlanInputError(f"--global-batch-tokens={args.global_batch_tokens} is not a multiple of "
                                 f"--seq-len={seq}")
        batch = args.global_batch_tokens // seq
    workload = Workload(seq_len=seq, global_batch=batch or 4 * world, precision=args.precision,
                        optimizer=args.optimizer, attention=args.attention, dropout=args.dropout,
                        compiled=args.compile, document_mask=args.document_mask,
                        moe_imbalance=getattr(args, "moe_imbalance", 1.0))
    workload.check()
    return workload


def check_layout(model, layout, workload: Workload, cluster: Cluster | None = None) -> None:
    """Refuse, naming the flags, a layout that cannot run this model and workload (on this cluster)."""
    from meshfit.planner.layout_check import FLAGS, layout_fit_error

    if cluster is not None:
        refuse_cpu_offload(layout, is_cpu(cluster.gpu))
    if cluster is not None and layout.world_size != cluster.world_size:
        raise PlanInputError(f"--layout spans {layout.world_size} {device_noun(cluster.gpu, layout.world_size)} "
                             f"({layout.describe()}: pp × dp_replicate × dp_shard × cp × tp), the cluster "
                             f"{cluster.world_size} (--nodes {cluster.nodes} × --gpus-per-node "
                             f"{cluster.gpus_per_node}): make the two equal")
    if error := layout_fit_error(model, layout, workload, FLAGS):
        raise PlanInputError(error)


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


def refusing_bad_input(cmd: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a plan or verify command; a flag it refuses is one error line and exit 2, not a traceback."""
    try:
        return cmd(args)
    except (PlanInputError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
