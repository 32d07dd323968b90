"""Rules for the index ops point models use, along a sharded (point) dim:
``index_select``, ``torch.gather``, indexing by a DomainTensor of indices,
``index_add``, ``scatter_add``, ``scatter_reduce`` and ``torch.cdist``.

Along a sharded dim, indices are global. Gathers are routed exchanges: each
rank asks the owners for the rows (or elements) its indices name and receives
them (``route.fetch``: Pull along a Route, adjoint Push). Scatters send each
value to the owner of its target, which reduces the arrivals locally with
torch's own op (Push, adjoint Pull), so ``reduce`` modes, ``include_self``,
mean counts and amax ties are torch's. Where the results go:

- gathers: laid out like the index when it is a DomainTensor sharded on the
  same dim over the same grid axis; a plain (replicated) index gives results
  in balanced blocks of its length;
- scatters: into the owners' blocks of ``input``; a plain index is cut like
  ``source``/``src`` along the dim (it names, for each of their rows, a target).

A gathered or scattered tensor may be sharded on that dim only. ``cdist``:
``x1`` sharded on any dim but the last, ``x2`` a replicated plain tensor (its
gradient summed over the ranks); a sharded ``x2`` is refused (use
``dp.points.knn`` for neighbours between two sharded sets). Nothing here
gathers a whole tensor.
"""
from __future__ import annotations

import math

import torch

from .. import autograd as ag
from ..comm.decomposition import balanced_sizes
from ..comm.errors import agree
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, op_name, register
from ..tensor.domain_tensor import DomainTensor
from ..tensor.params import enter_domain
from .common import offsets, point_axis, point_comm
from .route import fetch, fetch_route, push

T = torch.Tensor


def _dim(func, dim, ndim: int) -> int:
    dim = int(dim)
    if not -ndim <= dim < ndim:
        raise IndexError(f"{op_name(func)}: dimension {dim} out of range for {ndim} dims")
    return dim % ndim


def _requests(func, index, dec, dim: int, idim: int, rows=None):
    """This rank's part of ``index`` (its dim ``idim`` runs over requests) and the
    block sizes of the requests along the sharded ``dim`` of ``dec``: a DomainTensor
    index as it is laid out (it must be cut on ``idim`` alone, on the same axis),
    a plain one cut into ``rows`` (default balanced) blocks."""
    axis = dec.shard[dim]
    if isinstance(index, DomainTensor):
        idec = index.decomposition
        if idec.grid is not dec.grid or set(idec.shard) != {idim} or idec.shard[idim] != axis:
            raise UnsupportedOpError(
                f"{op_name(func)}: a DomainTensor index must be sharded on dim {idim} only, over "
                f"the same grid axis as the indexed tensor's dim {dim}; got "
                f"{layout.sharded_dims_text(idec)}")
        return index.to_local(), idec.block_sizes(idim)
    index = torch.as_tensor(index)
    sizes = tuple(rows) if rows is not None else balanced_sizes(index.shape[idim],
                                                                 dec.grid.dims[axis])
    start = sum(sizes[:dec.grid.coords[axis]])
    return index.narrow(idim, start, sizes[dec.grid.coords[axis]]), sizes


def _in_range(func, comm, idx: torch.Tensor, n: int, wrap: bool) -> torch.Tensor:
    """Collective. ``idx`` checked against size ``n`` on every rank (an error on
    all of them if any is out of range), negatives wrapped when ``wrap``."""
    lo = -n if wrap else 0
    bad = idx.numel() and (int(idx.min()) < lo or int(idx.max()) >= n)
    agree(comm, f"{op_name(func)}: index out of range for a dim of size {n}" if bad else None)
    if idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise IndexError(f"{op_name(func)}: indices must be an integer tensor, got {idx.dtype}")
    return idx.long() % max(n, 1) if wrap else idx.long()


def _fetch_rows(func, x: DomainTensor, dim: int, idx: torch.Tensor, wrap: bool):
    """Collective. Rows of ``x`` along its sharded ``dim`` at the global ``idx``
    (any shape): shape ``idx.shape + x's other dims (in order)``."""
    dec = x.decomposition
    comm = point_comm(dec, dim)
    idx = _in_range(func, comm, idx, dec.global_shape[dim], wrap)
    return fetch(x.to_local().movedim(dim, 0), comm, offsets(dec, dim), idx)


