"""Shared by the op families: how operands of an elementwise (broadcasting) op
are brought onto one layout, and how results are wrapped.

The output layout is that of the *lead* operand: the first DomainTensor with
the most dims. Every other operand is brought onto it:

- a DomainTensor laid out differently (other block boundaries, other sharded
  dims) is repartitioned onto the output's blocks; blocks are never paired
  row by row;
- a plain (replicated) tensor is cut to the block along the dims where it has
  the full global size and broadcast along the others, with the gradient sum
  over ranks that this implies (``tensor.params.enter_domain``).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, domain_tensors, op_name, same_grid
from ..tensor.domain_tensor import DomainTensor
from ..tensor.params import enter_domain


def output_layout(func: Any, operands: Sequence[Any]) -> tuple[Decomposition, tuple[int, ...]]:
    """The output decomposition and global shape of a broadcasting op: planned
    once per tuple of operand layouts (plain tensors: their shapes)."""
    key = ("broadcast",) + tuple(a._dec if isinstance(a, DomainTensor) else a.shape
                                 for a in operands if isinstance(a, torch.Tensor))
    return layout.planned(key, lambda: _broadcast_layout(func, operands))


def _broadcast_layout(func: Any, operands: Sequence[Any]) -> tuple[Decomposition, tuple[int, ...]]:
    dts = [a for a in operands if isinstance(a, DomainTensor)]
    same_grid(func, dts, merged_ok=True)  # ``onto`` repartitions across merged grids
    shapes = [tuple(a.shape) for a in operands if isinstance(a, torch.Tensor)]
    out_shape = tuple(torch.broadcast_shapes(*shapes))
    lead = max(dts, key=lambda t: t.ndim)  # max keeps the first of equal ndim
    offset = len(out_shape) - lead.ndim
    shard, sizes = {}, {}
    for d, axis in lead._dec.shard.items():
        if lead._dec.global_shape[d] == out_shape[d + offset]:
            shard[d + offset], sizes[d + offset] = axis, lead._dec.block_sizes(d)
    return layout.derive(lead._dec, out_shape, shard, sizes), out_shape


def aligned_dims(a: torch.Tensor, out_dec: Decomposition) -> dict[int, int]:
    """``{a_dim: out_dim}`` for the output's sharded dims where ``a`` (aligned from
    the right, numpy broadcasting) has the full global size."""
    offset = out_dec.ndim - a.ndim
    return {od - offset: od for od in out_dec.shard
            if od - offset >= 0 and a.shape[od - offset] == out_dec.global_shape[od]}


def onto(a: Any, out_dec: Decomposition) -> Any:
    """Operand ``a`` as this rank's local tensor for an output laid out by ``out_dec``."""
    if isinstance(a, DomainTensor):
        target, broadcast_axes = layout.planned(("onto", a._dec, out_dec),
                                                lambda: _onto_plan(a, out_dec))
        local = a._local if target is None else ag.repartition(a._local, a._dec, target)
        if broadcast_axes and local.requires_grad and torch.is_grad_enabled():
            local = ag.broadcast(local, out_dec.grid.sub(broadcast_axes))
        return local
    if isinstance(a, torch.Tensor):
        return enter_domain(a, out_dec, aligned_dims(a, out_dec))
    return a


def _onto_plan(a: DomainTensor, out_dec: Decomposition
               ) -> tuple[Decomposition | None, frozenset[int]]:
    """The layout ``a`` takes for an output laid out by ``out_dec`` (None: its
    own), and the output's grid axes along which ``a`` is broadcast."""
    dims = aligned_dims(a, out_dec)
    # On out_dec's grid when it is merged from a's (or a's from it); otherwise
    # a's own grid, which has out_dec's axes (same_grid checked the two).
    merged = a._dec.grid is not out_dec.grid and a._dec.grid.root is out_dec.grid.root
    target = layout.derive(out_dec if merged else a._dec, a._dec.global_shape,
                           {ad: out_dec.shard[od] for ad, od in dims.items()},
                           {ad: out_dec.block_sizes(od) for ad, od in dims.items()})
    # Along output axes where ``a`` is broadcast (a size-1 or missing dim) every
    # rank of the axis uses the same block of ``a``: its gradient is the sum of
    # their contributions, as for any replicated value entering per-block work.
    broadcast_axes = frozenset(out_dec.shard.values()) - frozenset(target.shard.values())
    return (None if target == a._dec else target), broadcast_axes


def wrap(func: Any, out: Any, out_dec: Decomposition) -> Any:
    """Wrap every tensor in ``out`` (a tensor or nested tuple) as a DomainTensor."""
    if layout.ENABLED and type(out) is torch.Tensor:  # the common case, without a tree walk
        return _wrap_one(func, out, out_dec)

    def one(o):
        if isinstance(o, torch.Tensor) and not isinstance(o, DomainTensor):
            return _wrap_one(func, o, out_dec)
        return o
    return pytree.tree_map(one, out)


def _wrap_one(func: Any, o: torch.Tensor, out_dec: Decomposition) -> DomainTensor:
    if tuple(o.shape) != out_dec.local_shape():
        raise UnsupportedOpError(
            f"{op_name(func)}: a result block of shape {tuple(o.shape)} does not match "
            f"the output layout {out_dec}; this op is not elementwise")
    return DomainTensor(o, out_dec)


