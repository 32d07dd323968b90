"""Indexing and re-arranging ops: cat/stack, basic indexing and assignment,
narrow/select, flip, roll.

Slicing a sharded dim needs no message: each rank keeps the intersection of
its block with the slice, and the output layout (uneven, possibly empty
blocks) is derived from every coordinate's block offsets, so every rank knows
it without talking. What does need messages:

- an int index on a sharded dim (one rank holds the element): a repartition to
  a layout where the dim is not cut, then the dim is dropped;
- cat along a sharded dim (and roll, built from it): every input is
  repartitioned onto the pieces of the output blocks it covers, so the local
  cat of the pieces is this rank's output block;
- flip along a sharded dim: block ``c`` flipped belongs to coordinate
  ``P-1-c``: a mirror exchange along the axis (``autograd.mirror``). The
  output's block sizes along that dim are the input's, reversed.

Advanced indexing (index tensors, masks) is local on unsharded dims. On a
sharded dim, a DomainTensor of global indices (``x[idx]``) is a routed exchange
(``domainpar.points.rules``, which also holds index_select, gather, index_add,
scatter_add/scatter_reduce and cdist); plain index tensors and masks are refused
there (their results would have no layout to go to). Nothing here gathers a
whole tensor.

(Over 500 lines on purpose: one family of the op table whose rules share the
slice arithmetic (``_slice_sizes``, ``_basic_plan``, ``_expand_index``) that
getitem, setitem, narrow, select, split and cat all build on.)
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from ..tensor import layout
from ..tensor.deferred import Deferred
from ..tensor.dispatch import TAKES_DEFERRED, UnsupportedOpError, op_name, register, same_grid
from ..tensor.domain_tensor import DomainTensor
from ..tensor.params import enter_domain
from .common import onto

T = torch.Tensor


# -- slices of a sharded dim ---------------------------------------------------------------------
def _slice_sizes(dec: Decomposition, dim: int, start: int, stop: int, step: int):
    """Per coordinate of ``dim``'s axis: (number of slice elements in that block,
    local start of the first one). ``start:stop:step`` is normalised (step > 0)."""
    offs = dec.block_offsets(dim)
    out = []
    for c in range(len(offs) - 1):
        lo, hi = max(offs[c], start), min(offs[c + 1], stop)
        k_lo = -(-(lo - start) // step)  # first k with start + k*step >= lo
        k_hi = -(-(hi - start) // step) if hi > start else 0
        n = max(0, k_hi - k_lo)
        out.append((n, start + k_lo * step - offs[c]))
    return out


def _norm_slice(s: slice, n: int, func) -> tuple[int, int, int]:
    start, stop, step = s.indices(n)
    if step <= 0:
        raise ValueError(f"{op_name(func)}: step must be greater than zero")
    return start, max(start, stop), step


def slice_dim(local: torch.Tensor, dec: Decomposition, dim: int, start: int, stop: int,
              step: int) -> tuple[torch.Tensor, Decomposition]:
    """Local. Global ``start:stop:step`` along ``dim`` (normalised) of a block."""
    shape = list(dec.global_shape)
    shape[dim] = len(range(start, stop, step))
    if dim not in dec.shard:
        out = local.narrow(dim, start, stop - start) if step == 1 else \
            local[(slice(None),) * dim + (slice(start, stop, step),)]
        return out, layout.remap(dec, shape, {d: d for d in dec.shard})
    per = _slice_sizes(dec, dim, start, stop, step)
    n, lo = per[dec.grid.coords[dec.shard[dim]]]
    out = local[(slice(None),) * dim + (slice(lo, lo + (n - 1) * step + 1 if n else lo, step),)]
    sizes = {d: dec.block_sizes(d) for d in dec.shard}
    sizes[dim] = tuple(p[0] for p in per)
    return out, layout.derive(dec, shape, dec.shard, sizes)


def _unshard_and_drop(local, dec: Decomposition, dims: Sequence[int]):
    """Collective when a dim in ``dims`` is sharded. Size-1 ``dims`` made whole
    (repartition onto a layout that does not cut them) and squeezed away."""
    cut = [d for d in dims if d in dec.shard]
    if cut:
        dst = layout.unsharded(dec, cut)
        local, dec = ag.repartition(local, dec, dst), dst
    keep = [d for d in range(dec.ndim) if d not in set(dims)]
    for d in sorted(dims, reverse=True):
        local = local.squeeze(d)
    shape = [dec.global_shape[d] for d in keep]
    return local, layout.remap(dec, shape, {d: keep.index(d) for d in dec.shard})


# -- cat / stack ----------------------------------------------------------------------------------
def _onto_piece(a, piece: Decomposition):
    """Input ``a`` (DomainTensor or replicated plain tensor) as this rank's part of
    the layout ``piece`` (same global shape as ``a``)."""
    if isinstance(a, DomainTensor):
        return ag.repartition(a._local, a._dec, piece)
    return enter_domain(a, piece, {d: d for d in piece.shard})


def _cat(func, tensors, dim: int, lead: Decomposition, out_sizes=None):
    """Collective when layouts differ or ``dim`` is sharded. The local cat of the
    inputs brought onto ``lead``'s sharding; along a sharded ``dim`` each input
    is cut to the part of every output block it covers (output sizes ``out_sizes``,
    balanced by default)."""
    ndim = lead.ndim
    for t in tensors:
        if t.ndim != ndim or any(t.shape[d] != lead.global_shape[d]
                                 for d in range(ndim) if d != dim):
            raise RuntimeError(f"{op_name(func)}: sizes of tensors must match except in "
                               f"dimension {dim}: got {[tuple(x.shape) for x in tensors]}")
    out_shape = list(lead.global_shape)
    out_shape[dim] = sum(t.shape[dim] for t in tensors)
    sizes = {d: lead.block_sizes(d) for d in lead.shard}
    if dim in lead.shard:
        if out_sizes is not None:
            sizes[dim] = tuple(out_sizes)
        else:
            from ..comm.decomposition import balanced_sizes
            sizes[dim] = balanced_sizes(out_shape[dim], lead.grid.dims[lead.shard[dim]])
        out_offs = [0]
        for s in sizes[dim]:
            out_offs.append(out_offs[-1] + s)
    locals_, base = [], 0
    for t in tensors:
        piece_sizes = dict(sizes)
        if dim in lead.shard:
            n = t.shape[dim]
            piece_sizes[dim] = tuple(max(0, min(out_offs[c + 1], base + n) - max(out_offs[c], base))
                                     for c in range(len(sizes[dim])))
            base += n
        piece = layout.derive(lead, tuple(t.shape), lead.shard, piece_sizes)
        locals_.append(_onto_piece(t, piece))
    out_dec = layout.derive(lead, out_shape, lead.shard, sizes)
    return torch.cat(locals_, dim), out_dec


def _tensors_arg(func, args, kwargs, names=("tensors",)):
    tensors = args[0] if args else kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise UnsupportedOpError(f"{op_name(func)}: expected a non-empty sequence of tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    if kwargs.get("out") is not None:
        raise UnsupportedOpError(f"{op_name(func)}: out= is not supported on DomainTensors")
    dts = [t for t in tensors if isinstance(t, DomainTensor)]
    same_grid(func, dts)
    return list(tensors), int(dim), dts[0]


def _ndim_dim(func, dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"{op_name(func)}: dimension {dim} out of range for {ndim} dims")
    return dim % ndim


@register(torch.cat, torch.concat, torch.concatenate)
def cat(func, args, kwargs):
    """Collective when layouts differ or the cat dim is sharded (repartitions).
    The output is sharded like the first DomainTensor input."""
    tensors, dim, lead = _tensors_arg(func, args, kwargs)
    # torch.cat skips legacy empty 1-D tensors
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0 and lead.ndim != 1)]
    dim = _ndim_dim(func, dim, lead.ndim)
    local, dec = _cat(func, tensors, dim, lead._dec)
    return DomainTensor(local, dec)


@register(torch.stack)
def stack(func, args, kwargs):
    """Collective when layouts differ (repartitions onto the first DomainTensor's
    layout). The new dim is not sharded; sharded dims after it shift by one."""
    tensors, dim, lead = _tensors_arg(func, args, kwargs)
    dim = _ndim_dim(func, dim, lead.ndim + 1)
    for t in tensors:
        if tuple(t.shape) != lead._dec.global_shape:
            raise RuntimeError(f"{op_name(func)}: stack expects each tensor to be equal size, "
                               f"got {[tuple(x.shape) for x in tensors]}")
    src = lead._dec
    locals_ = [_onto_piece(t, src) for t in tensors]
    shape = list(src.global_shape)
    shape.insert(dim, len(tensors))
    out_dec = layout.remap(src, shape, {d: d + (d >= dim) for d in src.shard})
    return DomainTensor(torch.stack(locals_, dim), out_dec)


# -- indexing -------------------------------------------------------------------------------------
def _expand_index(func, index, ndim: int) -> list:
    """``index`` as a list with Ellipsis expanded (None kept)."""
    items = list(index) if isinstance(index, tuple) else [index]
    consumed = 0
    for i in items:
        if i is None or i is Ellipsis:
            continue
        if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
            consumed += max(i.ndim, 1)
        else:
            consumed += 1
    ellipses = [k for k, i in enumerate(items) if i is Ellipsis]
    if len(ellipses) > 1:
        raise IndexError(f"{op_name(func)}: an index can only have a single ellipsis ('...')")
    if consumed > ndim:
        raise IndexError(f"{op_name(func)}: too many indices for tensor of dimension {ndim}")
    if ellipses:
        items[ellipses[0]:ellipses[0] + 1] = [slice(None)] * (ndim - consumed)
    else:
        items += [slice(None)] * (ndim - consumed)
    return items


def slices_of(func, index, shape: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """Local. ``index`` into a tensor of global ``shape`` as one normalised
    ``(start, stop, step)`` per dim, when it holds only slices and Ellipses
    (checked as torch checks them); else None."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice) or i is Ellipsis for i in items):
        return None
    return [_norm_slice(it, n, func) for it, n in zip(_expand_index(func, index, len(shape)),
                                                       shape)]


