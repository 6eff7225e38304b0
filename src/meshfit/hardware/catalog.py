"""GPU catalog and cluster shape: the hardware side of a plan, as plain data.

Every figure is a vendor datasheet peak (or, for the network, the per-GPU NIC of the vendor's reference
system), never a measurement: real kernels reach a fraction of it, and usable memory is lower than the
capacity (driver reservation, ECC, the CUDA context, allocator fragmentation). Planners apply published
per-kernel rates (hardware/kernels.py), efficiency and headroom factors on top of these numbers.

Conventions:

* ``memory_bytes``: the datasheet capacity read as binary gigabytes, because that is what the parts expose
  (an A100 80GB reports 81920 MiB). Parts with ECC carved out of GDDR report a little less (L40S: 46068 MiB).
* FLOP/s are dense (no 2:4 structured sparsity). ``bf16_flops`` is the tensor-core rate with FP32
  accumulation; ``fp32_flops`` is the plain FP32 (CUDA-core / vector) rate, which is what torch's fp32
  matmuls run at by default (TF32 is off for matmuls unless ``allow_tf32`` / ``set_float32_matmul_precision``).
* Bandwidths are bytes per second in one direction. Vendors quote NVLink and PCIe bidirectionally
  (H100 "900 GB/s" NVLink = 450 GB/s each way; PCIe Gen5 x16 "128 GB/s" = 64 GB/s each way).
* ``inter_node_bytes_per_s`` is one NIC per GPU at the rate of the vendor's reference system; the network
  is a property of the deployment, so replace it (``dataclasses.replace``) when the cluster differs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshfit.util.did_you_mean import did_you_mean

if TYPE_CHECKING:
    from meshfit.hardware.profile import HardwareProfile

_GiB = 2**30
_T = 1e12  # TFLOP/s and TB/s
_G = 1e9  # GB/s

# Per-direction x16 link rates, from the round bidirectional figures vendors print (64 / 128 GB/s).
_PCIE4_X16 = 32 * _G
_PCIE5_X16 = 64 * _G
# Per-GPU NICs of reference systems: DGX A100 has 8x HDR 200 Gb/s; DGX H100/H200/B200 and the 8x MI300X
# platforms have 8x 400 Gb/s (NDR / 400GbE).
_NIC_200G = 200e9 / 8
_NIC_400G = 400e9 / 8


@dataclass(frozen=True)
class GPU:
    """One accelerator model; all rates are peaks per device (see the module notes for the conventions)."""

    name: str
    memory_bytes: int
    bf16_flops: float
    fp32_flops: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # to the other GPUs of the node, per GPU, one direction
    inter_node_bytes_per_s: float  # to other nodes, per GPU, one direction
    # Measured rates (`meshfit calibrate`): the time model then uses them instead of the peaks above,
    # the published kernel rates and its efficiency constants.
    profile: HardwareProfile | None = dataclasses.field(default=None, compare=False, repr=False)
    # Share of the memory the CUDA context, NCCL buffers and the caching allocator's fragmentation keep
    # from tensors (a few GiB on an 80 GiB part). CPU ranks have none: their budget is compared with
    # tracked tensor bytes (train.memory_budget).
    allocator_headroom: float = 0.08
    # Streaming multiprocessors (AMD: compute units): how many matmul tiles run at once (one wave), for the
    # datasheet time model's wave quantization (planner/timing/kernels.py); 0 where unknown (no quantization).
    sms: int = 0


_CATALOG: tuple[GPU, ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4): BF16 312 TFLOPS dense (624 sparse), FP32 19.5 TFLOPS,
    # HBM2 1,555 GB/s (40GB) / HBM2e 2,039 GB/s (80GB), NVLink 3 600 GB/s bidirectional. 108 SMs (Ampere
    # architecture whitepaper).
    GPU("A100-40GB", 40 * _GiB, 312 * _T, 19.5 * _T, 1.555 * _T, 300 * _G, _NIC_200G, sms=108),
    GPU("A100-80GB", 80 * _GiB, 312 * _T, 19.5 * _T, 2.039 * _T, 300 * _G, _NIC_200G, sms=108),
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5: BF16 1,979 TFLOPS with sparsity -> 989.4 dense,
    # FP32 67 TFLOPS, HBM3 3.35 TB/s, NVLink 4 900 GB/s bidirectional. 132 SMs (Hopper whitepaper).
    GPU("H100-SXM", 80 * _GiB, 989.4 * _T, 67 * _T, 3.35 * _T, 450 * _G, _NIC_400G, sms=132),
    # Same datasheet, PCIe card: BF16 1,513 TFLOPS sparse -> 756.5 dense, FP32 51 TFLOPS, HBM2e 2 TB/s.
    # Pairs can be bridged with NVLink, but the node-wide path is PCIe Gen5 x16; NIC assumed 200 Gb/s. 114 SMs.
    GPU("H100-PCIe", 80 * _GiB, 756.5 * _T, 51 * _T, 2.0 * _T, _PCIE5_X16, _NIC_200G, sms=114),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): Hopper compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s bidirectional. The H100 SXM's 132 SMs.
    GPU("H200", 141 * _GiB, 989.4 * _T, 67 * _T, 4.8 * _T, 450 * _G, _NIC_400G, sms=132),
    # NVIDIA HGX B200 datasheet (per GPU of the 8-GPU board, 1000 W): BF16 4.5 PFLOPS sparse -> 2.25 dense,
    # FP32 600 TFLOPS per board -> 75, 1,440 GB HBM3e per board -> 180 GB (of the package's 192 GB),
    # 8 TB/s, NVLink 5 1.8 TB/s bidirectional. 148 SMs (as the driver reports them: pytorch/ao PR #4002).
    GPU("B200", 180 * _GiB, 2250 * _T, 75 * _T, 8.0 * _T, 900 * _G, _NIC_400G, sms=148),
    # AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS dense (2,614.9 sparse), FP32 vector 163.4 TFLOPS,
    # 192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric links with 896 GB/s aggregate bidirectional peak. The
    # 8-GPU platform is a full mesh, not a switch: one peer pair only gets one link (64 GB/s each way);
    # the 448 GB/s here is reached by collectives that use all seven peers at once. 304 compute units.
    GPU("MI300X", 192 * _GiB, 1307.4 * _T, 163.4 * _T, 5.3 * _T, 448 * _G, _NIC_400G, sms=304),
    # NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 sparse), FP32 91.6 TFLOPS, 48 GB GDDR6 at
    # 864 GB/s, PCIe Gen4 x16, no NVLink. NIC assumed 200 Gb/s. 142 SMs (18,176 CUDA cores, 128 per SM).
    GPU("L40S", 48 * _GiB, 362.05 * _T, 91.6 * _T, 0.864 * _T, _PCIE4_X16, _NIC_200G, sms=142),
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: BF16 with FP32 accumulate 165.2 TFLOPS
    # dense (330.4 sparse), FP32 82.6 TFLOPS, 24 GB GDDR6X at 1,008 GB/s, PCIe Gen4 x16. GeForce drivers
    # disable peer-to-peer, so GPU-to-GPU traffic is staged through host memory and gets less than this
    # link rate. NIC assumed 100 Gb/s (workstation-class networking). 128 SMs.
    GPU("RTX-4090", 24 * _GiB, 165.2 * _T, 82.6 * _T, 1.008 * _T, _PCIE4_X16, 100e9 / 8, sms=128),
)

GPUS: dict[str, GPU] = {gpu.name: gpu for gpu in _CATALOG}


CPU = "cpu"


def cpu_device(memory_bytes: int, profile: HardwareProfile | None) -> GPU:
    """CPU ranks as `meshfit train` runs them: ``memory_bytes`` is the per-rank budget, the rates measured
    (without a profile the device has no rates: enough for memory, e.g. `meshfit verify`)."""
    if profile is None:
        return GPU(CPU, memory_bytes, 0.0, 0.0, 0.0, 0.0, 0.0, allocator_headroom=0.0)
    return dataclasses.replace(device_from_profile(profile, memory_bytes), name=CPU, allocator_headroom=0.0)


def is_cpu(gpu: GPU) -> bool:
    """CPU ranks as `meshfit train` runs them (`--gpu cpu`), not an accelerator."""
    return gpu.name == CPU


def device_noun(gpu: GPU, count: int = 2) -> str:
    """How output names `count` of the cluster's devices: GPU(s), or CPU rank(s)."""
    noun = "CPU rank" if is_cpu(gpu) else "GPU"
    return noun if count == 1 else noun + "s"


