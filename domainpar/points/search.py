"""Neighbour search across the blocks of sharded point sets: ``knn``,
``radius_search`` and ``gather`` (neighbour features by global index).

Query and reference points are (N, D) DomainTensors sharded on dim 0 over
the same grid axis, any layout (after ``partition`` each rank's points are
compact and the halos small; without it the answers are the same, only the
halos larger). Each rank:

1. bounds how far each query must look (its *reach*): for ``radius_search``
   the radius; for ``knn`` the distance to the k-th nearest of the rank's own
   reference points, capped by a bound from the other ranks' bounding boxes
   and counts (the nearest boxes that together hold k points), so a rank with
   few or no reference points still gets a finite reach;
2. receives the point halo: from every other rank, the reference points
   within reach of its queries, judged on a summary (its queries binned by
   cell of an 8**D grid and by octave of reach, each bin a box with its largest
   reach): one allgather of the summaries, one routed exchange of coordinates
   and global indices;
3. refines: the exact search over its own and the halo's points.

Results equal one process's: distances are ``sqrt(sum((q - p)**2))``, the
squares added over the coordinates in order, and neighbours are ordered by
squared distance, ties broken by the smaller global index of the reference
point. Indices are global (into ``ref``'s
dim 0); distances are differentiable in both point sets (the gradient of a
zero distance is zero, as ``torch.cdist``'s), through a ``Push`` of the halo's
coordinates whose adjoint returns their gradients to the owners.
"""
from __future__ import annotations

import numpy as np
import torch

from ..tensor.dispatch import UnsupportedOpError
from ..tensor.domain_tensor import DomainTensor
from .common import global_index, like_rows, offsets, point_comm, points_arg
from .route import Route, fetch, push

CHUNK = 1024   # queries per distance block (memory: a few CHUNK x candidates)
_SLACK = 1e-9  # relative margin on the reach: a halo may only be too large
CELLS = 8      # a rank's queries are summarised per cell of a CELLS**D grid (and reach octave)


def knn(query: DomainTensor, ref: DomainTensor, k: int):
    """Collective. The ``k`` nearest points of ``ref`` to every point of ``query``:
    ``(index, distance)``, two (Nq, k) DomainTensors laid out like ``query``
    (global indices into ``ref``, int64; distances ascending, ties by index)."""
    comm = _check(query, ref, "knn")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= ref.shape[0]:
        raise ValueError(f"knn: k must be an int in 1..{ref.shape[0]} (the reference points), "
                         f"got {k!r}")
    q, r = query.to_local().detach(), ref.to_local().detach()
    reach = _knn_reach(comm, q, r, ref, k)
    return _search(comm, query, ref, reach, k, None)


def knn_halo_size(query: DomainTensor, ref: DomainTensor, k: int) -> int:
    """Collective. How many reference points this rank receives from other ranks
    for ``knn(query, ref, k)`` (its point halo), found as ``knn`` finds it but
    without the search; ``domainpar bench points`` reports it."""
    comm = _check(query, ref, "knn_halo_size")
    q, r = query.to_local().detach(), ref.to_local().detach()
    route, _ = _halo(comm, q, r, _knn_reach(comm, q, r, ref, k))
    return int(route.n_recv)


def radius_search(query: DomainTensor, ref: DomainTensor, r: float, max_neighbors: int):
    """Collective. The points of ``ref`` within distance ``r`` (inclusive) of every
    point of ``query``, nearest first (ties by index), at most ``max_neighbors``:
    ``(index, distance)``, two (Nq, max_neighbors) DomainTensors laid out like
    ``query``; missing neighbours are index -1 and distance inf."""
    comm = _check(query, ref, "radius_search")
    if isinstance(max_neighbors, bool) or not isinstance(max_neighbors, int) or max_neighbors < 1:
        raise ValueError(f"radius_search: max_neighbors must be a positive int, "
                         f"got {max_neighbors!r}")
    r = float(r)
    if not r >= 0:
        raise ValueError(f"radius_search: r must be a non-negative number, got {r!r}")
    reach = np.full(query.to_local().shape[0], r * r * (1 + _SLACK))
    return _search(comm, query, ref, reach, max_neighbors, r * r)