def _int(i) -> int | None:
    """``i`` as an int index (Python or numpy int, 0-d integer tensor), else None."""
    if isinstance(i, bool):
        return None
    if isinstance(i, int):
        return i
    if not isinstance(i, (torch.Tensor, slice, list, tuple)) and i is not None \
            and i is not Ellipsis and hasattr(i, "__index__"):
        return operator.index(i)
    if isinstance(i, torch.Tensor) and i.ndim == 0 and not i.is_floating_point() \
            and i.dtype != torch.bool and not isinstance(i, DomainTensor):
        return int(i)
    return None


def _basic_plan(func, x: DomainTensor, index):
    """Walk a basic index (ints, slices, None, Ellipsis, and at most one advanced
    index on an unsharded dim). Returns the local result and its decomposition,
    plus the output dims that came from ints on sharded dims (still size 1)."""
    dec = x._dec
    items = _expand_index(func, index, dec.ndim)
    advanced = [i for i in items if i is not None and _int(i) is None and not isinstance(i, slice)]
    local, cur = x._local, dec
    d = 0          # current dim in (local, cur)
    drop: list[int] = []
    squeeze_int: list[int] = []
    adv_seen = False
    for it in items:
        if it is None:
            local = local.unsqueeze(d)
            shape = list(cur.global_shape)
            shape.insert(d, 1)
            cur = layout.remap(cur, shape, {k: k + (k >= d) for k in cur.shard})
            d += 1
            continue
        n = cur.global_shape[d]
        i = _int(it)
        if i is not None:
            if not -n <= i < n:
                raise IndexError(f"{op_name(func)}: index {i} is out of bounds for dimension "
                                 f"{d} with size {n}")
            i %= n
            local, cur = slice_dim(local, cur, d, i, i + 1, 1)
            (squeeze_int if d in cur.shard else drop).append(d)
            d += 1
        elif isinstance(it, slice):
            local, cur = slice_dim(local, cur, d, *_norm_slice(it, n, func))
            d += 1
        else:
            if isinstance(it, DomainTensor):
                raise UnsupportedOpError(f"{op_name(func)}: indexing with a DomainTensor index "
                                         f"is not supported; {layout.sharded_dims_text(dec)}")
            idx = torch.as_tensor(it)
            if idx.dtype == torch.bool and idx.ndim == 0:
                raise UnsupportedOpError(f"{op_name(func)}: a 0-d bool index on a DomainTensor "
                                         f"is not supported")
            span = max(idx.ndim, 1) if idx.dtype == torch.bool else 1
            hit = [k for k in range(d, d + span) if k in cur.shard]
            if hit or len(advanced) > 1 or adv_seen or (idx.dtype == torch.bool and idx.ndim > 1):
                why = (f"advanced indexing (index tensors or masks) on sharded dims {hit}"
                       if hit else "more than one advanced index (or a multi-dim mask)")
                raise UnsupportedOpError(
                    f"{op_name(func)} on a DomainTensor ({layout.sharded_dims_text(dec)}): {why} "
                    f"is not supported; slice with ints and slices instead, or index the "
                    f"unsharded dims")
            adv_seen = True
            if idx.dtype == torch.bool:
                idx = idx.reshape(-1).nonzero().squeeze(1)
            idx = idx.to(local.device)
            if not idx.is_floating_point() and idx.numel() and (
                    int(idx.max()) >= n or int(idx.min()) < -n):
                raise IndexError(f"{op_name(func)}: index out of bounds for dimension {d} "
                                 f"with size {n}")
            local = local[(slice(None),) * d + (idx,)]
            k = idx.ndim
            shape = list(cur.global_shape[:d]) + list(idx.shape) + list(cur.global_shape[d + 1:])
            cur = layout.remap(cur, shape, {s: s + (k - 1) * (s > d) for s in cur.shard})
            d += k
    return local, cur, drop, squeeze_int


