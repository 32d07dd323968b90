"""Derived decompositions: the layout of an op's output, computed the same way on
every rank from layouts every rank knows, so no message is needed (and none of
the construction-time agreement checks either)."""
from __future__ import annotations

from typing import Mapping, Sequence

from ..comm.decomposition import Decomposition
from ..comm.errors import LayoutError


def derive(like: Decomposition, global_shape: Sequence[int], shard: Mapping[int, int],
           sizes: Mapping[int, Sequence[int]] | None = None) -> Decomposition:
    """A decomposition on ``like``'s grid; balanced blocks where ``sizes`` is silent."""
    return Decomposition(tuple(global_shape), like.grid, dict(shard), dict(sizes or {}),
                         check=False)


def sharded_sizes(dec: Decomposition) -> dict[int, tuple[int, ...]]:
    """``{dim: block sizes}`` for every sharded dim of ``dec``."""
    return {d: dec.block_sizes(d) for d in dec.shard}


def remap(dec: Decomposition, global_shape: Sequence[int],
          dim_map: Mapping[int, int]) -> Decomposition:
    """``dec``'s sharding carried to a new shape: old sharded dim ``d`` becomes new
    dim ``dim_map[d]`` with the same grid axis and block sizes. Every sharded dim
    must appear in ``dim_map``."""
    shard, sizes = {}, {}
    for d, axis in dec.shard.items():
        if d not in dim_map:
            raise LayoutError(f"internal: sharded dim {d} has no image in {dict(dim_map)}")
        shard[dim_map[d]] = axis
        sizes[dim_map[d]] = dec.block_sizes(d)
    return derive(dec, global_shape, shard, sizes)


def unsharded(dec: Decomposition, dims: Sequence[int]) -> Decomposition:
    """``dec`` with ``dims`` no longer cut (replicated along their grid axes)."""
    keep = {d: a for d, a in dec.shard.items() if d not in set(dims)}
    return derive(dec, dec.global_shape, keep, {d: dec.block_sizes(d) for d in keep})


def comm_of(dec: Decomposition, dims: Sequence[int]):
    """The communicator over the grid axes that cut ``dims`` (size one when none do)."""
    return dec.grid.sub(dec.shard[d] for d in dims if d in dec.shard)


def sharded_dims_text(dec: Decomposition) -> str:
    if not dec.shard:
        return "no sharded dims"
    return ", ".join(f"dim {d} (size {dec.global_shape[d]}) over grid axis {a}"
                     for d, a in dec.shard.items())