def _out(x: DomainTensor, dim: int, local, shape, sizes) -> DomainTensor:
    return DomainTensor(local, layout.derive(x.decomposition, shape,
                                             {dim: x.decomposition.shard[dim]}, {dim: sizes}))


# -- gathers --------------------------------------------------------------------------------------
@register(torch.index_select, T.index_select)
def index_select(func, args, kwargs):
    """Local on an unsharded dim (plain index); along a sharded dim, a routed
    exchange by global index (results laid out like a DomainTensor index, or in
    balanced blocks of a plain one). Backward sends gradients back to the owners."""
    given = dict(zip(("input", "dim", "index"), args), **kwargs)
    x, index = given["input"], given["index"]
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: the indexed tensor must be the DomainTensor")
    dim = _dim(func, given["dim"], x.ndim)
    dec = x.decomposition
    shape = list(x.shape)
    if dim not in dec.shard:
        if isinstance(index, DomainTensor):
            raise UnsupportedOpError(f"{op_name(func)}: a DomainTensor index on unsharded dim "
                                     f"{dim}; pass a plain tensor")
        index = torch.as_tensor(index)
        shape[dim] = index.numel()
        return DomainTensor(x.to_local().index_select(dim, index.to(x.device)),
                            layout.derive(dec, shape, dec.shard, layout.sharded_sizes(dec)))
    point_axis(dec, dim, op_name(func))
    idx, sizes = _requests(func, index, dec, dim, 0)
    rows = _fetch_rows(func, x, dim, idx.reshape(-1), wrap=False)
    shape[dim] = sum(sizes)
    return _out(x, dim, rows.movedim(0, dim), shape, sizes)


def getitem_routed(func, x: DomainTensor, index):
    """Collective. ``x[..., idx, ...]`` with a DomainTensor ``idx`` of integers on
    ``x``'s sharded dim (every other index a full slice): the rows at those
    global indices (negatives wrap), laid out like ``idx``'s dim 0."""
    items = list(index) if isinstance(index, tuple) else [index]
    pos = [k for k, i in enumerate(items) if isinstance(i, DomainTensor)]
    full = all(isinstance(i, slice) and i == slice(None) for k, i in enumerate(items)
               if k != pos[0]) if len(pos) == 1 else False
    dec = x.decomposition
    if not full or pos[0] not in dec.shard or items[pos[0]].is_floating_point() \
            or items[pos[0]].dtype == torch.bool:
        raise UnsupportedOpError(
            f"{op_name(func)} on a DomainTensor ({layout.sharded_dims_text(dec)}): a DomainTensor "
            f"index is supported as the only index, of integers, on the sharded dim (other "
            f"dims full slices: x[idx], x[:, idx])")
    dim = pos[0]
    point_axis(dec, dim, op_name(func))
    idx, sizes = _requests(func, items[dim], dec, dim, 0)
    rows = _fetch_rows(func, x, dim, idx, wrap=True)
    k = idx.ndim
    rows = rows.movedim(tuple(range(k)), tuple(range(dim, dim + k)))
    shape = list(x.shape[:dim]) + list(items[dim].shape) + list(x.shape[dim + 1:])
    return _out(x, dim, rows, shape, sizes)


def _element_ids(idx_m: torch.Tensor, rest) -> torch.Tensor:
    """Flat element ids ``row * R + col`` of an index laid out (rows, *irest)
    into a tensor laid out (rows, *rest), ``R = prod(rest)``."""
    col = torch.zeros(idx_m.shape[1:], dtype=torch.int64)
    stride = 1
    for j in reversed(range(len(rest))):
        shape = [1] * len(rest)
        shape[j] = idx_m.shape[1 + j]
        col = col + torch.arange(idx_m.shape[1 + j]).reshape(shape) * stride
        stride *= rest[j]
    return idx_m.long() * math.prod(rest) + col.to(idx_m.device)