@register(T.__getitem__)
def getitem(func, args, kwargs):
    """Local for slices, None, Ellipsis and ints on unsharded dims; an int on a
    sharded dim costs a repartition (the one owner's slab made whole). Index
    tensors and masks are local on unsharded dims; on a sharded dim a DomainTensor
    of global indices is a routed exchange (``points.rules``), others are refused.
    A Deferred (``tensor/deferred.py``) is asked for ``narrowed(index)`` first."""
    x, index = args[0], args[1]
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: indexing a plain tensor with a DomainTensor "
                                 f"is not supported")
    if any(isinstance(i, DomainTensor) for i in (index if isinstance(index, tuple) else (index,))):
        from ..points.rules import getitem_routed  # global indices: a routed exchange
        return getitem_routed(func, x, index)
    if isinstance(x, Deferred):  # a slice of a spectrum in transit (ops/fft.py) ...
        taken = x.narrowed(index)
        if taken is not None:
            return taken
    key = _slicing_key(x, index)
    plan = None if key is None else layout.planned(key, lambda: _slicing_plan(func, x, index))
    if plan is not None:  # slices, None, Ellipsis, ints on whole dims: one local index
        return DomainTensor(x._local[plan[0]], plan[1])
    local, dec, drop, squeeze_int = _basic_plan(func, x, index)
    local, dec = _unshard_and_drop(local, dec, sorted(drop + squeeze_int))
    return DomainTensor(local, dec)


