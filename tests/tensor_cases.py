"""Rank-agreed layouts for the DomainTensor tests: 1-, 2- and 3-D process grids,
with even, uneven and zero-size blocks. Every rank derives the same layout
from the same arguments, without talking."""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

import domainpar as dp

COMM = MPI.COMM_WORLD
SIZE, RANK = COMM.Get_size(), COMM.Get_rank()
GRID_NDIMS = (1, 2, 3)
KINDS = ("even", "uneven", "zero")
CASES = [(g, k) for g in GRID_NDIMS for k in KINDS]
DTYPES = (torch.float64, torch.float32)


def sizes_for(n: int, parts: int, kind: str, seed: int = 0):
    """Block sizes of ``n`` over ``parts``: balanced ('even', returned as None),
    unbalanced but non-empty where possible ('uneven'), or with empty blocks
    ('zero': the last block takes nothing, the first takes the most)."""
    if kind == "even" or parts == 1:
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


def layout(shape, shard_dims, grid_ndim: int, kind: str, seed: int = 0, periodic=False):
    """(grid, shard, sizes) for a tensor of ``shape``: the first ``grid_ndim`` of
    ``shard_dims`` are cut along grid axes 0, 1, 2; grid axes beyond the sharded
    dims replicate."""
    dims = MPI.Compute_dims(SIZE, grid_ndim)
    grid = dp.ProcessGrid(dims, periodic=periodic)
    shard = {d: a for a, d in enumerate(shard_dims[:grid_ndim])}
    sizes = {}
    for d, a in shard.items():
        s = sizes_for(shape[d], dims[a], kind, seed)
        if s is not None:
            sizes[d] = s
    return grid, shard, sizes or None


def global_tensor(shape, dtype=torch.float64, seed=0):
    """The same random tensor on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

