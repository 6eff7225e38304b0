"""`meshfit eval`: a model's mean token loss and perplexity on a token file, under any layout, without
training it or making a run directory."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from meshfit.commands.flags import OVERSUBSCRIBE_HELP, positive_int
from meshfit.config import ConfigError

NAME = "eval"

EXAMPLES = """\
examples:
  meshfit eval runs/exp1 --data val.npy --seq-len 256 --windows 8      the run's latest intact checkpoint
  meshfit eval hf/exp1 --data val.npy --seq-len 256 --windows 8 --json  a Hugging Face folder
  meshfit eval runs/exp1/checkpoints/step-00000200 --data val.npy --seq-len 256 --windows 8 --nproc 2 \\
      --layout tp=2                                                     one checkpoint, 2 ranks, TP 2
"""


def add_parser(sub: Any, epilog: str) -> argparse.ArgumentParser:
    cmd = sub.add_parser("eval", help="a model's loss and perplexity on a token file (no training, no run directory)",
                         description="The mean token loss and perplexity of MODEL over the first --windows windows\n"
                                     "of --seq-len + 1 tokens of --data, in file order: the figure training logs as\n"
                                     "val_loss for the same windows. Nothing is written but --out.",
                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    cmd.add_argument("model", type=Path, metavar="MODEL",
                     help="a Hugging Face folder (config.json + *.safetensors, as `meshfit export` writes), a step-N "
                          "checkpoint folder, a checkpoints folder or a run folder (its latest intact checkpoint)")
    cmd.add_argument("--data", type=Path, required=True, metavar="FILE",
                     help="token file as data.path takes it: .npy or raw .bin tokens, or UTF-8 text (.txt or a "
                          "folder of them; --set data.tokenizer=…)")
    cmd.add_argument("--seq-len", type=int, required=True, metavar="N",
                     help="tokens per window, less one: each window is N inputs and their N next-token targets")
    cmd.add_argument("--windows", type=int, required=True, metavar="K",
                     help="evaluate the file's first K windows (windows start N tokens apart, as training reads "
                          "them)")
    cmd.add_argument("--json", action="store_true", help="print one JSON object instead of the line")
    cmd.add_argument("--out", type=Path, metavar="FILE", help="also write the JSON object to FILE (a new file)")
    cmd.add_argument("--nproc", type=positive_int, metavar="P",
                     help="launch P local ranks (default: one rank in this process, or an enclosing torchrun's)")
    cmd.add_argument("--layout", metavar="KEY=VAL,…",
                     help="the layout, as `meshfit plan`/`verify` write it (e.g. tp=2 or dp_shard=2,zero_stage=3)")
    cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="config value (repeatable): parallel.*, pipeline.*, train.device, train.precision, "
                          "train.micro_batch, train.global_batch (windows per batch), data.token_dtype, …")
    cmd.add_argument("--oversubscribe", action="store_true", help=OVERSUBSCRIBE_HELP)
    return cmd


def run(args: argparse.Namespace) -> int:
    from meshfit.runs.evaluation import prepare
    from meshfit.train.capacity import check_local_ranks
    from meshfit.train.eval_ranks import run_eval
    from meshfit.train.launch import under_torchrun

    torchrun = under_torchrun()
    if args.nproc and torchrun:
        raise ConfigError("--nproc starts local ranks; under torchrun the evaluation runs on torchrun's ranks: "
                          "leave --nproc out")
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (args.nproc or 1)
    if args.out is not None:
        _check_out(args.out)
    if args.nproc and args.nproc > 1:
        check_local_ranks(args.nproc, args.oversubscribe)
    job = prepare(args.model, args.data, args.seq_len, args.windows, world, args.layout, args.overrides)
    leader = not torchrun or os.environ.get("RANK") == "0"
    if leader:
        for note in job.source.notes:
            print(note, file=sys.stderr)
        print(_banner(job, world), file=sys.stderr, flush=True)
    outcome = run_eval(job.cfg, job.source.path if job.source.kind == "checkpoint" else None, args.nproc)
    if not outcome.ok:
        if outcome.signal == "SIGINT":
            print("interrupted (SIGINT); nothing was written", file=sys.stderr)
            return 130
        print(f"error: {outcome.message.replace('training failed', 'the evaluation failed')}", file=sys.stderr)
        return 1
    if outcome.result is None:  # another rank of a torchrun: rank 0 reports
        return 0
    report = _report(job, outcome.result)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report) if args.json else _line(report))
    return 0


def _check_out(out: Path) -> None:
    """--out is a new file in a folder that exists: an evaluation replaces nothing."""
    if out.exists():
        raise ConfigError(f"--out {out} already exists: give a new file name (an evaluation replaces nothing)")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: its folder {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK):
        raise ConfigError(f"--out {out}: its folder {out.parent} cannot be written")


def _banner(job: Any, world: int) -> str:
    """One line before the ranks start: what is evaluated, on what, how."""
    from meshfit.models.config import num_params
    from meshfit.util.units import fmt_count

    source, shape = job.source, job.shape
    what = (f"checkpoint {source.path} (step {source.step})" if source.kind == "checkpoint" else
            f"Hugging Face model {source.path}")
    precision = "bf16 mixed" if shape.mixed_precision else "fp32"
    return (f"meshfit eval: {what}, {fmt_count(num_params(source.model))} params; {job.data}, first {job.windows} "
            f"windows of {job.seq_len} + 1 tokens; layout {shape.dims.describe()}, {world} rank"
            f"{'s' if world > 1 else ''}, {precision}")


def _report(job: Any, result: dict[str, Any]) -> dict[str, Any]:
    loss = result["val_loss"]
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 709 else None,  # None: beyond a float
            "tokens": job.windows * job.seq_len, "windows": job.windows, "seq_len": job.seq_len,
            "data": str(job.data), "model": str(job.source.path), "model_kind": job.source.kind,
            "step": job.source.step, "layout": job.shape.dims.describe(), "world_size": result["world_size"],
            "precision": "bf16 mixed" if job.shape.mixed_precision else "fp32", "time_s": round(result["val_time_s"], 3)}


def _line(report: dict[str, Any]) -> str:
    perplexity = "inf" if report["perplexity"] is None else f"{report['perplexity']:.4g}"
    return (f"loss {report['loss']:.4f}  perplexity {perplexity}  over {report['windows']} windows × "
            f"{report['seq_len']} tokens ({report['tokens']:,} tokens)")