TAKES_DEFERRED.add(T.__getitem__)


def _slicing_key(x: DomainTensor, index):
    """Local. The plan key of a basic index made of slices (int or None fields),
    None, Ellipsis and Python ints; None for any other index (no plan)."""
    items = index if isinstance(index, tuple) else (index,)
    key: list = []
    for i in items:
        if isinstance(i, slice):
            fields = (i.start, i.stop, i.step)
            if not all(f is None or type(f) is int for f in fields):
                return None
            key.append(fields)
        elif i is None or i is Ellipsis or type(i) is int:
            key.append(i)
        else:
            return None
    return ("getitem", x._dec, tuple(key))


def _slicing_plan(func, x: DomainTensor, index):
    """Local. (this rank's index into its block, the output layout) of a basic
    index (``_slicing_key``) that needs no message: the walk of ``_basic_plan``
    done once, its result read back as one index of the block. None where an int
    lands on a sharded dim (a repartition: the general path)."""
    local, dec, drop, squeeze_int = _basic_plan(func, x, index)
    if squeeze_int:
        return None
    local, dec = _unshard_and_drop(local, dec, sorted(drop))
    src, d = x._dec, 0  # d: the dim of the block that the next item reads
    mine: list[int | slice | None] = []
    for it in _expand_index(func, index, src.ndim):
        if it is None:  # a new dim: reads none of the block's
            mine.append(None)
            continue
        if type(it) is int:  # on a whole dim (``_basic_plan`` checked its bounds)
            mine.append(it % src.global_shape[d])
            d += 1
            continue
        start, stop, step = _norm_slice(it, src.global_shape[d], func)
        if d in src.shard:
            n, lo = _slice_sizes(src, d, start, stop, step)[src.grid.coords[src.shard[d]]]
            start, stop = lo, lo + (n - 1) * step + 1 if n else lo
        mine.append(slice(start, stop, step))
        d += 1
    if tuple(x._local[tuple(mine)].shape) != tuple(local.shape):  # the walk's own result
        return None
    return tuple(mine), dec


