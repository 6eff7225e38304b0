"""`meshfit prepare` throughput and memory with 1, 2 and 4 workers on a corpus made here, and the start-up
of a run on the prepared shards against the same corpus as text, which every rank tokenizes at start.

    python benchmarks/training/prepare_speed.py [--mb 200] [--work DIR]

The corpus is JSONL of Zipf-distributed words (deterministic, seed 0); the tokenizer a byte-level BPE of
8,000 tokens trained here on its first 4 MB. Peak memory is the largest resident set of the prepare
process and its workers (RUSAGE_CHILDREN of a wrapper). Start-up is the time from the launch to the first logged step
(2 ranks, `tiny` with the tokenizer's vocabulary, 1 step).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def corpus(folder: Path, megabytes: int) -> tuple[Path, Path]:
    """corpus.jsonl and the same documents as .txt files (one per document, for the text path)."""
    folder.mkdir(parents=True, exist_ok=True)
    jsonl, text = folder / "corpus.jsonl", folder / "text"
    if jsonl.exists():
        return jsonl, text
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(20000)]
    text.mkdir()
    size, doc = 0, 0
    with open(jsonl, "w") as out:
        while size < megabytes * 1e6:
            ids = rng.zipf(1.3, size=int(rng.integers(200, 2000))) % len(words)
            body = " ".join(words[i] for i in ids)
            out.write(json.dumps({"text": body}) + "\n")
            (text / f"{doc:07d}.txt").write_text(body)
            size += len(body) + 12
            doc += 1
    return jsonl, text


def tokenizer(folder: Path, jsonl: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if (folder / "tokenizer.json").exists():
        return folder
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample = [json.loads(line)["text"] for line in jsonl.read_text()[:4_000_000].splitlines()[:-1]]
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<s>", "</s>"],
                                                        show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


# Runs a command and prints the largest resident set among it and the processes it waited for (its workers).
_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def prepare(jsonl: Path, tok: Path, out: Path, workers: int) -> tuple[float, int, int]:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, "-m", "meshfit", "prepare", str(jsonl),
                           "--tokenizer", str(tok), "--out", str(out), "--workers", str(workers), "--overwrite"],
                          check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    tokens = json.loads((out / "meshfit-data.json").read_text())["tokens"]
    return seconds, tokens, int(done.stdout.split()[-1]) * 1024


def startup(work: Path, sets: list[str]) -> float:
    run = work / "run"
    argv = [sys.executable, "-m", "meshfit", "train", "--nproc", "2", "--run-dir", str(run), "--overwrite"]
    for item in ["model.preset=tiny", "model.vocab_size=8000", "train.steps=1", "train.seq_len=256",
                 "checkpoint.at_end=false", *sets]:
        argv += ["--set", item]
    began = time.time()
    subprocess.run(argv, check=True, capture_output=True)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    return first["time"] - first["step_time_s"] - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--work", type=Path, default=Path("/tmp/meshfit-prepare-bench"))
    args = parser.parse_args()
    jsonl, text = corpus(args.work, args.mb)
    tok = tokenizer(args.work / "tokenizer", jsonl)
    print(f"corpus: {jsonl.stat().st_size / 1e6:.0f} MB of JSONL")
    for workers in (1, 2, 4):
        seconds, tokens, peak = prepare(jsonl, tok, args.work / "prepared", workers)
        shown = f"{peak / 2**20:.0f} MiB"
        print(f"prepare --workers {workers}: {tokens / seconds / 1e6:.2f}M tokens/s ({tokens / 1e6:.1f}M tokens in "
              f"{seconds:.1f} s), peak resident memory of one process {shown}")
    shards = startup(args.work, ["data.source=tokens", f"data.path={args.work / 'prepared'}", f"data.tokenizer={tok}"])
    texts = startup(args.work, ["data.source=text", f"data.path={text}", f"data.tokenizer={tok}"])
    print(f"start-up to the first step, 2 ranks: prepared shards {shards:.1f} s, the same text tokenized by every "
          f"rank {texts:.1f} s ({texts / shards:.1f}x)")


if __name__ == "__main__":
    main()
