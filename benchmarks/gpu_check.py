"""Planned vs measured peak memory and step time of single-GPU layouts, on a calibration of the same GPU.

    python benchmarks/gpu_check.py --out DIR [--preset llama3-1b] [--seq-len 2048] [--steps 6]
    python benchmarks/gpu_check.py --out DIR --device cpu --preset tiny --seq-len 64   # the CPU dry path

1. `meshfit calibrate --nproc 1 --model PRESET --seq-len S` writes DIR/hardware.json (NCCL-free: one rank);
2. each layout below trains `--steps` steps on the device (mixed precision, AdamW, local batch 2); its steady
   steps (after train.memory_tracked_steps) give the measured step time, and the run's peak memory is what
   the allocator reports (`torch.cuda.max_memory_allocated`, recorded per step by meshfit on CUDA);
3. `step_time` and `estimate_memory` plan the same layout on the calibrated device;
4. prints planned vs measured per layout and writes DIR/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from meshfit.calibrate import calibrate
from meshfit.config import load_config
from meshfit.models.presets import get_preset
from meshfit.planner.estimate import estimate_memory
from meshfit.planner.hardware import Cluster, cpu_device, device_from_profile
from meshfit.planner.layout import Layout, Workload
from meshfit.planner.planfile import plan_sections
from meshfit.planner.profile import save_profile
from meshfit.planner.timing import step_time
from meshfit.train.launch import launch

LAYOUTS = {
    "plain": Layout(micro_batch=2),
    "full recompute": Layout(micro_batch=2, activation_checkpointing="full"),
    "op recompute, 2 micro-batches": Layout(micro_batch=1, activation_checkpointing="op"),
    "zero3 offload": Layout(dp_shard=1, zero_stage=3, offload=True, micro_batch=2),
}


def measure(model_name: str, work: Workload, layout: Layout, steps: int, device: str, run_dir: Path) -> dict:
    sections = plan_sections(get_preset(model_name), work, layout)
    sections["train"].update(steps=steps, device=device, log_every=1000)
    cfg = load_config(None, sections=sections)
    outcome = launch(cfg, run_dir, None, overwrite=True)  # a rerun into the same --out replaces it
    if not outcome.ok:
        return {"error": outcome.message}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["step"] > cfg.train.memory_tracked_steps] or records[1:]
    return {"step_time_s": statistics.median(r["step_time_s"] for r in steady),
            "peak_bytes": max(r["peak_mem_bytes"] for r in records[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="llama3-1b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = get_preset(args.preset)
    profile = calibrate(1, model=model, seq=args.seq_len, device=args.device)
    save_profile(profile, args.out / "hardware.json")
    memory = profile.memory_bytes or 2**40
    device = device_from_profile(profile, memory) if profile.device == "cuda" else cpu_device(memory, profile)
    cluster = Cluster(device, nodes=1, gpus_per_node=1)
    work = Workload(seq_len=args.seq_len, global_batch=2, precision="mixed" if args.device == "cuda" else "fp32")
    rows = {}
    for name, layout in LAYOUTS.items():
        if args.device == "cpu" and layout.offload:
            continue  # offloading to the host from the host moves nothing
        planned_time = step_time(model, layout, work, cluster).total_s
        planned_mem = estimate_memory(model, layout, work).total
        real = measure(args.preset, work, layout, args.steps, args.device, args.out / name.replace(" ", "-"))
        rows[name] = {"planned_step_time_s": planned_time, "planned_peak_bytes": planned_mem, **real}
        if "error" in real:
            print(f"{name:30s} failed: {real['error']}", flush=True)
            continue
        print(f"{name:30s} step {planned_time * 1e3:8.1f} ms planned, {real['step_time_s'] * 1e3:8.1f} ms measured "
              f"({planned_time / real['step_time_s']:.2f}); peak {planned_mem / 2**30:7.3f} GiB planned, "
              f"{real['peak_bytes'] / 2**30:7.3f} GiB measured ({planned_mem / real['peak_bytes']:.2f})", flush=True)
    (args.out / "gpu_check.json").write_text(json.dumps({"profile": profile.model_dump(), "layouts": rows}, indent=1))


if __name__ == "__main__":
    main()
