"""`meshfit prepare`: tokenize a corpus once into token shards that `meshfit train` reads directly."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

NAME = "prepare"


def add_parser(sub: Any, epilog: str) -> argparse.ArgumentParser:
    prepare = sub.add_parser("prepare", help="tokenize text, JSONL or parquet files into token shards for training")
    prepare.add_argument("inputs", type=Path, nargs="+", metavar="INPUT",
                         help=".txt (one document each), .jsonl (one JSON object per line) or .parquet files, or "
                              "folders of them (read recursively, in sorted order)")
    prepare.add_argument("--tokenizer", type=Path, required=True, metavar="DIR",
                         help="a Hugging Face tokenizer folder (tokenizer.json; BOS/EOS from tokenizer_config.json)")
    prepare.add_argument("--out", type=Path, required=True, metavar="DIR", help="the folder of shards to write")
    prepare.add_argument("--field", default="text", metavar="NAME",
                         help="the JSONL key or parquet column holding the text (default: text)")
    prepare.add_argument("--prompt-field", default=None, metavar="NAME",
                         help="with --response-field: prompt/response pairs (supervised fine-tuning); the "
                              "prompt's tokens are stored as not counted by the loss")
    prepare.add_argument("--response-field", default=None, metavar="NAME",
                         help="the JSONL key or parquet column of the response (with --prompt-field)")
    prepare.add_argument("--workers", type=int, default=1, metavar="N",
                         help="tokenizing processes (default 1); the shards are the same for any N")
    prepare.add_argument("--shard-tokens", type=int, default=None, metavar="N",
                         help="start a new shard at the first document boundary past N tokens (default 2^28)")
    prepare.add_argument("--skip-empty", action="store_true",
                         help="skip empty documents (counted in the metadata) instead of refusing them")
    prepare.add_argument("--overwrite", action="store_true", help="replace --out when it holds something")
    return prepare


def run(args: argparse.Namespace) -> int:
    from meshfit.data.errors import DataError
    from meshfit.data.prepare import DEFAULT_SHARD_TOKENS, prepare
    from meshfit.util.units import fmt_bytes, fmt_count

    for flag, value in (("--workers", args.workers), ("--shard-tokens", args.shard_tokens)):
        if value is not None and value < 1:
            print(f"error: {flag} {value}: must be at least 1", file=sys.stderr)
            return 2
    if (args.prompt_field is None) != (args.response_field is None):
        print("error: --prompt-field and --response-field go together (prompt/response pairs); give both, or "
              "neither and --field for plain text", file=sys.stderr)
        return 2
    field = args.field if args.prompt_field is None else (args.prompt_field, args.response_field)
    began = time.perf_counter()
    try:
        with _progress(args.inputs) as tick:
            meta = prepare(args.inputs, args.tokenizer, args.out, field, args.workers,
                           args.shard_tokens or DEFAULT_SHARD_TOKENS, args.skip_empty, args.overwrite, tick)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - began
    skipped = meta["skipped_empty_documents"]
    print(f"wrote {args.out}: {fmt_count(meta['tokens'])} tokens of {fmt_count(meta['documents'])} documents in "
          f"{len(meta['shards'])} shard(s) ({meta['dtype']}, largest id {meta['max_id']}), from "
          f"{fmt_bytes(sum(i['bytes'] for i in meta['inputs']))} of input in {seconds:.1f} s "
          f"({meta['tokens'] / max(seconds, 1e-9):,.0f} tokens/s)" + (f"; {skipped} empty documents skipped"
                                                                        if skipped else ""))
    return 0


def _progress(inputs: list[Path]) -> Any:
    """A progress bar on stderr over the input bytes (a context manager giving the update function)."""
    import contextlib

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from meshfit.data.documents import input_files

    @contextlib.contextmanager
    def bar() -> Any:
        try:
            total = sum(f.stat().st_size for f in input_files(inputs))
        except Exception:  # bad inputs: prepare() itself names them
            total = None
        progress = Progress(TextColumn("prepare"), BarColumn(), TextColumn("{task.fields[docs]} documents"),
                            TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        task = progress.add_task("prepare", total=total, docs=0)
        with progress:
            yield lambda counts: progress.update(task, completed=counts.bytes, docs=counts.documents)

    return bar()
