"""Process-group set-up for one rank: torchrun's environment, or a single in-process rank."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def wants_cuda(preference: str) -> bool:
    """Whether a device preference ("auto", "cpu", "cuda") puts ranks on GPUs: "auto" does when one is
    visible. The one rule for training, calibration and config checks."""
    return preference == "cuda" or (preference == "auto" and torch.cuda.is_available())


def pick_device(preference: str, local_rank: int) -> torch.device:
    if wants_cuda(preference):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(device_preference: str = "auto", timeout_s: float = 600.0) -> RankEnv:
    """Join the process group torchrun describes in the environment, or form a world of one.

    gloo on CPU, NCCL on CUDA. A world of one uses an in-memory store, so single-process runs need no port.
    """
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(device_preference, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if world == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(backend, store=_attempt_store(world, timeout), rank=rank, world_size=world,
                                    timeout=timeout, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, device_id=device
                                    if device.type == "cuda" else None)
    return RankEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device)


def _attempt_store(world: int, timeout: timedelta) -> dist.Store:
    """The torchrun agent's store, under a prefix of its own for each restart attempt.

    The agent keeps one store across restarts: without the prefix a restarted rank can read the address
    a dead rank of the previous attempt published, and gloo then waits on a peer that no longer exists.
    """
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"meshfit/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def teardown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
