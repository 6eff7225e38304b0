"""Which dimension FSDP splits an expert-parallel shard's routed experts on, for train, verify and plan.

Each rank holds `local` = E/ep experts of a block as tensors (local, F, D) and (local, D, F) (w1/w3, w2); FSDP
shards them again over the `ranks` (edp) that hold the same experts. FSDP2 splits dimension 0 by default in
chunks of ⌈local / ranks⌉ rows, padding the last ones: with fewer local experts than ranks (or a count that is
not a multiple) the first ranks keep whole experts, the others padding, and every all-gather brings
⌈local / ranks⌉ · ranks expert rows (Mixtral 8x7B at dp_shard=64, ep=8: rank 0 keeps a whole expert per block,
8 times the even share; at ep=2, 32 gathered rows for 4 experts). Splitting dimension 1 (an expert's F or D
rows) instead gives every rank the same share and gathers exactly the local experts, as torchtitan does for
its experts. FSDP2 allows a dimension other than 0 only when it splits evenly (torch 2.13,
fsdp/_fully_shard/_fsdp_param.py: "FSDP does not support uneven sharding on dim"), so dimension 1 is taken
only where each tensor's dimension 1 divides by the ranks; elsewhere dimension 0 stays, padded.
"""

from __future__ import annotations

from collections.abc import Iterable


def expert_shard_dim(local: int, ranks: int, dim1_sizes: Iterable[int]) -> int:
    """The dimension FSDP shards a rank's `local` experts on over `ranks` ranks: 0 where the experts split
    evenly (or one rank holds them), else 1 when every tensor's dimension-1 size in `dim1_sizes` (F and D)
    divides by `ranks`, else 0 (padded)."""
    if ranks <= 1 or local % ranks == 0:
        return 0
    return 1 if all(size % ranks == 0 for size in dim1_sizes) else 0
