"""Candidate process grids for a field: which rank counts, how each count is
split over the shardable dims, and each rank's block.

A grid puts ``p_d`` ranks along each shardable dim ``d`` (``p_d = 1``: that dim
is whole on every rank), with the product of the ``p_d`` the rank count. The
blocks are domainpar's balanced ones, so the largest block, the one whose
rank peaks highest, has ``ceil(n_d / p_d)`` cells along ``d``. A grid whose
blocks are smaller than the model needs along a dim (``min_block``: e.g.
``2**(levels - 1)`` for a UNet, so that its coarsest level keeps a cell on
every rank, or a patch size) is kept but flagged "too small"; one with more
ranks along a dim than that dim has cells is not a candidate.

Pure Python, no torch or MPI: the grid arithmetic is tested on its own.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


def candidate_counts(limit: int) -> list[int]:
    """Local. The rank counts worth tabulating up to ``limit``: powers of two and
    three times powers of two (1, 2, 3, 4, 6, 8, 12, 16, 24 ...), the counts
    jobs and nodes usually come in."""
    counts, power = [], 1
    while power <= limit:
        counts.append(power)
        if power > 1 and 3 * power // 2 <= limit:
            counts.append(3 * power // 2)
        power *= 2
    return sorted(counts)


def factorizations(count: int, extents: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Local. Every ordered split of ``count`` ranks over dims of these extents
    (``p_d`` divides out of ``count``, ``p_d <= extent``)."""
    if not extents:
        if count == 1:
            yield ()
        return
    for p in range(1, min(count, extents[0]) + 1):
        if count % p == 0:
            for rest in factorizations(count // p, extents[1:]):
                yield (p,) + rest


@dataclass(frozen=True)
class Grid:
    """``ranks`` along each shardable dim (``dims``) of a field of ``shape``."""
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        """Local. The number of ranks of the grid."""
        return math.prod(self.ranks)

    @property
    def block(self) -> tuple[int, ...]:
        """The largest rank's block (ceil division along each sharded dim)."""
        block = list(self.shape)
        for d, p in zip(self.dims, self.ranks):
            block[d] = -(-self.shape[d] // p)
        return tuple(block)

    @property
    def sharded(self) -> tuple[int, ...]:
        """The dims split over more than one rank."""
        return tuple(d for d, p in zip(self.dims, self.ranks) if p > 1)

    @property
    def uneven(self) -> bool:
        """Local. Whether some sharded dim does not divide evenly over its ranks."""
        return any(self.shape[d] % p for d, p in zip(self.dims, self.ranks))

    def too_small(self, min_block: int) -> tuple[int, ...]:
        """The sharded dims whose smallest block has fewer than ``min_block`` cells."""
        return tuple(d for d, p in zip(self.dims, self.ranks)
                     if p > 1 and self.shape[d] // p < min_block)

    def label(self) -> str:
        """``"2x1x4"``: ranks along each shardable dim, in dim order."""
        return "x".join(map(str, self.ranks))

    def shard(self) -> dict[int, int]:
        """domainpar's ``shard`` for ``ProcessGrid(self.ranks)``: dim -> grid axis."""
        return {d: axis for axis, d in enumerate(self.dims)}


def grids(shape: Sequence[int], dims: Sequence[int], count: int) -> list[Grid]:
    """Local. Every grid of ``count`` ranks over ``dims`` of ``shape``."""
    shape, dims = tuple(shape), tuple(dims)
    return [Grid(shape, dims, ranks)
            for ranks in factorizations(count, [shape[d] for d in dims])]