def gather(features: DomainTensor, index: DomainTensor) -> DomainTensor:
    """Collective. ``features[index]`` for global point indices ``index`` (an
    (Nq, k) DomainTensor laid out over the same axis, e.g. from ``knn``);
    entries of -1 (missing neighbours) give zeros. Shape (Nq, k, *features[1:]),
    laid out like ``index``; differentiable in ``features`` (backward adds the
    gradients to the owners)."""
    if not isinstance(index, DomainTensor) or index.ndim != 2:
        raise UnsupportedOpError("points.gather: index must be an (Nq, k) DomainTensor of global "
                                 "point indices (from knn or radius_search)")
    points_arg(features, "points.gather", ndim=features.ndim)
    points_arg(index, "points.gather")
    fdec, idec = features.decomposition, index.decomposition
    if fdec.grid is not idec.grid or fdec.shard[0] != idec.shard[0]:
        raise UnsupportedOpError("points.gather: features and index must be sharded over the same "
                                 "grid axis")
    idx = index.to_local()
    valid = idx >= 0
    rows = fetch(features.to_local(), point_comm(fdec, 0), offsets(fdec, 0), idx.clamp(min=0))
    mask = valid.reshape(tuple(idx.shape) + (1,) * (features.ndim - 1)).to(rows.dtype)
    shape = tuple(index.shape) + tuple(features.shape[1:])
    return DomainTensor(rows * mask, like_rows(idec, 0, shape))


# -- the steps --------------------------------------------------------------------------------
def _check(query, ref, what: str):
    points_arg(query, what)
    points_arg(ref, what)
    qd, rd = query.decomposition, ref.decomposition
    if qd.grid is not rd.grid or qd.shard[0] != rd.shard[0]:
        raise UnsupportedOpError(f"{what}: query and ref must be sharded over the same grid axis")
    if query.shape[1] != ref.shape[1] or query.dtype != ref.dtype:
        raise ValueError(f"{what}: query {tuple(query.shape)} {query.dtype} and ref "
                         f"{tuple(ref.shape)} {ref.dtype} need the same dims and dtype")
    return point_comm(rd, 0)


def _box(x: torch.Tensor) -> np.ndarray:
    """(2, D) float64 bounding box of ``x``'s rows (inf, -inf when empty)."""
    if x.shape[0] == 0:
        return np.stack([np.full(x.shape[1], np.inf), np.full(x.shape[1], -np.inf)])
    a = x.to("cpu", torch.float64)
    return np.stack([a.min(0).values.numpy(), a.max(0).values.numpy()])


def _knn_reach(comm, q, r, ref, k: int) -> np.ndarray:
    """Collective. Each local query's squared reach for k neighbours: the k-th
    distance among this rank's points, capped by the box bound (the nearest
    ranks' boxes that together hold k points, at their farthest)."""
    boxes = comm.allgather((_box(r), r.shape[0]))
    if q.shape[0] == 0:
        return np.zeros(0)
    qbox = _box(q)
    far = []
    for box, n in boxes:
        if n:
            span = np.maximum(np.abs(qbox[1] - box[0]), np.abs(box[1] - qbox[0]))
            far.append((float((span ** 2).sum()), n))
    far.sort()
    bound, total = np.inf, 0
    for d2, n in far:
        total += n
        if total >= k:
            bound = d2
            break
    reach = np.full(q.shape[0], bound)
    if r.shape[0] >= k:
        local = torch.cat([_kth(q[i:i + CHUNK], r, k) for i in range(0, q.shape[0], CHUNK)])
        reach = np.minimum(reach, local.to("cpu", torch.float64).numpy())
    return reach * (1 + _SLACK)


def _kth(q, r, k):
    return torch.topk(_d2(q, r), k, dim=1, largest=False).values[:, -1]


def _d2(q, c):
    """Squared distances (nq, nc): the squared differences summed over the
    coordinates in order, one formula everywhere (selection and distances agree)."""
    qt, ct = q.detach().T.contiguous(), c.detach().T.contiguous()
    out = (qt[0][:, None] - ct[0][None, :]).square_()
    for d in range(1, q.shape[1]):
        out.add_((qt[d][:, None] - ct[d][None, :]).square_())
    return out


def _summary(q, reach: np.ndarray, cells: int = CELLS) -> list:
    """Local. This rank's queries as boxes, each with the largest squared reach
    of its queries: grouped by cell (a ``cells**D`` grid over their bounding box)
    and by octave of reach, so that the few far-reaching queries of a sparse
    region do not lend their reach to the dense cluster beside them."""
    if q.shape[0] == 0:
        return []
    x = q.detach().to("cpu", torch.float64).numpy()
    lo, hi = x.min(0), x.max(0)
    cell = np.clip(((x - lo) / np.where(hi > lo, hi - lo, 1) * cells).astype(np.int64),
                   0, cells - 1)
    flat = np.ravel_multi_index(cell.T, (cells,) * x.shape[1])
    with np.errstate(divide="ignore"):  # a reach of 0 (a duplicate point) is bucket 0
        octave = np.clip(np.floor(np.log2(reach)) + 64, 0, 127).astype(np.int64)
    key = flat * 128 + octave  # queries of one cell and one octave of reach together
    return [(x[key == c].min(0), x[key == c].max(0), float(reach[key == c].max()))
            for c in np.unique(key)]


