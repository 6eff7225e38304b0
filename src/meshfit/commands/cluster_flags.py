"""The cluster of `meshfit plan` / `meshfit verify` flags: a catalog GPU with its datasheet figures (and
overrides), a measured hardware profile (--hardware), or CPU ranks under a per-rank budget (--gpu cpu)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING

from meshfit.hardware.catalog import CPU, GPU, Cluster, cpu_device, device_from_profile, get_gpu

if TYPE_CHECKING:
    from meshfit.hardware.profile import HardwareProfile


class PlanInputError(ValueError):
    """A plan/verify flag names something invalid; the message says which flag and what would be valid."""


def resolve_cluster(args: argparse.Namespace, rates: bool = True) -> Cluster:
    """The cluster of the flags. ``rates`` False (verify): only the memory matters, so CPU ranks without
    --hardware are not calibrated."""
    nodes, per_node = args.nodes or 1, args.gpus_per_node or 8
    profile = _profile(args, nodes * per_node)
    wants_cpu = (args.gpu or "").strip().lower() == CPU
    if profile is not None and profile.device == "cpu" and args.gpu and not wants_cpu:
        raise PlanInputError(f"--hardware {args.hardware} was measured on CPU ranks: it plans --gpu cpu, not "
                             f"--gpu {args.gpu}")
    if profile is not None and profile.device == "cuda" and wants_cpu:
        raise PlanInputError(f"--hardware {args.hardware} was measured on {profile.device_name}, not on CPU ranks: "
                             "drop --gpu cpu, or calibrate with `meshfit calibrate --device cpu`")
    if wants_cpu or (profile is not None and profile.device == "cpu"):
        return Cluster(_cpu(args, profile, nodes * per_node, rates), nodes=nodes, gpus_per_node=per_node)
    try:
        gpu = get_gpu(args.gpu or DEFAULT_GPU)
    except ValueError as exc:
        raise PlanInputError(f"--gpu: {exc} (or cpu: CPU ranks under --gpu-memory)") from None
    if profile is not None:
        gpu = device_from_profile(profile, args.gpu_memory or gpu.memory_bytes)
        return Cluster(gpu, nodes=nodes, gpus_per_node=per_node)
    changes = {}
    if args.gpu_memory:
        changes["memory_bytes"] = args.gpu_memory
    for flag, value in _datasheet_overrides(args):
        changes[_DATASHEET_FIELDS[flag][0]] = value * _DATASHEET_FIELDS[flag][1]
    if changes:
        gpu = dataclasses.replace(gpu, name=f"{gpu.name}*", **changes)
    return Cluster(gpu, nodes=nodes, gpus_per_node=per_node)


DEFAULT_GPU = "H100-SXM"
# Flags that override one datasheet figure of a catalog GPU: (GPU field, unit).
_DATASHEET_FIELDS = {"--gpu-tflops": ("bf16_flops", 1e12), "--intra-node-gbps": ("intra_node_bytes_per_s", 1e9),
                     "--inter-node-gbps": ("inter_node_bytes_per_s", 1e9)}


def _datasheet_overrides(args: argparse.Namespace) -> list[tuple[str, float]]:
    return [(flag, value) for flag in _DATASHEET_FIELDS
            if (value := getattr(args, flag[2:].replace("-", "_"))) is not None]


def _profile(args: argparse.Namespace, world: int) -> HardwareProfile | None:
    if not getattr(args, "hardware", None):
        return None
    if _datasheet_overrides(args):
        raise PlanInputError(f"{_datasheet_overrides(args)[0][0]} overrides a datasheet figure, but --hardware "
                             "replaces them all with measured ones: give one or the other")
    from meshfit.hardware.profile import load_profile

    try:
        profile = load_profile(args.hardware)
    except ValueError as exc:
        raise PlanInputError(f"--hardware {exc}") from None
    if world > 1 and not profile.collectives:
        raise PlanInputError(f"--hardware {args.hardware} was calibrated on one rank, so it has no collective "
                             f"rates for a cluster of {world}: calibrate with `meshfit calibrate --nproc N` (N ≥ 2)")
    return profile


def _cpu(args: argparse.Namespace, profile: HardwareProfile | None, world: int, rates: bool) -> GPU:
    """CPU ranks as `meshfit train` runs them: --gpu-memory is the per-rank budget (train.memory_budget)."""
    if not args.gpu_memory:
        raise PlanInputError("--gpu cpu plans CPU ranks under a per-rank memory budget: give it with "
                             "--gpu-memory, e.g. --gpu-memory 80MiB (what train.memory_budget would be)")
    if _datasheet_overrides(args):
        raise PlanInputError(f"{_datasheet_overrides(args)[0][0]} overrides a catalog GPU's datasheet figure; CPU "
                             "ranks use measured rates (--hardware, or a calibration made on the spot)")
    if profile is None and rates:
        import os

        from meshfit.calibrate.measure import CalibrationError, calibrate

        nproc = max(1, min(world, os.cpu_count() or 1))
        print(f"note: no --hardware given; calibrating this machine's CPU on {nproc} rank(s) (about 15 s; "
              "`meshfit calibrate --device cpu --out FILE` once, then --hardware FILE, is faster and steadier)",
              file=sys.stderr)
        try:
            profile = calibrate(nproc, device="cpu")
        except CalibrationError as exc:
            raise PlanInputError(f"--gpu cpu: {exc}") from None
    return cpu_device(args.gpu_memory, profile)