@register(T.narrow, torch.narrow)
def narrow(func, args, kwargs):
    """Local: a slice (see ``getitem``)."""
    names = ("input", "dim", "start", "length")
    given = dict(zip(names, args), **kwargs)
    x = given["input"]
    dim = _ndim_dim(func, int(given["dim"]), x.ndim)
    start, length = int(given["start"]), int(given["length"])
    n = x.shape[dim]
    if start < 0:
        start += n
    if not (0 <= start <= n and 0 <= length and start + length <= n):
        raise IndexError(f"{op_name(func)}: start ({start}) + length ({length}) exceeds "
                         f"dimension size ({n})")
    local, dec = slice_dim(x._local, x._dec, dim, start, start + length, 1)
    return DomainTensor(local, dec)


@register(T.select, torch.select)
def select(func, args, kwargs):
    """Local on an unsharded dim, a repartition on a sharded one (see ``getitem``)."""
    names = ("input", "dim", "index")
    given = dict(zip(names, args), **kwargs)
    x = given["input"]
    dim = _ndim_dim(func, int(given["dim"]), x.ndim)
    return getitem(T.__getitem__, (x, (slice(None),) * dim + (int(given["index"]),)), {})


_SPLITS = (torch.split, T.split, torch.chunk, T.chunk, torch.tensor_split, T.tensor_split,
           T.split_with_sizes, torch.split_with_sizes)


@register(*_SPLITS)
def split(func, args, kwargs):
    """Local: pieces are slices (see ``narrow``). split, chunk, tensor_split,
    split_with_sizes: every form torch takes; piece sizes are torch's own."""
    x = args[0]
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: only the tensor being split may be a "
                                 f"DomainTensor")
    # torch itself, on a meta tensor of the global shape, validates the arguments
    # and cuts the pieces; each piece is then a slice of the DomainTensor.
    meta = torch.empty(x.shape, device="meta")
    pieces = func(meta, *args[1:], **kwargs)
    dim = _ndim_dim(func, int(kwargs.get("dim", args[2] if len(args) > 2 else 0)), x.ndim)
    out, start = [], 0
    for p in pieces:
        n = p.shape[dim]
        local, dec = slice_dim(x._local, x._dec, dim, start, start + n, 1)
        out.append(DomainTensor(local, dec))
        start += n
    return tuple(out)


@register(torch.unbind, T.unbind)
def unbind(func, args, kwargs):
    """Local on an unsharded dim; one repartition per slice on a sharded one (see
    ``select``)."""
    x = args[0]
    dim = _ndim_dim(func, int(kwargs.get("dim", args[1] if len(args) > 1 else 0)), x.ndim)
    return tuple(select(T.select, (x, dim, i), {}) for i in range(x.shape[dim]))


