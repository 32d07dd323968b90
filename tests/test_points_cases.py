"""Shared cases for the point-set tests (test_points.py, test_points_models.py;
no tests here): point clouds (uniform, strongly clustered, with exact
duplicates for the tie-break), the layouts of the point dim on 1-, 2- and
3-D grids (even and with empty blocks), and one-process references in plain
torch."""
import functools
import math

import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.testing import block_sizes, shard_like

F64 = torch.float64


def cloud(n: int, kind: str, seed: int = 0, dim: int = 3) -> torch.Tensor:
    """``n`` points in the unit cube: 'uniform', or 'clustered' (nine in ten in a
    ball of radius ~0.01); the last three repeat the first three exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, dim, generator=g, dtype=F64)
    if kind == "clustered":
        m = (9 * n) // 10
        x[:m] = 0.3 + 0.01 * torch.randn(m, dim, generator=g, dtype=F64)
    if n >= 6:
        x[-3:] = x[:3]
    return x


@functools.cache
def grids():
    """(name, grid, shard of the point dim) per layout family; one grid each per file."""
    p = MPI.COMM_WORLD.Get_size()
    g1 = dp.ProcessGrid((p,))
    g2 = dp.ProcessGrid(MPI.Compute_dims(p, 2))
    g3 = dp.ProcessGrid(MPI.Compute_dims(p, 3))
    return (("1d", g1, {0: 0}), ("2d-multi", g2, {0: (0, 1)}), ("2d-replicated", g2, {0: 0}),
            ("3d-multi", g3, {0: (0, 1, 2)}))


LAYOUTS = [(g, kind) for g in range(4) for kind in ("even", "zero")]
LAYOUT_IDS = [f"{('1d', '2d-multi', '2d-replicated', '3d-multi')[g]}-{k}" for g, k in LAYOUTS]


def layout(case, n: int, seed: int = 0):
    """(grid, shard, sizes) for ``n`` points in layout ``case``."""
    g, kind = case
    _, grid, shard = grids()[g]
    axes = shard[0] if isinstance(shard[0], tuple) else (shard[0],)
    parts = math.prod(grid.dims[a] for a in axes)
    sizes = block_sizes(n, parts, kind, seed)
    return grid, shard, ({0: sizes} if sizes else None)


def sharded(t: torch.Tensor, case, requires_grad=False, seed: int = 0):
    grid, shard, sizes = layout(case, t.shape[0], seed)
    return shard_like(t, grid, shard, sizes, requires_grad)


def d2(q, r):
    """Squared distances, the squares added over the coordinates in order."""
    out = (q[:, None, 0] - r[None, :, 0]) ** 2
    for d in range(1, q.shape[1]):
        out = out + (q[:, None, d] - r[None, :, d]) ** 2
    return out


def safe_sqrt(x):
    pos = x > 0
    return torch.where(pos, torch.where(pos, x, torch.ones_like(x)).sqrt(), torch.zeros_like(x))


def knn_oracle(q, r, k):
    """One process: the k nearest by squared distance, ties by index."""
    dd = d2(q, r)
    vals, idx = torch.sort(dd, dim=1, stable=True)
    return idx[:, :k], safe_sqrt(vals[:, :k])


def radius_oracle(q, r, radius, m):
    dd = d2(q, r)
    dd = torch.where(dd <= radius * radius, dd, torch.full_like(dd, float("inf")))
    vals, idx = torch.sort(dd, dim=1, stable=True)
    vals, idx = vals[:, :m], idx[:, :m]
    if vals.shape[1] < m:
        pad = m - vals.shape[1]
        vals = torch.nn.functional.pad(vals, (0, pad), value=float("inf"))
        idx = torch.nn.functional.pad(idx, (0, pad))
    ok = torch.isfinite(vals)
    return torch.where(ok, idx, torch.full_like(idx, -1)), \
        torch.where(ok, safe_sqrt(torch.where(ok, vals, torch.zeros_like(vals))), vals)
