"""The `meshfit` command line: one module per command (plan, verify, train, eval, calibrate, demo, show, export),
each with its own subparser (`add_parser`) and `run(args)`; this module dispatches to them."""

from __future__ import annotations

import argparse
import sys

from meshfit.commands import calibrate, demo, export, plan, prepare, show, train, verify
from meshfit.commands import eval as eval_cmd
from meshfit.config import ConfigError
from meshfit.util.did_you_mean import did_you_mean
from meshfit.util.paths import PathError

EPILOG = """\
examples:
  meshfit demo                                     the seed scenario on local CPU ranks
  meshfit plan --model llama3-70b --nodes 8 --seq-len 8192 --explain
  meshfit plan --model llama3-8b --layout dp_shard=8,zero_stage=3 --out plan.json
  meshfit verify --model llama3-8b --layout dp_shard=64,zero_stage=3 --seq-len 2048
  meshfit calibrate --nproc 2 --out hw.json        measure this machine for the planner
  meshfit plan --model small --gpu cpu --gpu-memory 80MiB --gpus-per-node 2 --hardware hw.json
  meshfit train --plan plan.json --nproc 8         run a plan (here: 8 local ranks)
  meshfit train --set model.preset=small --nproc 2 --set parallel.dp_replicate=2
  meshfit train --config run.toml --set train.steps=100 --run-dir runs/exp1
  meshfit train --config run.toml --run-dir runs/exp1 --resume --nproc 4   continue, any layout
  meshfit export runs/exp1 --out hf/exp1          latest checkpoint as HF safetensors
  meshfit eval runs/exp1 --data val.npy --seq-len 256 --windows 8   loss and perplexity, no training
  meshfit prepare corpus/ --tokenizer hf/llama --out data/corpus --workers 4   token shards to train on
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m meshfit train --config run.toml           multi-node: one launch per node
"""

# In the order `meshfit --help` lists them.
COMMANDS = {module.NAME: module for module in (train, eval_cmd, plan, verify, export, prepare, demo, calibrate,
                                                show)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshfit", description="Plan, verify and train models that do not fit in one device's memory.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        module.add_parser(sub, EPILOG)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}; {did_you_mean(argv[0], COMMANDS)}commands: "
              f"{', '.join(COMMANDS)} (meshfit --help says what each does)", file=sys.stderr)
        return 2
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage and the error (or --help); its code is ours
        return int(exc.code or 0)
    try:
        return COMMANDS[args.command].run(args)
    except (ConfigError, PathError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        if args.command in ("train", "eval"):
            from meshfit.train.launch import tell_torchrun

            tell_torchrun(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        print("interrupted (SIGINT); nothing was saved", file=sys.stderr)
        return 130