@register(T.__setitem__)
def setitem(func, args, kwargs):
    """Local in the forward (a repartition when ``value`` is a DomainTensor laid
    out otherwise). Basic indices only: each rank writes the part of the selected
    region its block holds; ``value`` broadcasts against the region. A bool mask
    DomainTensor (or plain tensor) of the full shape with a scalar value works too."""
    x, index, value = args[0], args[1], args[2]
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(_plain_target_text(func, value))
    if isinstance(index, torch.Tensor) and index.dtype == torch.bool and \
            tuple(index.shape) == x._dec.global_shape:
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise UnsupportedOpError(f"{op_name(func)}: a mask assignment needs a scalar value")
        mask = onto(index, x._dec)
        v = value.detach().reshape(()) if isinstance(value, torch.Tensor) else value
        x._local.masked_fill_(mask, v)
        return None
    items = _expand_index(func, index, x.ndim)
    if any(not (i is None or isinstance(i, slice) or _int(i) is not None) for i in items):
        raise UnsupportedOpError(
            f"{op_name(func)} on a DomainTensor ({layout.sharded_dims_text(x._dec)}): only "
            f"ints, slices, None and Ellipsis (or a full-shape bool mask with a scalar) are "
            f"supported in assignment")
    # Ints on sharded dims become size-1 slices, so that the region keeps the dim
    # (blocks of 0 or 1) and the value is cut along it like any other dim.
    region_index: list[Any] = []
    unit_pos: list[int] = []
    d = out_d = 0
    for it in items:
        i = _int(it)
        if it is None:
            region_index.append(it)
            out_d += 1
            continue
        if i is not None and d in x._dec.shard:
            n = x.shape[d]
            if not -n <= i < n:
                raise IndexError(f"{op_name(func)}: index {i} is out of bounds for dimension "
                                 f"{d} with size {n}")
            region_index.append(slice(i % n, i % n + 1))
            unit_pos.append(out_d)
            out_d += 1
        else:
            region_index.append(it)
            out_d += 0 if i is not None else 1
        d += 1
    probe = DomainTensor(x._local.detach(), x._dec)
    _, rdec, drop, _ = _basic_plan(func, probe, tuple(region_index))
    rdec = _drop_dims_dec(rdec, drop)  # ints on unsharded dims: local
    if isinstance(value, torch.Tensor):
        nominal = [n for k, n in enumerate(rdec.global_shape) if k not in unit_pos]
        if value.ndim > len(nominal) or \
                tuple(torch.broadcast_shapes(tuple(value.shape), tuple(nominal))) != tuple(nominal):
            raise RuntimeError(f"{op_name(func)}: shape mismatch: value tensor of shape "
                               f"{list(value.shape)} cannot be broadcast to indexing result of "
                               f"shape {nominal}")
        v = _insert_unit_dims(value, unit_pos, len(nominal))
        value = onto(v, rdec)
    x._local[_local_region_index(x._dec, tuple(region_index), func)] = value
    return None


def _plain_target_text(func, value) -> str:
    """Why a DomainTensor cannot be written into a plain tensor, and the fix."""
    if not isinstance(value, DomainTensor):
        return (f"{op_name(func)}: assigning into a plain tensor indexed by a DomainTensor is "
                f"not supported; index it with plain tensors")
    return (f"{op_name(func)}: writing a DomainTensor ({layout.sharded_dims_text(value._dec)}) "
            f"into a plain tensor is not supported: a plain "
            f"tensor cannot become sharded in place, and filling it whole would gather the "
            f"whole tensor on every rank. Allocate the buffer from the DomainTensor instead, "
            f"e.g. out = x_ft.new_zeros(shape, dtype=...) (also new_empty, new_ones, "
            f"new_full, zeros_like): it is then sharded like x_ft and the write stays local. "
            f"Inside DomainParallel or `with domainpar.sharded_factories():` a buffer made by "
            f"torch.zeros (and the like) takes its layout from the first DomainTensor written "
            f"into it, unless it was used as a plain tensor before")


def _drop_dims_dec(dec: Decomposition, drop):
    keep = [d for d in range(dec.ndim) if d not in set(drop)]
    shape = [dec.global_shape[d] for d in keep]
    return layout.remap(dec, shape, {d: keep.index(d) for d in dec.shard})


def _insert_unit_dims(v: torch.Tensor, positions, ndim_nominal: int):
    """``v`` padded with leading unit dims to ``ndim_nominal`` dims, then with unit
    dims inserted at ``positions`` (a DomainTensor keeps its sharding)."""
    local, dec = (v._local, v._dec) if isinstance(v, DomainTensor) else (v, None)
    lead = ndim_nominal - v.ndim
    local = local.reshape((1,) * lead + tuple(local.shape))
    shape = [1] * lead + list(v.shape)
    shard = {k + lead: a for k, a in dec.shard.items()} if dec is not None else {}
    for p in positions:
        local = local.unsqueeze(p)
        shape.insert(p, 1)
        shard = {k + (k >= p): a for k, a in shard.items()}
    if dec is None:
        return local
    sizes = {k: dec.block_sizes(k0) for k0, k in
             zip(sorted(dec.shard), sorted(shard))}
    return DomainTensor(local, layout.derive(dec, shape, shard, sizes))