def first_domain_tensor(args, kwargs=None) -> DomainTensor:
    """Local. The first DomainTensor among ``args`` and ``kwargs``."""
    return domain_tensors(args, kwargs)[0]


def normalize_dims(dim, ndim: int) -> tuple[int, ...]:
    """``dim`` (None, an int or a sequence; None or empty = all) as sorted
    non-negative dims."""
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    out = []
    for d in dims:
        if not -max(ndim, 1) <= d < max(ndim, 1):
            raise IndexError(f"Dimension out of range (expected to be in range of "
                             f"[{-ndim}, {ndim - 1}], but got {d})")
        out.append(d % max(ndim, 1))
    return tuple(sorted(set(out)))


def bind(func: Any, args, kwargs, names: Sequence[str], defaults=None, *,
         refuse_unknown: bool = False) -> dict:
    """The call's arguments bound to ``names`` (torch's signature order), with
    ``defaults`` for those not given. A keyword outside ``names`` is torch's
    TypeError, or, with ``refuse_unknown`` (``names`` then lists only what the
    rule supports), an UnsupportedOpError naming it."""
    given = dict(zip(names, args))
    unknown = []
    for k, v in kwargs.items():
        if k in given:
            raise TypeError(f"{op_name(func)} got multiple values for argument {k!r}")
        if k not in names:
            if not refuse_unknown:
                raise TypeError(f"{op_name(func)} got an unexpected keyword argument {k!r}")
            unknown.append(k)
        given[k] = v
    if unknown:
        raise UnsupportedOpError(f"{op_name(func)}: arguments {sorted(unknown)} are not "
                                 f"supported on DomainTensors")
    defaults = defaults or {}
    return {n: given.get(n, defaults.get(n)) for n in names}


# -- mixed precision (torch.autocast) ----------------------------------------------------------
def autocast_dtype(t: torch.Tensor):
    """Local. The dtype torch.autocast gives a lower-precision op's floating operands
    on ``t``'s device (bfloat16 or float16), or None where autocast is off there."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def autocast_operands(*tensors):
    """Local. ``tensors`` (None kept) as autocast hands them to a lower-precision op
    (conv, linear, matmul, attention): floating ones cast, differentiably, to the
    autocast dtype; unchanged where autocast is off. For op rules whose local work
    runs in their own autograd.Function or mixes in operands after torch's op,
    which autocast's own casts would not reach."""
    lead = next(t for t in tensors if isinstance(t, torch.Tensor))
    dtype = autocast_dtype(lead)
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                 for t in tensors)


def meta(t, dtype=None):
    """Local. An empty tensor of ``t``'s global shape on the meta device (None and
    non-tensors as they are), for torch's own argument checks and output shape.
    Under autocast a floating tensor takes the autocast dtype, as the op's real call
    sees it: the meta device has no autocast, and mixed dtypes would fail there."""
    if not isinstance(t, torch.Tensor):
        return t
    if dtype is None and t.is_floating_point():
        dtype = autocast_dtype(t)
    return torch.empty(t.shape, dtype=dtype or t.dtype, device="meta")


# -- torch's own checks and output shapes, on the meta device --------------------------------
def stand_in(t):
    """Local. A meta tensor of ``t``'s (global) shape and dtype; non-tensors as they are."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return t
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def signature(a, meta_only: bool = False):
    """Local. A hashable stand-in of an argument, for plan and cache keys: a tensor
    by shape (global for a DomainTensor) and dtype, a sequence item by item, anything
    else with its type (``0``, ``0.0`` and ``False`` hash alike). TypeError for an
    unhashable argument, and with ``meta_only`` for a tensor with values."""
    if isinstance(a, torch.Tensor):
        if meta_only and a.device.type != "meta":
            raise TypeError("a tensor with values")
        return ("tensor", tuple(a.shape), a.dtype)
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        return ("sequence", type(a), tuple(signature(v, meta_only) for v in a))
    hash(a)
    return ("value", type(a), a)


def _unsigned(s):
    kind, first, rest = s
    if kind == "tensor":
        return torch.empty(first, dtype=rest, device="meta")
    if kind == "sequence":
        return first(_unsigned(v) for v in rest)
    return rest


@functools.lru_cache(maxsize=1024)
def _meta_cached(func, signed):
    args, kwargs = _unsigned(signed)
    return func(*args, **dict(kwargs))


def meta_call(func, *args, **kwargs):
    """Local. ``func`` called on meta tensors (``meta``, ``stand_in``) and plain
    arguments: torch's own argument errors and its output's shapes and dtypes, from
    global shapes, alike on every rank before any message. Cached per signature
    (shapes, dtypes, argument values and types): a model calls the same layer the
    same way every step, and some of torch's meta kernels are Python decompositions
    that take milliseconds (torch 2.13: a trilinear ``F.interpolate`` 6.5 ms,
    ``multi_head_attention_forward`` about 1 ms). Errors are not cached; a tensor
    with values or an unhashable argument is called uncached. The result may be
    shared: read it only."""
    try:
        signature_ = signature((args, tuple(sorted(kwargs.items()))), meta_only=True)
    except TypeError:
        return func(*args, **kwargs)
    return _meta_cached(func, signature_)
