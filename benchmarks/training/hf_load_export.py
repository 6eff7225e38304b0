"""Host memory and bytes read while `model.init_from` loads, on 1 process and on 4 ranks; `meshfit export`
sizes, time and peak memory, single-file and sharded.

    python benchmarks/training/hf_load_export.py [--dim 1024 --layers 8 --vocab 32000] [--folder DIR]

The model is a seeded Llama stored in bf16 (about 370 MB at the defaults). Peak memory is the process's
VmHWM (reset before loading through /proc/self/clear_refs) less its resident memory before: what loading
adds. Run with PYTHONPATH=src:tests.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from meshfit.config import config_from_dict, load_config
from meshfit.models import build_model, init_weights
from meshfit.models.hf_weights import save_hf
from meshfit.models.presets import get_preset
from meshfit.util.ranks import run_ranks
from meshfit.util.units import fmt_bytes


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def load_job(cfg_dict: dict) -> dict:
    from meshfit.train.dist import init_distributed
    from meshfit.train.run import build_run

    cfg = config_from_dict(cfg_dict)
    env = init_distributed("cpu")
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    began = time.perf_counter()
    run = build_run(cfg, env, None)
    seconds = time.perf_counter() - began
    reader = getattr(run, "init_from", None)
    return {"added": _status("VmHWM") - before, "read": reader.bytes_read if reader else None, "s": seconds}


def _model(args: argparse.Namespace):
    return replace(get_preset("small"), dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                   n_kv_heads=args.dim // 128, vocab_size=args.vocab, ffn_hidden=int(args.dim * 2.75) // 64 * 64,
                   max_seq_len=256)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--folder", type=Path, default=None, help="reuse (or keep) the model folder here")
    args = parser.parse_args()
    cfg = _model(args)
    folder = args.folder or Path(tempfile.mkdtemp()) / "hf"
    if not (folder / "model.safetensors").exists():
        model = build_model(cfg, "cpu")
        init_weights(model, 0, cfg)
        save_hf(model.state_dict(), cfg, folder, torch.bfloat16)
        del model
    size = (folder / "model.safetensors").stat().st_size
    dims = [f"model.{k}={getattr(cfg, k)}" for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                                      "ffn_hidden", "max_seq_len")]
    base = ["model.preset=small", *dims, f"model.init_from={folder}", "train.seq_len=64", "train.global_batch=8"]
    print(f"model: {sum(p.numel() for p in build_model(cfg, 'meta').parameters()) / 1e6:.1f}M parameters, "
          f"{fmt_bytes(size)} in bf16 ({folder})")
    for name, world, sets in [("1 process", 1, []), ("4 ranks FSDP 4", 4, ["parallel.dp_shard=4"]),
                              ("4 ranks FSDP 2 x TP 2", 4, ["parallel.dp_shard=2", "parallel.tp=2"]),
                              ("4 ranks FSDP 2 x PP 2", 4, ["parallel.dp_shard=2", "parallel.pp=2"])]:
        ranks = run_ranks(load_job, world, load_config(None, [*base, *sets]).model_dump(), timeout_s=900)
        read = [r["read"] for r in ranks]
        shown = "?" if None in read else ", ".join(f"{x / size:.3f}" for x in read)
        print(f"{name:24s} read per rank (of the file): {shown}; host memory added while loading, most loaded "
              f"rank: {fmt_bytes(max(r['added'] for r in ranks))}; {max(r['s'] for r in ranks):.1f} s")
    export(folder, base, size)


def export(folder: Path, base: list[str], size: int) -> None:
    run = folder.parent / "run"
    sets = [x for item in [*base, "train.steps=1"] for x in ("--set", item)]
    subprocess.run([sys.executable, "-m", "meshfit", "train", *sets, "--run-dir", str(run), "--overwrite"],
                   check=True, capture_output=True)
    for label, extra in [("single file", []), ("100MB shards", ["--max-shard-size", "100MB"])]:
        out = folder.parent / f"export-{len(extra)}"
        began = time.perf_counter()
        done = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "meshfit", "export", str(run),
                               "--out", str(out), "--dtype", "bf16", "--overwrite", *extra],
                              check=True, capture_output=True, text=True)
        seconds = time.perf_counter() - began
        peak = int(done.stderr.strip().splitlines()[-1]) * 1024
        files = sorted(out.glob("*.safetensors"))
        print(f"export {label:13s}: {len(files)} files, {fmt_bytes(sum(f.stat().st_size for f in files))} "
              f"(model {fmt_bytes(size)} in bf16), {seconds:.1f} s, peak memory of the process {fmt_bytes(peak)}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
