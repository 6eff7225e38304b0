"""A weighted mixture of token arrays, as ``TokenBatches`` reads it (the order of its sequences: blend.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshfit.data.blend import DEFAULT_BLOCK, block_counts, normalized, sufficient_block
from meshfit.data.errors import DataError
from meshfit.data.windows import TokenArray


@dataclass(frozen=True)
class Part:
    """One source of a mixture: its tokens, its weight (relative: the weights need not sum to 1), the name
    errors call it by, and whether its windows are read in a seeded order per epoch."""

    tokens: TokenArray
    weight: float
    name: str
    shuffle: bool = False


@dataclass(frozen=True)
class Mixture:
    """Sources read in blocks of `block` sequences, each source its rounded share of every block."""

    parts: tuple[Part, ...]
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if not self.parts:
            raise DataError("a mixture needs at least one source")
        for part in self.parts:
            if not (math.isfinite(part.weight) and part.weight > 0):
                raise DataError(f"{part.name}: weight {part.weight!r} is not valid; a weight is a finite number > 0 "
                                "(relative: the weights need not sum to 1)")
        if self.block < 1:
            raise DataError(f"a mixture's block needs ≥ 1 sequence (got {self.block})")
        counts = block_counts(self.weights, self.block)
        if counts.min() < 1:
            part = self.parts[int(counts.argmin())]
            raise DataError(f"{part.name}: its weight {part.weight:g} gives it 0 of every {self.block} sequences; "
                            f"a block of ≥ {sufficient_block(self.weights)} sequences gives every source a share")

    @property
    def weights(self) -> list[float]:
        return [part.weight for part in self.parts]

    def describe(self) -> str:
        """Short identity for a data state: each source's size and share."""
        shares = normalized(self.weights)
        inner = ", ".join(f"{len(p.tokens)} tokens × {s:.4g}" for p, s in zip(self.parts, shares, strict=True))
        return f"mixture of {len(self.parts)} sources ({inner}), block {self.block}"