def _local_region_index(dec: Decomposition, index, func):
    """The index into this rank's block that addresses its part of the region."""
    items = _expand_index(func, index, dec.ndim)
    out: list[int | slice | None] = []
    d = 0
    for it in items:
        if it is None:
            out.append(None)
            continue
        n = dec.global_shape[d]
        i = _int(it)
        if i is not None:
            out.append(i % n)  # only on unsharded dims (sharded ones became slices)
        else:
            start, stop, step = _norm_slice(it, n, func)
            if d in dec.shard:
                num, lo = _slice_sizes(dec, d, start, stop, step)[dec.grid.coords[dec.shard[d]]]
                out.append(slice(lo, lo + (num - 1) * step + 1 if num else lo, step))
            else:
                out.append(slice(start, stop, step))
        d += 1
    return tuple(out)


# -- flip and roll --------------------------------------------------------------------------------
@register(torch.flip, T.flip, torch.fliplr, torch.flipud, T.fliplr, T.flipud)
def flip(func, args, kwargs):
    """Local along unsharded dims; along a sharded dim a mirror exchange between
    coordinates c and P-1-c of its grid axis (the output's block sizes there are
    the input's, reversed)."""
    x = args[0]
    name = getattr(func, "__name__", "flip")
    dims: Sequence[int]
    if name == "fliplr":
        dims = (1,)
    elif name == "flipud":
        dims = (0,)
    else:
        dims = args[1:] if len(args) > 1 else kwargs.get("dims")
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
    dims = sorted({_ndim_dim(func, int(d), x.ndim) for d in dims})
    local, dec = x._local, x._dec
    if dims:
        local = local.flip(dims)
    sizes = {d: dec.block_sizes(d) for d in dec.shard}
    for d in dims:
        if d in dec.shard:
            sizes[d] = tuple(reversed(sizes[d]))
            out = layout.derive(dec, dec.global_shape, dec.shard, sizes)
            local = ag.mirror(local, dec.grid.axis_comm(dec.shard[d]), out.local_shape())
            dec = out
    return DomainTensor(local, dec)


@register(torch.roll, T.roll)
def roll(func, args, kwargs):
    """Local along unsharded dims; along a sharded dim the two slices of the roll
    are cat'ed back onto the input's layout (repartitions, no gather)."""
    names = ("input", "shifts", "dims")
    given = dict(zip(names, args), **kwargs)
    x, shifts, dims = given["input"], given["shifts"], given.get("dims")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        if x._dec.shard:
            raise UnsupportedOpError(
                f"{op_name(func)} without dims (a roll of the flattened tensor) on a DomainTensor "
                f"sharded on {layout.sharded_dims_text(x._dec)} is not supported; give dims")
        return DomainTensor(torch.roll(x._local, shifts), x._dec)
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if len(shifts) != len(dims):
        raise RuntimeError(f"{op_name(func)}: shifts and dimensions must align. shifts: "
                           f"{len(shifts)}, dims: {len(dims)}")
    local, dec = x._local, x._dec
    for s, d in zip(shifts, dims):
        d = _ndim_dim(func, int(d), x.ndim)
        n = dec.global_shape[d]
        if n == 0:
            continue
        s = int(s) % n
        if s == 0:
            continue
        if d not in dec.shard:
            local = torch.roll(local, s, d)
            continue
        tail, tail_dec = slice_dim(local, dec, d, n - s, n, 1)
        head, head_dec = slice_dim(local, dec, d, 0, n - s, 1)
        pieces = [DomainTensor(tail, tail_dec), DomainTensor(head, head_dec)]
        local, _ = _cat(func, pieces, d, tail_dec, out_sizes=dec.block_sizes(d))
    return DomainTensor(local, dec)


# The index ops along a sharded point dim (index_select, gather, index_add, scatter_*,
# cdist) live beside the routed exchange they use; importing them registers their rules.
from ..points import rules as _point_rules  # noqa: E402,F401