def _halo(comm, q, r_block, reach: np.ndarray):
    """Collective. The route that sends this rank's reference points to the ranks
    whose queries reach them (one allgather of query-cell boxes and reaches), and
    the local rows it sends."""
    stories = comm.allgather(_summary(q, reach))
    me = comm.Get_rank()
    dest, items = [], []
    pts = r_block.detach().to("cpu", torch.float64).numpy()
    for s, cells in enumerate(stories):
        if s == me or not cells or len(pts) == 0:
            continue
        hit = np.zeros(len(pts), bool)
        for lo, hi, r2 in cells:
            gap = np.maximum(np.maximum(lo - pts, pts - hi), 0)
            hit |= (gap ** 2).sum(1) <= r2
        near = np.nonzero(hit)[0]
        items.append(torch.as_tensor(near, dtype=torch.int64))
        dest.append(torch.full((len(near),), s, dtype=torch.int64))
    item_t = torch.cat(items) if items else torch.zeros(0, dtype=torch.int64)
    dest_t = torch.cat(dest) if dest else torch.zeros(0, dtype=torch.int64)
    return Route(comm, dest_t, torch.zeros_like(dest_t)), item_t


def _search(comm, query, ref, reach: np.ndarray, k: int, r2):
    """Collective. The halo, then the exact search over own and halo points."""
    q, r_block, rdec = query.to_local().detach(), ref.to_local(), ref.decomposition
    route, items = _halo(comm, q, r_block, reach)
    cand = torch.cat([r_block, push(r_block[items.to(r_block.device)], route)])
    gidx = torch.cat([global_index(rdec, 0), route.send(global_index(rdec, 0)[items])])
    order = torch.argsort(gidx)
    cand, gidx = cand[order.to(cand.device)], gidx[order].to(cand.device)
    sel, valid = _nearest(q, cand.detach(), k, r2)
    idx = torch.where(valid, gidx[sel] if len(gidx) else sel, torch.full_like(sel, -1))
    # a row to index when there is no candidate, kept in the graph: every rank's
    # backward must reach the Push (a collective)
    rows = cand if cand.shape[0] else torch.cat([cand, cand.new_zeros((1, cand.shape[1]))])
    chosen = rows[sel.reshape(-1)].reshape(tuple(sel.shape) + (cand.shape[1],))
    diff = query.to_local()[:, None, :] - chosen
    d2 = diff[..., 0] ** 2
    for d in range(1, diff.shape[-1]):
        d2 = d2 + diff[..., d] ** 2
    pos = d2 > 0
    dist = torch.where(pos, torch.where(pos, d2, torch.ones_like(d2)).sqrt(), torch.zeros_like(d2))
    dist = torch.where(valid, dist, torch.full_like(dist, float("inf")))
    layout = like_rows(query.decomposition, 0, (query.shape[0], k))
    return DomainTensor(idx, layout), DomainTensor(dist, layout)


def _nearest(q, cand, k: int, r2):
    """Local. Per query: the positions of its ``k`` first candidates by squared
    distance (candidates are in global-index order, so a stable sort breaks
    ties by index), and which of them exist (within ``r2`` when given)."""
    sels, oks = [], []
    width = min(k, cand.shape[0])
    for i in range(0, q.shape[0], CHUNK):
        d2 = _d2(q[i:i + CHUNK], cand)
        if r2 is not None:
            d2 = torch.where(d2 <= r2, d2, torch.full_like(d2, float("inf")))
        vals, pos = _first(d2, width)
        pad = k - width
        sels.append(torch.nn.functional.pad(pos, (0, pad)))
        oks.append(torch.nn.functional.pad(torch.isfinite(vals), (0, pad)))
    if not sels:
        return (torch.zeros((0, k), dtype=torch.int64, device=q.device),
                torch.zeros((0, k), dtype=torch.bool, device=q.device))
    return torch.cat(sels), torch.cat(oks)


def _first(d2, width: int):
    """Local. Per row, the ``width`` smallest values of ``d2`` and their columns,
    ties by column: a topk finds each row's threshold, then only the entries at
    or below it (``width`` of them, more with ties) are sorted, stably."""
    if width == 0:
        return d2[:, :0], torch.zeros((d2.shape[0], 0), dtype=torch.int64, device=d2.device)
    thr = torch.topk(d2, width, dim=1, largest=False).values[:, -1:]
    mask = (d2 <= thr) & torch.isfinite(d2)  # inf: out of a radius search's reach
    m = max(int(mask.sum(1).max()) if d2.shape[0] else 0, width)
    rows, cols = mask.nonzero(as_tuple=True)
    slot = (mask.cumsum(1) - 1)[rows, cols]
    vals = torch.full((d2.shape[0], m), float("inf"), dtype=d2.dtype, device=d2.device)
    where = torch.zeros((d2.shape[0], m), dtype=torch.int64, device=d2.device)
    vals[rows, slot] = d2[rows, cols]
    where[rows, slot] = cols
    vals, order = torch.sort(vals, dim=1, stable=True)
    return vals[:, :width], where.gather(1, order)[:, :width]
