"""Spatial partition of a point set: recursive coordinate bisection (RCB).

Collective. The ranks along the point dim's grid axis are split in two halves
(``[a, m)`` and ``[m, b)``, ``m = a + (b - a) // 2``), the group's points are cut
by a plane across the longest side of their bounding box so that the left half
gets ``round(n * c_left / (c_left + c_right))`` points (``c``: the ranks'
capacities, equal by default), and each half recurses. Counts are exact: the
cut is the ``k``-th smallest key ``(coordinate, global index)``, found by
bisection on the coordinate's bits and then on the index, one small allreduce
per step (about 64 + log2 N per level, all groups of a level together); no rank
ever holds more than its own points. Any number of ranks; a rank may end with
no points (fewer points than ranks, or a zero capacity).

The partition is a permutation of the points: ``Partition.apply`` moves any
tensor whose dim 0 runs over the points into the new layout (a ``Push`` along
a ``Route``, adjoint ``Pull``), ``Partition.inverse`` brings results back to
the input order and layout. Inside a rank, points keep their input order.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ..comm.errors import agree, signature_of
from ..tensor.domain_tensor import DomainTensor
from ..tensor.layout import derive
from .common import global_index, like_rows, point_comm, points_arg
from .route import Route, pull, push

_FLIP = np.int64(0x7FFFFFFFFFFFFFFF)


def ordered_bits(x: np.ndarray) -> np.ndarray:
    """Local. float64 values as int64 keys with the same order (-0.0 < +0.0)."""
    b = np.ascontiguousarray(x, dtype=np.float64).view(np.int64)
    return np.where(b < 0, b ^ _FLIP, b)


class Partition:
    """The result of ``partition``: the new layout of the points, its regions and
    the moves between the input layout and it.

    ``points``: the coordinates in the new layout (a DomainTensor, uneven
    blocks); ``regions``: an (P, 2, D) float64 tensor, every rank's box
    ``[lo, hi]`` (its cell of the bisection, closed: a point on a cut plane may
    lie on either side; outer faces at the points' bounding box);
    ``sizes``: the points per rank; ``global_index``: the input index of each
    local point (a DomainTensor, new layout).
    """

    def __init__(self, coords: DomainTensor, dest: np.ndarray, regions: np.ndarray):
        dec = coords.decomposition
        self.src = dec
        comm = point_comm(dec, 0)
        size = comm.Get_size()
        counts = np.bincount(dest, minlength=size).astype(np.int64)
        before = np.zeros_like(counts)
        total = counts.copy()
        if size > 1:
            comm.Exscan(counts, before, op=MPI.SUM)
            comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
            if comm.Get_rank() == 0:
                before[:] = 0
        dest_t = torch.as_tensor(dest, dtype=torch.int64)
        rank_in = torch.zeros_like(dest_t)
        for r in np.unique(dest):
            sel = dest_t == int(r)
            rank_in[sel] = torch.arange(int(sel.sum())) + int(before[r])
        self.route = Route(comm, dest_t, rank_in)
        self.sizes = tuple(int(n) for n in total)
        self.dst = derive(dec, dec.global_shape, {0: dec.shard[0]}, {0: self.sizes})
        self._arrival = torch.argsort(self.route.recv_local)
        self.regions = torch.as_tensor(regions)
        self.points = self.apply(coords)
        gi = global_index(dec, 0)
        self.global_index = DomainTensor(self.route.send(gi)[self._arrival],
                                         like_rows(self.dst, 0, (dec.global_shape[0],)))

    def assign(self, coords: DomainTensor) -> Partition:
        """Collective. Another point set (queries, say) laid out by these regions:
        each point goes to the first rank whose region holds it, or the nearest
        region for a point outside them all. No balance is sought; a search then
        finds most neighbours on the rank itself and the halos stay small."""
        coords = points_arg(coords, "Partition.assign")
        x = coords.to_local().detach().to("cpu", torch.float64)
        lo, hi = self.regions[:, 0], self.regions[:, 1]
        gap = (lo[None] - x[:, None]).clamp(min=0) + (x[:, None] - hi[None]).clamp(min=0)
        dest = (gap ** 2).sum(-1).argmin(dim=1) if len(x) else torch.zeros(0, dtype=torch.int64)
        return Partition(coords, dest.numpy().astype(np.int64), self.regions.numpy())

    def __call__(self, *tensors):
        """Collective. ``apply`` to each of ``tensors``; one tensor gives one result."""
        out = tuple(self.apply(t) for t in tensors)
        return out[0] if len(out) == 1 else out

    def apply(self, x: DomainTensor) -> DomainTensor:
        """Collective. ``x`` (dim 0 over the input points, laid out like the input or
        repartitioned to it) moved into the partition's layout. Differentiable."""
        local = self._local_in(x, self.src)
        out = push(local, self.route)[self._arrival.to(local.device)]
        return DomainTensor(out, like_rows(self.dst, 0, tuple(x.shape)))

    def inverse(self, y: DomainTensor) -> DomainTensor:
        """Collective. ``y`` (dim 0 over the partitioned points) back in the input
        order and layout. Differentiable (its adjoint is ``apply``)."""
        local = self._local_in(y, self.dst)
        back = pull(local[self.route.recv_local.to(local.device)], self.route)
        return DomainTensor(back, like_rows(self.src, 0, tuple(y.shape)))

    def _local_in(self, x, dec) -> torch.Tensor:
        from ..autograd import repartition
        x = points_arg(x, "Partition", ndim=x.ndim if isinstance(x, DomainTensor) else 2)
        agree(point_comm(dec, 0), None if x.shape[0] == dec.global_shape[0] else
              f"Partition: a tensor of {x.shape[0]} points, the partition has "
              f"{dec.global_shape[0]}")
        want = like_rows(dec, 0, tuple(x.shape))
        if x.decomposition.grid is not dec.grid:
            agree(point_comm(dec, 0), "Partition: the tensor is on another grid than the points")
        return repartition(x.to_local(), x.decomposition, want)


def partition(coords: DomainTensor, capacity=None) -> Partition:
    """Collective. Recursive coordinate bisection of the points ``coords`` (an
    (N, D) DomainTensor sharded on dim 0, any layout): balanced counts, or counts
    proportional to ``capacity`` (one non-negative weight per rank of the point
    dim's axis, e.g. fractions of the points; default equal). Returns a
    ``Partition`` (``.points``, ``.regions``, ``.apply``, ``.inverse``)."""
    coords = points_arg(coords, "partition")
    dec = coords.decomposition
    comm = point_comm(dec, 0)
    size = comm.Get_size()
    cap = _capacity(comm, capacity, size)
    x = coords.to_local().detach().to("cpu", torch.float64).numpy()
    agree(comm, None if np.all(np.isfinite(x)) else
          "partition: the coordinates hold NaN or infinite values")
    gidx = global_index(dec, 0).numpy()
    keys = [ordered_bits(x[:, d]) for d in range(x.shape[1])]
    lo_rank = np.zeros(len(x), np.int64)
    hi_rank = np.full(len(x), size, np.int64)
    box = _bounds(comm, x, np.zeros(len(x), np.int64), 1)[0]
    regions = np.repeat(box[None], size, axis=0)
    level = [(0, size)]
    while any(b - a > 1 for a, b in level):
        split = [(a, b) for a, b in level if b - a > 1]
        _split_level(comm, split, x, keys, gidx, lo_rank, hi_rank, cap, regions)
        level = [h for a, b in level for h in
                 (((a, a + (b - a) // 2), (a + (b - a) // 2, b)) if b - a > 1 else ((a, b),))]
    return Partition(coords, lo_rank, regions)


def _capacity(comm, capacity, size: int) -> np.ndarray:
    if capacity is None:
        return np.ones(size)
    cap = np.asarray(capacity, dtype=np.float64).reshape(-1)
    problem = None
    if cap.shape != (size,) or not np.all(np.isfinite(cap)) or np.any(cap < 0) or cap.sum() <= 0:
        problem = (f"partition: capacity needs {size} finite non-negative weights (one per rank "
                   f"of the point axis) with a positive sum, got {capacity!r}")
    agree(comm, problem, signature=signature_of(cap.tolist()) if problem is None else 0,
          what="partition capacities", described=cap.tolist() if problem is None else "")
    return cap


def _bounds(comm, x: np.ndarray, group: np.ndarray, n_groups: int) -> np.ndarray:
    """Collective. (G, 2, D) bounding boxes of each group's points (inf/-inf when empty)."""
    d = x.shape[1]
    lo = np.full((n_groups, d), np.inf)
    hi = np.full((n_groups, d), -np.inf)
    for g in range(n_groups):
        sel = x[group == g]
        if len(sel):
            lo[g], hi[g] = sel.min(0), sel.max(0)
    buf = np.concatenate([lo.ravel(), -hi.ravel()])
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MIN)
    return np.stack([buf[:n_groups * d].reshape(n_groups, d),
                     -buf[n_groups * d:].reshape(n_groups, d)], axis=1)


def _split_level(comm, groups, x, keys, gidx, lo_rank, hi_rank, cap, regions) -> None:
    """Collective. Cut every group of one level in two (updates ``lo_rank``,
    ``hi_rank`` and ``regions`` in place)."""
    member = np.full(len(x), -1, np.int64)
    for g, (a, b) in enumerate(groups):
        member[(lo_rank == a) & (hi_rank == b)] = g
    box = _bounds(comm, x, member, len(groups))
    counts = _allsum(comm, np.bincount(member[member >= 0], minlength=len(groups)))
    axes, targets = [], []
    for g, (a, b) in enumerate(groups):
        ext = np.where(np.isfinite(box[g, 1] - box[g, 0]), box[g, 1] - box[g, 0], 0)
        axes.append(int(np.argmax(ext)))
        m = a + (b - a) // 2
        share = cap[a:m].sum() / cap[a:b].sum()
        targets.append(int(np.floor(counts[g] * share + 0.5)))
    left, cut = _select(comm, member, [keys[ax] for ax in axes], gidx, targets, len(groups))
    for g, (a, b) in enumerate(groups):
        m = a + (b - a) // 2
        sel = member == g
        hi_rank[sel & left] = m
        lo_rank[sel & ~left] = m
        value = cut[g] if cut[g] is not None else box[g, 0, axes[g]]
        if np.isfinite(value):
            regions[a:m, 1, axes[g]] = np.minimum(regions[a:m, 1, axes[g]], value)
            regions[m:b, 0, axes[g]] = np.maximum(regions[m:b, 0, axes[g]], value)


def _allsum(comm, a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
    return a


def _decode(key: int) -> float:
    b = np.int64(key)
    return float(np.array([b if b >= 0 else b ^ _FLIP], np.int64).view(np.float64)[0])


def _select(comm, member, keys, gidx, targets, n_groups):
    """Collective. Per group ``g``, the ``targets[g]`` points with the smallest keys
    ``(keys[g], global index)``: (a mask over this rank's points, the cut
    coordinate per group, None where nothing or everything goes left)."""
    mine = [member == g for g in range(n_groups)]
    counts = _allsum(comm, np.array([m.sum() for m in mine]))
    big = np.iinfo(np.int64)
    lo_key = -_allsum_max(comm, [-(keys[g][mine[g]].min()) if mine[g].any() else big.min + 1
                                 for g in range(n_groups)])
    hi_key = _allsum_max(comm, [keys[g][mine[g]].max() if mine[g].any() else big.min + 1
                                for g in range(n_groups)])
    lo = [int(v) - 1 for v in lo_key]
    hi = [int(v) for v in hi_key]
    live = [0 < targets[g] < counts[g] for g in range(n_groups)]
    _bisect(comm, lo, hi, live, targets,
            lambda g, mid: int(np.count_nonzero(keys[g][mine[g]] <= mid)))
    less = _allsum(comm, np.array([np.count_nonzero(keys[g][mine[g]] < hi[g]) if live[g] else 0
                                   for g in range(n_groups)]))
    ties = [targets[g] - int(less[g]) for g in range(n_groups)]
    jlo, jhi = [-1] * n_groups, [int(gidx.max()) if len(gidx) else 0] * n_groups
    jhi = [int(v) for v in _allsum_max(comm, jhi)]
    _bisect(comm, jlo, jhi, live, ties, lambda g, mid: int(np.count_nonzero(
        mine[g] & (keys[g] == hi[g]) & (gidx <= mid))))
    left = np.zeros(len(member), bool)
    cut: list[float | None] = []
    for g in range(n_groups):
        if not live[g]:
            left |= mine[g] & (targets[g] >= counts[g])
            cut.append(None)
            continue
        left |= mine[g] & ((keys[g] < hi[g]) | ((keys[g] == hi[g]) & (gidx <= jhi[g])))
        cut.append(_decode(hi[g]))
    return left, cut


def _bisect(comm, lo, hi, live, targets, count) -> None:
    """Collective. Per live group, shrink ``(lo, hi]`` (in place) to the smallest
    ``hi`` whose global ``count`` reaches the target."""
    while True:
        active = [g for g in range(len(lo)) if live[g] and hi[g] - lo[g] > 1]
        if not active:  # the same on every rank: counts are global
            return
        mids = {g: lo[g] + (hi[g] - lo[g]) // 2 for g in active}
        c = _allsum(comm, np.array([count(g, mids[g]) for g in active]))
        for g, n in zip(active, c):
            if n >= targets[g]:
                hi[g] = mids[g]
            else:
                lo[g] = mids[g]


def _allsum_max(comm, values) -> np.ndarray:
    a = np.ascontiguousarray(values, dtype=np.int64)
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, a, op=MPI.MAX)
    return a
