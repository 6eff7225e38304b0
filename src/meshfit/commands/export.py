"""`meshfit export`: a checkpoint's weights as Hugging Face safetensors and config.json."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

NAME = "export"


def add_parser(sub: Any, epilog: str) -> argparse.ArgumentParser:
    export = sub.add_parser("export", help="write a checkpoint's weights as Hugging Face safetensors + config.json")
    export.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                        help="a step-N checkpoint folder, a checkpoints folder or a run folder (latest intact)")
    export.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    export.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="dtype of the written tensors (default fp32)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace model.safetensors and config.json already in --out (refused without it)")
    return export


def run(args: argparse.Namespace) -> int:
    from meshfit.runs.export import export
    from meshfit.train.checkpoint_store import CheckpointError

    notes: list[str] = []
    try:
        files = export(args.checkpoint, args.out, args.dtype, overwrite=args.overwrite, notes=notes)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(note, file=sys.stderr)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0
