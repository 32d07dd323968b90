"""Derived decompositions: the layout of an op's output, computed the same way on
every rank from layouts every rank knows, so no message is needed (and none of
the construction-time agreement checks either)."""
from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

from mpi4py import MPI

from ..comm.decomposition import Decomposition
from ..comm.errors import LayoutError
from ..comm.grid import ProcessGrid

_T = TypeVar("_T")

# -- the plan cache ----------------------------------------------------------------------------
# What a rule derives from layouts alone (an output Decomposition, the target
# layout of an operand), memoised under a key that holds everything the result
# depends on: Decompositions (equal when grid, shape, shard map and sizes are),
# shapes and plain values. Every rank derives the same plans in the same order
# (metadata is the same on every rank), so the caches of all ranks agree; a miss
# is the uncached path. DOMAINPAR_PLAN_CACHE=0 turns it and the fast paths that
# rely on it off (``set_plan_cache``, for ``bench ... --compare``).
ENABLED = os.environ.get("DOMAINPAR_PLAN_CACHE", "1") != "0"
_PLANS: dict[Hashable, Any] = {}
_MAX_PLANS = 8192  # a bound for programs whose shapes never repeat: emptied when reached
_COUNTS = {"hits": 0, "misses": 0}
_MISSING = object()


def planned(key: Hashable, make: Callable[[], _T]) -> _T:
    """Local. ``make()``, memoised under ``key`` while the plan cache is on. An
    error in ``make`` is raised, not cached; an unhashable key is not cached."""
    if not ENABLED:
        return make()
    try:
        plan = _PLANS.get(key, _MISSING)
    except TypeError:  # an unhashable part (a list given as sizes ...): no caching
        return make()
    if plan is _MISSING:
        plan = make()
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
        _COUNTS["misses"] += 1
    else:
        _COUNTS["hits"] += 1
    return plan  # type: ignore[no-any-return]


def set_plan_cache(on: bool) -> None:
    """Local. Turn the plan cache and the dispatch fast paths on or off (the
    DOMAINPAR_PLAN_CACHE setting). Plans made before stay valid (a plan depends
    on its key alone) and serve again when it is turned back on."""
    global ENABLED
    ENABLED = bool(on)


def clear_plan_cache() -> None:
    """Local. Empty the plan cache and zero its counts."""
    _PLANS.clear()
    _COUNTS.update(hits=0, misses=0)


def plan_cache_stats() -> dict[str, int]:
    """Local. The plan cache's ``hits``, ``misses`` (plans made) since it was last
    emptied, its ``size`` (plans held) and ``enabled`` (1 or 0)."""
    return {**_COUNTS, "size": len(_PLANS), "enabled": int(ENABLED)}


def derive(like: Decomposition, global_shape: Sequence[int], shard: Mapping[int, int],
           sizes: Mapping[int, Sequence[int]] | None = None,
           grid: ProcessGrid | None = None) -> Decomposition:
    """A decomposition on ``like``'s grid (or ``grid``, one of the same processes:
    a merged grid or its parent); balanced blocks where ``sizes`` is silent.
    Decompositions are never changed once made, so equal requests share one."""
    grid = like.grid if grid is None else grid
    if not ENABLED:
        return _derived(global_shape, grid, shard, sizes)
    key = ("derive", grid, tuple(global_shape), tuple(shard.items()),
           tuple((d, tuple(s)) for d, s in sizes.items()) if sizes else ())
    return planned(key, lambda: _derived(global_shape, grid, shard, sizes))


def _derived(global_shape: Sequence[int], grid: ProcessGrid, shard: Mapping[int, int],
             sizes: Mapping[int, Sequence[int]] | None) -> Decomposition:
    return Decomposition(tuple(global_shape), grid, dict(shard), dict(sizes or {}), check=False)


def cut(dec: Decomposition, dim: int) -> bool:
    """Whether ``dim`` is cut into more than one block: sharded on a grid axis of
    more than one process (an axis of one process shards nothing)."""
    return dim in dec.shard and dec.grid.dims[dec.shard[dim]] > 1


def merged(dec: Decomposition, dims: Sequence[int], onto: int,
           sizes: Sequence[int] | None = None) -> Decomposition:
    """Collective on first use of the merged grid. ``dec`` moved onto the grid in
    which the axes of ``dims`` (sharded, in this order) are one: ``onto`` is cut
    over all of them (``sizes``, or balanced), the other dims of ``dims`` are whole,
    and every other dim keeps its axis and blocks."""
    axes = tuple(dec.shard[d] for d in dims)
    grid = dec.grid.merged(axes)
    to = grid.axis_from_parent
    shard = {d: to[a] for d, a in dec.shard.items() if d not in dims}
    kept = {d: dec.block_sizes(d) for d in shard}
    shard[onto] = to[axes[0]]
    if sizes is not None:
        kept[onto] = tuple(sizes)
    return derive(dec, dec.global_shape, shard, kept, grid=grid)


def unmerged(dec: Decomposition, global_shape: Sequence[int], dims: Sequence[int]) -> Decomposition:
    """The layout on the parent of ``dec``'s merged grid in which ``dims`` take the
    merged axes in order (balanced) and every dim on another axis keeps its axis
    and blocks: the way back from ``merged``."""
    grid = dec.grid
    parent, axes = grid.parent, grid.merged_axes
    back = {v: a for a, v in grid.axis_from_parent.items() if a not in axes}
    shard = {d: back[a] for d, a in dec.shard.items() if a in back}
    sizes = {d: dec.block_sizes(d) for d in shard}
    shard.update(zip(dims, axes))
    return derive(dec, global_shape, shard, sizes, grid=parent)


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


def comm_of(dec: Decomposition, dims: Sequence[int]) -> MPI.Cartcomm:
    """The communicator over the grid axes that cut ``dims`` (size one when none do)."""
    dims = tuple(dims)
    return planned(("comm_of", dec, dims),
                   lambda: dec.grid.sub(dec.shard[d] for d in dims if d in dec.shard))


def sharded_dims_text(dec: Decomposition) -> str:
    """Local. ``dec``'s sharded dims, their sizes and grid axes, for messages."""
    if not dec.shard:
        return "no sharded dims"
    return ", ".join(f"dim {d} (size {dec.global_shape[d]}) over {_axes_text(dec.grid, a)}"
                     for d, a in dec.shard.items())


def _axes_text(grid: ProcessGrid, axis: int) -> str:
    """``grid axis a``; for a merged grid, the axes of the grid the user made."""
    return grid.axes_text(axis) if hasattr(grid, "axes_text") else f"grid axis {axis}"
