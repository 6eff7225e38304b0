"""Parallel degrees, their validation against the world size, and the named DeviceMesh built from them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshfit.layout.rules import data_parallel_rest

# Outer to inner: pipeline stages span nodes, tensor parallelism stays on the fastest links, context
# parallelism (a collective per layer) next to it.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Meshes:
    """The world mesh plus flattened meshes: `dp` (dp_replicate × dp_shard) reads different data; `dp_cp`
    (× cp) holds replicas of the same weights, so gradients are averaged over it; `shard` is what FSDP
    shards over (dp_shard × cp: context-parallel ranks do not replicate parameters)."""

    world: DeviceMesh
    dp: DeviceMesh
    dp_cp: DeviceMesh
    shard: DeviceMesh
    # parallel.ep > 1: (pp, dp_replicate, edp, ep, tp) over the same ranks, dp_shard × cp split as edp × ep
    # (ep inner); the routed experts are split over `ep` and FSDP-sharded over `edp` (dp_replicate: HSDP).
    experts: DeviceMesh | None = None

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.dp if name == "dp" else self.world[name]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data (replicate × shard), context, tensor and pipeline parallelism; product = world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1  # borrowed from dp_shard × cp: not a factor of the world size

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int | None, tp: int, pp: int, world_size: int,
                zero_stage: int | None = None, cp: int = 1, ep: int = 1) -> ParallelDims:
        """Fill in at most one -1 degree ("the rest") and check the product equals world_size.

        dp_shard None (unset): the data-parallel rest of rules.data_parallel_rest (zero_stage decides
        whether it is sharded or replicated)."""
        implied = dp_shard is None
        dp_replicate, dp_shard = data_parallel_rest(dp_replicate, dp_shard, tp, pp, zero_stage, cp)
        degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp}
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
        dims = cls(**degrees, ep=ep)
        dims.check(world_size)
        return dims

    def check(self, world_size: int) -> None:
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != world_size:
            shown = " × ".join(str(getattr(self, n)) for n in MESH_DIMS)
            raise ValueError(
                f"parallel: {' × '.join(MESH_DIMS)} = {shown} = {product}, but the world size is "
                f"{world_size}; the degrees must multiply to the number of ranks (set one of them to -1 to "
                "take the rest)"
            )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def describe(self) -> str:
        parts = [f"{n}={getattr(self, n)}" for n in MESH_DIMS if getattr(self, n) > 1]
        shown = " × ".join(parts) if parts else "single rank"
        return f"{shown}, experts over ep={self.ep} of the dp_shard × cp ranks" if self.ep > 1 else shown

    def build_mesh(self, device_type: str) -> Meshes:
        """The 5-D named mesh (size-1 dims included, so code can always slice by name) and the flattened
        meshes of `Meshes`."""
        world = init_device_mesh(device_type, tuple(getattr(self, n) for n in MESH_DIMS), mesh_dim_names=MESH_DIMS)
        dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        if self.cp == 1:
            return Meshes(world=world, dp=dp, dp_cp=dp, shard=world["dp_shard"], **self._expert_meshes(device_type))
        dp_cp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return Meshes(world=world, dp=dp, dp_cp=dp_cp, shard=world["dp_shard", "cp"]._flatten("dp_shard_cp"),
                      **self._expert_meshes(device_type))

    def _expert_meshes(self, device_type: str) -> dict[str, DeviceMesh]:
        """Meshes.experts; none without expert parallelism.

        The expert mesh is (pp, dp_replicate, edp, ep, tp) over the world's ranks: dp_shard × cp (adjacent,
        cp inner, in the world mesh) is split as edp × ep with ep inner, so the ep ranks of a group are
        consecutive shard ranks, and a rank's pp, dp_replicate and tp coordinates are its world ones."""
        if self.ep == 1:
            return {}
        shape = (self.pp, self.dp_replicate, self.dp_shard * self.cp // self.ep, self.ep, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp_replicate", "edp", "ep", "tp"))
        return {"experts": mesh}
