"""One GPU: planned vs measured step time and peak memory of single-GPU layouts, next to a Hugging Face eager
loop on the same shapes, on a calibration of the same GPU. One printed table; nothing is checkpointed.

    python benchmarks/gpu/gpu_check.py --out DIR [--preset llama3-1b] [--seq-len 2048] [--steps 8]
    python benchmarks/gpu/gpu_check.py --out DIR --device cpu --preset tiny --seq-len 64   # the CPU dry path

1. `meshfit calibrate --nproc 1 --model PRESET --seq-len S --quick` writes DIR/hardware.json;
2. each layout trains `--steps` steps of global batch 8 (16K tokens per step at seq 2048; micro-batch 4, two
   accumulated) under mixed precision, with the memory tracker off, so every step is a plain step: the
   measured step time is the median of steps 3 and later, the measured peak the allocator's
   (`torch.cuda.max_memory_allocated`, read every step by meshfit on CUDA);
3. the same plain layout runs with the per-operator tracker on every step (`train.memory_tracking=full`),
   and measured every step from the allocator's counters (`auto` on CUDA): each step time over the plain
   one's is what that measurement costs;
4. `step_time` and `estimate_memory` plan each layout on the calibrated device;
5. benchmarks/peers/hf_baseline.py trains `transformers`' LlamaForCausalLM on the same shapes (skipped when
   transformers is missing);
6. prints one table and writes DIR/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from meshfit.calibrate.measure import calibrate
from meshfit.config import load_config
from meshfit.hardware.catalog import Cluster, cpu_device, device_from_profile
from meshfit.hardware.profile import save_profile
from meshfit.layout.layout import Layout, Workload
from meshfit.models.config import flops_per_token
from meshfit.models.presets import get_preset
from meshfit.planner.memory.estimate import estimate_memory
from meshfit.planner.planfile import plan_sections
from meshfit.planner.timing.estimate import step_time
from meshfit.train.launch import launch

GLOBAL_BATCH, MICRO_BATCH = 8, 4
# name -> (layout, extra train settings)
LAYOUTS: dict[str, tuple[Layout, dict[str, Any]]] = {
    "plain": (Layout(micro_batch=MICRO_BATCH), {}),
    "op recompute": (Layout(micro_batch=MICRO_BATCH, activation_checkpointing="op"), {}),
    "full recompute": (Layout(micro_batch=MICRO_BATCH, activation_checkpointing="full"), {}),
    "zero3 offload": (Layout(dp_shard=1, zero_stage=3, offload=True, micro_batch=MICRO_BATCH), {}),
    "compiled": (Layout(micro_batch=MICRO_BATCH), {"compile": True}),
    "compiled, op recompute": (Layout(micro_batch=MICRO_BATCH, activation_checkpointing="op"), {"compile": True}),
    "plain, tracked every step": (Layout(micro_batch=MICRO_BATCH), {"memory_tracking": "full"}),
    "plain, allocator every step": (Layout(micro_batch=MICRO_BATCH), {"memory_tracking": "auto"}),
}


def measure(model_name: str, work: Workload, layout: Layout, extra: dict[str, Any], steps: int, device: str,
            run_dir: Path) -> dict[str, Any]:
    sections = plan_sections(get_preset(model_name), work, layout)
    sections["train"].update({"steps": steps, "device": device, "log_every": 1000, "memory_tracking": "off",
                              **extra})
    sections["checkpoint"] = {"interval": 0, "at_end": False}
    cfg = load_config(None, sections=sections)
    start = time.perf_counter()
    outcome = launch(cfg, run_dir, None, overwrite=True)  # a rerun into the same --out replaces it
    if not outcome.ok:
        return {"error": outcome.message}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = records[2:] or records
    return {"step_time_s": statistics.median(r["step_time_s"] for r in steady),
            "peak_bytes": max(r["peak_mem_bytes"] for r in records), "first_step_s": records[0]["step_time_s"],
            "wall_s": time.perf_counter() - start}


def _row(name: str, planned_s: float | None, planned_b: float | None, real: dict[str, Any], tokens: int,
         flops: float, peak: float | None) -> str:
    if "error" in real:
        return f"| {name} | failed: {real['error'].splitlines()[0][:90]} |"
    step, used = real["step_time_s"], real.get("peak_bytes")
    tps = tokens / step
    mfu = f"{tps * flops / peak:.0%}" if peak else "—"
    plan_s = f"{planned_s * 1e3:.0f} ({planned_s / step:.2f})" if planned_s else "—"
    plan_b = f"{planned_b / 2**30:.1f} ({planned_b / used:.2f})" if planned_b and used else "—"
    used_s = f"{used / 2**30:.1f}" if used else "—"
    return f"| {name} | {step * 1e3:.0f} | {plan_s} | {used_s} | {plan_b} | {tps:,.0f} | {mfu} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="llama3-1b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = get_preset(args.preset)
    began = time.perf_counter()
    profile = calibrate(1, model=model, seq=args.seq_len, device=args.device, quick=True)
    save_profile(profile, args.out / "hardware.json")
    print(f"calibrated in {time.perf_counter() - began:.0f} s", flush=True)
    memory = profile.memory_bytes or 2**40
    device = device_from_profile(profile, memory) if profile.device == "cuda" else cpu_device(memory, profile)
    cluster = Cluster(device, nodes=1, gpus_per_node=1)
    precision = "mixed" if args.device == "cuda" else "fp32"
    work = Workload(seq_len=args.seq_len, global_batch=GLOBAL_BATCH, precision=precision)
    tokens, flops = GLOBAL_BATCH * args.seq_len, flops_per_token(model, args.seq_len)
    peak = _datasheet_peak(args.device)
    rows: dict[str, Any] = {}
    lines = []
    for name, (layout, extra) in LAYOUTS.items():
        if args.device == "cpu" and layout.offload:
            continue  # on CPU ranks the host is the same memory: offload is refused there
        planned_s = step_time(model, layout, work, cluster).total_s
        planned_b = estimate_memory(model, layout, work).total
        real = measure(args.preset, work, layout, extra, args.steps, args.device, args.out / name.replace(" ", "-")
                       .replace(",", ""))
        rows[name] = {"planned_step_time_s": planned_s, "planned_peak_bytes": planned_b, **real}
        lines.append(_row(name, planned_s, planned_b, real, tokens, flops, peak))
        print(lines[-1], f"(wall {real.get('wall_s', 0):.0f} s, first step {real.get('first_step_s', 0):.1f} s)",
              flush=True)
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))  # benchmarks/peers
        from hf_baseline import run_baseline

        real = run_baseline(args.preset, args.seq_len, MICRO_BATCH, GLOBAL_BATCH // MICRO_BATCH, args.steps,
                            args.device)
    except ImportError as exc:
        real = {"error": f"Hugging Face baseline skipped: {exc}"}
    rows["HF eager loop"] = real
    lines.append(_row("HF eager loop", None, None, real, tokens, flops, peak))
    print(lines[-1], flush=True)
    print(f"\n{args.preset}, seq {args.seq_len}, global batch {GLOBAL_BATCH} = {MICRO_BATCH} × "
          f"{GLOBAL_BATCH // MICRO_BATCH}, {precision}, one {args.device} rank; steady steps = steps 3–{args.steps}; "
          f"planned (planned / measured)")
    print("| layout | step ms | planned step ms | peak GiB | planned peak GiB | tokens/s | MFU |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    _ratios(rows)
    print(f"total {time.perf_counter() - began:.0f} s")
    (args.out / "gpu_check.json").write_text(json.dumps({"profile": profile.model_dump(), "layouts": rows},
                                                        indent=1))


def _datasheet_peak(device: str) -> float | None:
    """The GPU's dense bf16 peak from meshfit's catalog (MFU as the anchors count it); none on CPU."""
    if device != "cuda":
        return None
    import torch

    from meshfit.hardware.catalog import gpu_for_device

    gpu = gpu_for_device(torch.cuda.get_device_name())
    return gpu.bf16_flops if gpu else None


def _ratios(rows: dict[str, Any]) -> None:
    """The ratios the targets are stated in, from the rows above."""
    def step(name: str) -> float | None:
        return rows.get(name, {}).get("step_time_s")

    pairs = [("op recompute", "plain", "op recompute / no recompute, step"),
             ("compiled, op recompute", "compiled", "compiled op / compiled no recompute, step"),
             ("plain", "compiled", "eager / compiled, step"),
             ("plain, tracked every step", "plain", "tracked / untracked step"),
             ("plain", "HF eager loop", "meshfit eager / HF eager, step")]
    for a, b, label in pairs:
        if step(a) and step(b):
            print(f"{label}: {step(a) / step(b):.3f}")
    hf_peak, own = rows.get("HF eager loop", {}).get("peak_bytes"), rows.get("plain", {}).get("peak_bytes")
    if hf_peak and own:
        print(f"meshfit eager / HF eager, peak: {own / hf_peak:.3f}")


if __name__ == "__main__":
    main()