@register(torch.gather, T.gather)
def gather(func, args, kwargs):
    """Local on an unsharded dim; along a sharded dim, a routed exchange of the
    elements named by global indices (results laid out like a DomainTensor index,
    or balanced blocks of a plain one). Backward adds gradients at the owners."""
    given = dict(zip(("input", "dim", "index"), args), **kwargs)
    x, index = given["input"], given["index"]
    if given.get("sparse_grad") or not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: needs the DomainTensor as input and no "
                                 f"sparse_grad")
    dim = _dim(func, given["dim"], x.ndim)
    dec = x.decomposition
    if dim not in dec.shard and not isinstance(index, DomainTensor):
        index = torch.as_tensor(index).to(x.device)
        if dec.shard:  # only the unsharded dims may differ in size from the index
            raise UnsupportedOpError(f"{op_name(func)} along unsharded dim {dim} of a DomainTensor "
                                     f"sharded on {layout.sharded_dims_text(dec)} is not supported")
        return DomainTensor(torch.gather(x.to_local(), dim, index),
                            layout.derive(dec, index.shape, {}))
    point_axis(dec, dim, op_name(func))
    idx, sizes = _requests(func, index, dec, dim, dim)
    comm = point_comm(dec, dim)
    n, rest = dec.global_shape[dim], tuple(x.to_local().movedim(dim, 0).shape[1:])
    idx_m = _in_range(func, comm, idx, n, wrap=False).movedim(dim, 0)
    ids = _element_ids(idx_m, rest)
    flat = x.to_local().movedim(dim, 0).reshape(-1)
    vals = fetch(flat, comm, offsets(dec, dim) * math.prod(rest), ids)
    return _out(x, dim, vals.movedim(0, dim), tuple(index.shape), sizes)


# -- scatters to the owners -----------------------------------------------------------------------
def _source_block(func, src, dec, dim: int):
    """``src``'s block and its block sizes along ``dim`` (sharded like ``dec``'s)."""
    if not isinstance(src, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: the source must be a DomainTensor sharded "
                                 f"on dim {dim} (a plain source would be added by every rank)")
    sdec = src.decomposition
    if sdec.grid is not dec.grid or set(sdec.shard) != {dim} or sdec.shard[dim] != dec.shard[dim]:
        raise UnsupportedOpError(f"{op_name(func)}: the source must be sharded on dim {dim} only, "
                                 f"over the same grid axis as the target; got "
                                 f"{layout.sharded_dims_text(sdec)}")
    return src.to_local(), sdec.block_sizes(dim)


def _aligned(func, index, dec, dim: int, idim: int, sizes):
    """The index's block for the source rows ``sizes`` (repartitioned if needed)."""
    if isinstance(index, DomainTensor) and index.decomposition.block_sizes(idim) != tuple(sizes):
        idec = index.decomposition
        dst = layout.derive(idec, idec.global_shape, idec.shard, {idim: tuple(sizes)})
        index = DomainTensor(ag.repartition(index.to_local(), idec, dst), dst)
    idx, got = _requests(func, index, dec, dim, idim, rows=sizes)
    if tuple(got) != tuple(sizes):
        raise UnsupportedOpError(f"{op_name(func)}: index and source disagree along dim {dim}")
    return idx


def _target(func, args, kwargs, names):
    given = dict(zip(names, args), **kwargs)
    x = given["input"]
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: the target must be the DomainTensor")
    dim = _dim(func, given["dim"], x.ndim)
    point_axis(x.decomposition, dim, op_name(func))
    return given, x, dim


def _finish(func, x: DomainTensor, out_local: torch.Tensor) -> DomainTensor:
    if op_name(func).endswith("_"):  # in place: the block takes the result
        x.to_local().copy_(out_local)
        return x
    return DomainTensor(out_local, x.decomposition)


@register(torch.index_add, T.index_add, T.index_add_)
def index_add(func, args, kwargs):
    """Collective (a routed exchange): each row of ``source`` is sent to the owner
    of its target row along the sharded dim, which adds the arrivals (times
    ``alpha``) into its block. Backward gathers the gradients back (its adjoint)."""
    given, x, dim = _target(func, args, kwargs, ("input", "dim", "index", "source"))
    dec = x.decomposition
    src, sizes = _source_block(func, given["source"], dec, dim)
    idx = _aligned(func, given["index"], dec, dim, 0, sizes).reshape(-1)
    comm = point_comm(dec, dim)
    idx = _in_range(func, comm, idx, dec.global_shape[dim], wrap=False)
    route = fetch_route(comm, offsets(dec, dim), idx)
    arrivals = push(src.movedim(dim, 0), route)
    xm = x.to_local().movedim(dim, 0)
    out = xm.index_add(0, route.recv_local.to(xm.device), arrivals, alpha=given.get("alpha", 1))
    return _finish(func, x, out.movedim(0, dim))


