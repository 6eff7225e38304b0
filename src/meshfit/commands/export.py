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
    export.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest safetensors file, e.g. 5GB (default) or 500MiB; a larger model is split "
                             "into model-0000k-of-0000n.safetensors with model.safetensors.index.json")
    export.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export in --out (its shards, index, config.json and tokenizer "
                             "files; refused without it)")
    return export


def run(args: argparse.Namespace) -> int:
    from meshfit.runs.export import export
    from meshfit.train.checkpoint_store import CheckpointError

    from meshfit.util.units import fmt_bytes, parse_bytes

    try:
        max_shard = parse_bytes(args.max_shard_size)
        if max_shard <= 0:
            raise ValueError("it must be above 0")
    except ValueError as exc:
        print(f"error: --max-shard-size {args.max_shard_size!r}: {exc}", file=sys.stderr)
        return 2
    notes: list[str] = []
    try:
        files = export(args.checkpoint, args.out, args.dtype, overwrite=args.overwrite, notes=notes,
                       max_shard_bytes=max_shard)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a folder made read-only meanwhile: nothing of it was moved into --out
        print(f"error: writing the export into --out {args.out} failed ({exc.strerror or exc}); nothing there "
              "was changed", file=sys.stderr)
        return 1
    for note in notes:
        print(note, file=sys.stderr)
    shards = [f for f in files if f.suffix == ".safetensors"]
    named = [f.name for f in files if f not in shards or len(shards) <= 2]
    if len(shards) > 2:
        named.insert(0, f"{shards[0].name} … {shards[-1].name} ({fmt_bytes(sum(f.stat().st_size for f in shards))})")
    print(f"wrote {args.out}: {', '.join(named)}")
    return 0
