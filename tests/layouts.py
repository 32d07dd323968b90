"""Random but rank-agreed layouts for the MPI tests, and the global-array oracle
of a halo fill. Every rank draws from the same seed, so all ranks build the
same grid, decomposition and widths without talking."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import domainpar as dp


def random_sizes(rng, n, parts, zeros=True):
    """``n`` cut into ``parts`` uneven blocks, some of them empty."""
    cuts = np.sort(rng.integers(0, n + 1, size=parts - 1)) if parts > 1 else np.array([], int)
    sizes = np.diff(np.concatenate(([0], cuts, [n]))).tolist()
    if not zeros and 0 in sizes and n >= parts:
        return None
    return sizes


def random_layout(seed, comm, grid_ndim, max_extent=9, max_width=4):
    """A ProcessGrid, a Decomposition and halo widths drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    dims = list(MPI.Compute_dims(comm.Get_size(), grid_ndim))
    rng.shuffle(dims)
    periodic = rng.integers(0, 2, size=grid_ndim).astype(bool).tolist()
    grid = dp.ProcessGrid(dims, periodic=periodic, comm=comm)
    ndim = grid_ndim + int(rng.integers(0, 2))
    axes = rng.permutation(grid_ndim)[: int(rng.integers(max(grid_ndim - 1, 1), grid_ndim + 1))]
    tdims = rng.permutation(ndim)[: len(axes)]
    shard = {int(d): int(a) for d, a in zip(tdims, axes)}
    shape = [int(rng.integers(0, max_extent + 1)) if rng.random() < 0.1 else
             int(rng.integers(1, max_extent + 1)) for _ in range(ndim)]
    sizes = {}
    for d, a in shard.items():
        if rng.random() < 0.5:
            sizes[d] = random_sizes(rng, shape[d], dims[a])
    dec = dp.Decomposition(shape, grid, shard=shard, sizes=sizes)
    width = {}
    for d in range(ndim):
        if rng.random() < 0.8:
            lo, hi = (int(w) for w in rng.integers(0, max_width + 1, size=2))
            width[d] = lo if lo == hi and rng.random() < 0.5 else (lo, hi)
    return grid, dec, width


def global_array(shape, seed, dtype=np.float64):
    """The same random global array on every rank."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        a = a + 1j * rng.standard_normal(shape)
    return a.astype(dtype)


def reference_fill(glob, halo, padded):
    """What ``halo.fill(padded)`` must give: every cell whose global index is
    inside the domain (wrapping on periodic axes) along every dim gets the
    global value; cells off a non-periodic domain keep theirs."""
    dec = halo.decomposition
    out = padded.copy()
    valid, index = [], []
    for d in range(dec.ndim):
        n, off, lo = dec.global_shape[d], dec.offsets()[d], halo.lo[d]
        g = off - lo + np.arange(halo.padded_shape[d])
        axis = dec.axis_of(d)
        if axis is None:
            ok = (g >= off) & (g < off + dec.local_shape()[d])
        elif dec.grid.periodic[axis]:
            ok = np.full(g.shape, n > 0)
        else:
            ok = (g >= 0) & (g < n)
        valid.append(ok)
        index.append(np.mod(g, n) if n else g)
    mask = np.ones(halo.padded_shape, bool)
    for d, ok in enumerate(valid):
        mask &= ok.reshape([-1 if j == d else 1 for j in range(dec.ndim)])
    if mask.any():
        picked = glob[np.ix_(*[np.where(v, i, 0) for v, i in zip(valid, index)])]
        out[mask] = picked[mask]
    return out


def grid_dims_cases(size, max_ndim=3):
    """Grid dims covering ``size`` processes: ``MPI.Compute_dims`` for 1- to
    ``max_ndim``-D grids plus their distinct permutations (e.g. (2, 1) and (1, 2)),
    the same list on every rank."""
    import itertools
    out = []
    for ndim in range(1, max_ndim + 1):
        for dims in itertools.permutations(MPI.Compute_dims(size, ndim)):
            if dims not in out:
                out.append(tuple(int(d) for d in dims))
    return out


def random_decomposition(rng, grid, shape, replicate=True, zeros=True):
    """A Decomposition of ``shape`` on ``grid`` drawn from ``rng`` (all ranks must
    draw alike): a random shard map, some grid axes left replicated when
    ``replicate`` (otherwise every grid axis cuts a tensor dim, which needs
    ``len(shape) >= grid.ndim``), and per dim either balanced or random sizes
    (with zero-size blocks when ``zeros``)."""
    ndim = len(shape)
    if replicate:
        n_axes = int(rng.integers(0, min(grid.ndim, ndim) + 1))
    else:
        if ndim < grid.ndim:
            raise ValueError(f"a {ndim}-D shape cannot shard every axis of a {grid.ndim}-D grid")
        n_axes = grid.ndim
    axes = rng.permutation(grid.ndim)[:n_axes]
    tdims = rng.permutation(ndim)[:n_axes]
    shard = {int(d): int(a) for d, a in zip(tdims, axes)}
    sizes = {}
    for d, a in shard.items():
        if rng.random() < 0.6:
            s = random_sizes(rng, shape[d], grid.dims[a], zeros=zeros)
            if s is not None:
                sizes[d] = s
    return dp.Decomposition(shape, grid, shard=shard, sizes=sizes)