_SCATTERS = (torch.scatter_add, T.scatter_add, T.scatter_add_,
             torch.scatter_reduce, T.scatter_reduce, T.scatter_reduce_)


@register(*_SCATTERS)
def scatter_reduce(func, args, kwargs):
    """Collective (a routed exchange of elements): each element of ``src`` goes to
    the owner of its target along the sharded dim, which reduces the arrivals
    with torch's scatter_add / scatter_reduce (every ``reduce`` and
    ``include_self``). Backward: torch's local backward, then the adjoint exchange."""
    names = ("input", "dim", "index", "src", "reduce")
    given, x, dim = _target(func, args, kwargs, names)
    dec = x.decomposition
    src, sizes = _source_block(func, given["src"], dec, dim)
    idx = _aligned(func, given["index"], dec, dim, dim, sizes)
    comm = point_comm(dec, dim)
    idx_m = _in_range(func, comm, idx, dec.global_shape[dim], wrap=False).movedim(dim, 0)
    xm = x.to_local().movedim(dim, 0)
    rest = tuple(xm.shape[1:])
    route = fetch_route(comm, offsets(dec, dim) * math.prod(rest), _element_ids(idx_m, rest))
    part = src.movedim(dim, 0)[tuple(slice(0, s) for s in idx_m.shape)]
    arrivals = push(part.reshape(-1), route)
    at, flat = route.recv_local.to(xm.device), xm.reshape(-1)
    if "reduce" in given:
        out = flat.scatter_reduce(0, at, arrivals, given["reduce"],
                                  include_self=given.get("include_self", True))
    else:
        out = flat.scatter_add(0, at, arrivals)
    return _finish(func, x, out.reshape(xm.shape).movedim(0, dim))


# -- distances to a replicated set ----------------------------------------------------------------
@register(torch.cdist)
def cdist(func, args, kwargs):
    """Local: ``x1`` (a DomainTensor sharded on any dim but the last) against a
    replicated plain ``x2``; the output is sharded like ``x1``. ``x2``'s gradient
    is summed over the ranks (a broadcast's adjoint). Refused: x2's batch dims
    broadcasting x1's."""
    given = dict(zip(("x1", "x2", "p", "compute_mode"), args), **kwargs)
    x1, x2 = given.pop("x1"), given.pop("x2")
    if not isinstance(x1, DomainTensor) or isinstance(x2, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: supported with x1 a DomainTensor and x2 a "
                                 f"replicated plain tensor; for neighbours between two sharded "
                                 f"point sets use dp.points.knn or dp.points.radius_search")
    dec = x1.decomposition
    if x1.ndim - 1 in dec.shard:
        raise UnsupportedOpError(f"{op_name(func)}: x1 is sharded on its last (coordinate) dim")
    batch = tuple(torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2]))
    if batch != tuple(x1.shape[:-2]):
        # x2's batch dims would broadcast x1's: the output is not laid out like x1
        raise UnsupportedOpError(f"{op_name(func)}: x2's batch dims {tuple(x2.shape[:-2])} "
                                 f"broadcast x1's {tuple(x1.shape[:-2])}; expand x1 to "
                                 f"{batch} first")
    shape = tuple(x1.shape[:-1]) + (x2.shape[-2],)
    out_dec = layout.derive(dec, shape, dec.shard, layout.sharded_sizes(dec))
    lead = x1.ndim - x2.ndim
    sliced = {d - lead: d for d in dec.shard if d < x1.ndim - 2 and d >= lead
              and x2.shape[d - lead] == x1.shape[d] and x1.shape[d] > 1}
    local2 = enter_domain(x2, out_dec, sliced)
    return DomainTensor(torch.cdist(x1.to_local(), local2, **given), out_dec)
