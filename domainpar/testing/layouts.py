"""Rank-agreed layouts for tests of distributed ops (no torch needed): even,
uneven, zero-size and periodic blocks on 1-, 2- and 3-D process grids. Every
rank derives the same layout from the same arguments, without talking."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..comm.grid import ProcessGrid

KINDS = ("even", "uneven", "zero", "periodic")


def block_sizes(n: int, parts: int, kind: str, seed: int = 0):
    """Local. Block sizes of ``n`` over ``parts``, for one of the test layouts.

    Parameters
    ----------
    n : int
        The size of the dim.
    parts : int
        The number of blocks.
    kind : {'even', 'uneven', 'zero', 'periodic'}
        Balanced ('even' and 'periodic'), unbalanced but non-empty where
        possible ('uneven'), or with empty blocks ('zero': the last block takes
        nothing, the first the most).
    seed : int, default 0
        Seeds the random cut of 'uneven' and 'zero'.

    Returns
    -------
    list of int or None
        The sizes, or None for balanced blocks.
    """
    if kind not in KINDS:
        raise ValueError(f"layout kind {kind!r} is not one of {KINDS}")
    if kind in ("even", "periodic") or parts == 1:
        return None
    rng = np.random.default_rng(seed + 1000 * n + parts)
    if kind == "zero":
        cuts = np.sort(rng.integers(0, n + 1, size=parts - 2)) if parts > 2 else np.array([], int)
        sizes = np.diff(np.concatenate(([0], cuts, [n]))).tolist() + [0]
        return [int(s) for s in sizes]
    if n < parts:
        return None
    weights = rng.random(parts) + 0.2
    sizes = np.maximum(1, np.floor(weights / weights.sum() * n)).astype(int)
    sizes[np.argmax(sizes)] += n - sizes.sum()
    return [int(s) for s in sizes]


def layout(shape, shard_dims, grid_ndim: int, kind: str, seed: int = 0, periodic=False,
           comm=None):
    """Collective over ``comm`` (default COMM_WORLD: it builds a ProcessGrid).
    A test layout for a tensor, to pass to ``shard_like`` or
    ``assert_matches_single_process``.

    Parameters
    ----------
    shape : sequence of int
        The tensor's global shape.
    shard_dims : sequence of int
        Dims to cut: the first ``grid_ndim`` of them are cut along grid axes 0,
        1, 2; grid axes beyond the sharded dims replicate.
    grid_ndim : int
        The grid's number of axes (dims from ``MPI.Compute_dims``).
    kind : {'even', 'uneven', 'zero', 'periodic'}
        One of ``KINDS`` (see ``block_sizes``); 'periodic' also makes every
        grid axis periodic.
    seed : int, default 0
        Seeds the block sizes.
    periodic : bool, default False
        Make every grid axis periodic.
    comm : mpi4py.MPI.Comm, optional
        The ranks; COMM_WORLD by default.

    Returns
    -------
    tuple
        ``(grid, shard, sizes)``; sizes is None for balanced blocks.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    dims = MPI.Compute_dims(comm.Get_size(), grid_ndim)
    grid = ProcessGrid(dims, periodic=periodic or kind == "periodic", comm=comm)
    shard = {d: a for a, d in enumerate(shard_dims[:grid_ndim])}
    sizes = {}
    for d, a in shard.items():
        s = block_sizes(shape[d], dims[a], kind, seed)
        if s is not None:
            sizes[d] = s
    return grid, shard, sizes or None