def headroom_words(gpu: GPU) -> str:
    """What the planner keeps from a device's memory, and why (CPU ranks: nothing)."""
    if is_cpu(gpu):
        return "on CPU ranks the budget counts tracked tensor bytes, as train.memory_budget does: no headroom"
    return "the planner's headroom for the CUDA context, communication buffers and fragmentation taken off"


def mfu_basis(gpu: GPU) -> str:
    """What a plan's MFU on `gpu` is relative to: a datasheet peak, or a rate measured on this machine
    (then a layout that loses little to communication and bubbles reads near 100%)."""
    if gpu.profile is None:
        return "the datasheet's dense peak FLOP/s"
    if gpu.profile.model_flops is not None:
        return ("this machine's measured training rate of the calibrated model (`meshfit calibrate --model`), "
                "not a hardware peak")
    return "this machine's measured matmul rate (`meshfit calibrate`), not a hardware peak"


def device_from_profile(profile: HardwareProfile, memory_bytes: int) -> GPU:
    """A device whose rates are those ``profile`` measured (peaks = measured rates, no efficiency)."""
    # The link fields are informational here: the time model asks the profile for every collective.
    ar = max(profile.collectives.items())[1].all_reduce.bus_bytes_per_s if profile.collectives else 0.0
    return GPU(f"{profile.device_name} (calibrated)", memory_bytes, profile.flops("bf16"), profile.flops("fp32"),
               profile.elementwise_bytes_per_s, ar, ar, profile=profile)


