"""Parallel degrees, their validation against the world size, and the named DeviceMesh built from them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshfit.parallel.rules import data_parallel_rest

# Outer to inner: pipeline stages span nodes, tensor parallelism stays on the fastest links.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Meshes:
    """The world mesh plus the flattened data-parallel mesh that gradient reduction and data use."""

    world: DeviceMesh
    dp: DeviceMesh

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.dp if name == "dp" else self.world[name]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data (replicate × shard), tensor and pipeline parallelism; product = world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int | None, tp: int, pp: int, world_size: int,
                zero_stage: int | None = None) -> ParallelDims:
        """Fill in at most one -1 degree ("the rest") and check the product equals world_size.

        dp_shard None (unset): the data-parallel rest of rules.data_parallel_rest (zero_stage decides
        whether it is sharded or replicated)."""
        implied = dp_shard is None
        dp_replicate, dp_shard = data_parallel_rest(dp_replicate, dp_shard, tp, pp, zero_stage)
        degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp}
        free = [name for name, d in degrees.items() if d == -1]
        if len(free) > 1:
            raise ValueError(f"parallel: at most one degree may be -1 (the rest); got -1 for {', '.join(free)}")
        known = math.prod(d for d in degrees.values() if d != -1)
        if free:
            if world_size % known:
                others = " × ".join(f"{n}={d}" for n, d in degrees.items() if d != -1)
                given = (f"parallel.dp_shard is unset, so data parallelism ({free[0]}) takes the ranks the other "
                         "degrees leave, but " if implied else f"parallel.{free[0]}=-1: ")
                raise ValueError(
                    f"{given}the other degrees multiply to {others} = {known}, and the world size is "
                    f"{world_size}, which {known} does not divide; choose degrees whose product divides "
                    f"{world_size} (divisors: {', '.join(map(str, divisors(world_size)))})"
                )
            degrees[free[0]] = world_size // known
        dims = cls(**degrees)
        dims.check(world_size)
        return dims

    def check(self, world_size: int) -> None:
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp
        if product != world_size:
            shown = " × ".join(str(getattr(self, n)) for n in MESH_DIMS)
            raise ValueError(
                f"parallel: pp × dp_replicate × dp_shard × tp = {shown} = {product}, but the world size is "
                f"{world_size}; the degrees must multiply to the number of ranks (set one of them to -1 to "
                "take the rest)"
            )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        parts = [f"{n}={getattr(self, n)}" for n in MESH_DIMS if getattr(self, n) > 1]
        return " × ".join(parts) if parts else "single rank"

    def build_mesh(self, device_type: str) -> Meshes:
        """The 4-D named mesh (size-1 dims included, so code can always slice by name) and the dp mesh."""
        world = init_device_mesh(device_type, tuple(getattr(self, n) for n in MESH_DIMS), mesh_dim_names=MESH_DIMS)
        dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        return Meshes(world=world, dp=dp)
