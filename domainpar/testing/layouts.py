"""Rank-agreed layouts for tests of distributed ops (no torch needed): even,
uneven, zero-size and periodic blocks on 1-, 2- and 3-D process grids. Every
rank derives the same layout from the same arguments, without talking."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..comm.grid import ProcessGrid

KINDS = ("even", "uneven", "zero", "periodic")


def block_sizes(n: int, parts: int, kind: str, seed: int = 0):
    """Local. Block sizes of ``n`` over ``parts``: balanced ('even' and 'periodic',
    returned as None), unbalanced but non-empty where possible ('uneven'), or
    with empty blocks ('zero': the last block takes nothing, the first the most)."""
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
    (grid, shard, sizes) for a tensor of ``shape``, to pass to ``shard_like`` or
    ``assert_matches_single_process``: the first ``grid_ndim`` of ``shard_dims``
    are cut along grid axes 0, 1, 2 of a ``grid_ndim``-D grid (``MPI.Compute_dims``);
    grid axes beyond the sharded dims replicate. ``kind`` is one of ``KINDS``
    (see ``block_sizes``); 'periodic' (or ``periodic=True``) makes every grid
    axis periodic."""
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