def _key(name: str) -> str:
    # "h100 sxm", "H100_SXM" and "H100-SXM" all name the same part.
    return name.strip().lower().replace(" ", "-").replace("_", "-")


_BY_KEY: dict[str, GPU] = {_key(gpu.name): gpu for gpu in _CATALOG}


def get_gpu(name: str) -> GPU:
    """The catalog entry for ``name`` (case-insensitive; spaces and underscores read as hyphens)."""
    gpu = _BY_KEY.get(_key(name))
    if gpu is None:
        raise ValueError(f"unknown GPU {name!r}; {did_you_mean(name, GPUS)}valid GPUs: {', '.join(GPUS)}")
    return gpu


# Substrings of torch.cuda.get_device_name() -> catalog entry, most specific first.
_DEVICE_NAMES = (("H200", "H200"), ("H100 PCIe", "H100-PCIe"), ("H100", "H100-SXM"), ("B200", "B200"),
                 ("A100-SXM4-40GB", "A100-40GB"), ("A100-PCIE-40GB", "A100-40GB"), ("A100", "A100-80GB"),
                 ("MI300X", "MI300X"), ("L40S", "L40S"), ("RTX 4090", "RTX-4090"))


def gpu_for_device(device_name: str) -> GPU | None:
    """The catalog entry of a device as torch names it (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    return next((_BY_KEY[_key(entry)] for part, entry in _DEVICE_NAMES if part in device_name), None)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines with ``gpus_per_node`` identical GPUs each.

    ``gpu`` may be given by catalog name; it is resolved to the :class:`GPU` entry.
    """

    gpu: GPU
    nodes: int = 1
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.gpu, str):
            # frozen: the documented way to set a field during initialisation
            object.__setattr__(self, "gpu", get_gpu(self.gpu))
        for field in ("nodes", "gpus_per_node"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}={value!r} must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node
