"""Shape ops: view, reshape, flatten, unflatten, permute, transpose, movedim,
squeeze, unsqueeze, expand (and their torch, Tensor and attribute forms).

Local unless a rule below says it repartitions (then collective over the grid,
an alltoallv through ``ag.repartition``). All sizes an op takes are GLOBAL
(``x.view(B, C, H * W)``, ``x.expand(4, -1, -1)``); the rule translates them to
the block. Every decision is made from metadata every rank holds alike, so a
refusal (UnsupportedOpError) is raised on every rank alike.

Rules
-----
Dim reorderings (permute, transpose, swapaxes/swapdims, movedim/moveaxis, t,
``.T``, ``.mT``, ``.H``, ``.mH``, adjoint): applied to the block; a sharded dim
follows to its new position with the same grid axis and block sizes.

unsqueeze: shifts the dims after the new one. squeeze: a sharded dim of global
size 1 is first repartitioned to unsharded (cheap: one slice), then dropped.
Only dims of global size 1 are dropped, never a block's dims that merely happen
to have local size 1.

expand / expand_as / broadcast_to: only dims of global size 1 (and new leading
dims) grow, as in torch; a size-1 dim that is sharded is made unsharded first.
``-1`` keeps a size. The expanded dims are whole on every rank.

view / reshape / flatten / unflatten / ravel / view_as / reshape_as: the old and
new GLOBAL shapes are cut into groups as torch's view does (consecutive old
dims and consecutive new dims with equal products). Size-1 dims are ignored
when looking for the outermost dim of a group. Per group:

- no sharded dim: the group is reshaped in the block as in the global tensor;
- one sharded dim ``d`` of size > 1 which is the outermost dim of its old group,
  with old inner product ``I`` and new inner product ``J`` (product of the new
  group's dims after its outermost one, ``n0``): the block holds a contiguous
  run of the flattened group, so if every block size ``s_i * I`` is a multiple
  of ``J`` the result has ``n0`` sharded on the same axis with sizes
  ``s_i * I / J``. This covers merges (``J = 1``: sizes ``s_i * I``), splits
  (``I = 1``: sizes ``s_i / J``) and general regroupings;
- otherwise (the sizes are not multiples of ``J``, or ``d`` is not the
  outermost dim of its group) ``reshape`` first repartitions the old tensor so
  that the outermost old dim of the group is sharded on ``d``'s axis, balanced
  in units of ``J / gcd(I, J)`` rows, then proceeds as above; it refuses when
  those units are too coarse to give more than one non-empty block while the
  old layout had several (that would gather the dim onto one rank). ``view``
  does the same (Swin's window partition ``x.view(B, D // ws, ws, ...)`` on
  blocks of 11/11/10 rows and windows of 4 repartitions to 12/12/8 rows, 3/3/2
  whole windows, sharded on the windows dim); see "Views that are copies";
- two sharded dims of size > 1 in one group: refused (one of them would have to
  be gathered whole along its grid axis);
- a sharded dim of global size 1: kept when it forms a group with only size-1
  new dims (it moves to the first of them), otherwise made unsharded first.

Views that are copies. torch's ``view`` always shares its input's storage
(``reshape`` may copy, and torch says not to rely on either). A ``view`` that
repartitions is a copy of the blocks, so domainpar marks it and its input
(``tensor/aliasing.py``): an in-place write into either, or into any tensor
that shares data with them through view-like ops (permute, slicing, detach,
``.data`` ...), raises UnsupportedOpError on every rank, since in one process
it would reach both. Out-of-place ops and writes into a ``clone()`` are fine.
A ``view`` that needs no repartition views the block; a block whose strides do
not allow a view (after a permute, say) is copied instead of raising: whether
a view is possible can differ between ranks (an empty block always views), and
an error on some ranks only would hang the others.

A tensor with no elements is reshaped in the block and comes back unsharded
(there is nothing to lay out). ``view(dtype)`` keeps the layout when the item
sizes match, and otherwise needs the last dim unsharded.

In-place shape changes (``squeeze_``, ``unsqueeze_``, ``transpose_``, ``t_``,
``swapdims_``, ``resize_``, ``as_strided`` ...) are refused: a DomainTensor's
global shape is fixed; assign the result of the out-of-place op instead.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import autograd as ag
from ..comm.decomposition import Decomposition, balanced_sizes
from ..tensor import aliasing, layout
from ..tensor.dispatch import UnsupportedOpError, op_name, register, register_attribute
from ..tensor.domain_tensor import DomainTensor

T = torch.Tensor


def _self(func, args, kwargs) -> DomainTensor:
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: expected a DomainTensor as the tensor "
                                 f"operand, got a {type(x).__name__}")
    return x


def _rest(args, kwargs):
    """The op's arguments after the tensor, with any DomainTensor among them
    (``view_as``/``expand_as`` targets) replaced by its global shape's meta stand-in."""
    def meta(a):
        if isinstance(a, DomainTensor):
            return torch.empty(a._dec.global_shape, dtype=a.dtype, device="meta")
        return a
    rest = tuple(meta(a) for a in args[1:])
    kw = {k: meta(v) for k, v in kwargs.items() if k not in ("input", "self")}
    return rest, kw


def _probe(func, x: DomainTensor, args, kwargs, shape=None):
    """``func`` applied to a meta tensor of the global shape (or ``shape``): the
    result's global shape, torch's own argument parsing and torch's own errors
    (raised alike on every rank), with no data."""
    rest, kw = _rest(args, kwargs)
    probe = torch.empty(x._dec.global_shape if shape is None else shape, dtype=x.dtype,
                        device="meta")
    return func(probe, *rest, **kw)


def _refuse(func, x: DomainTensor, why: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"{op_name(func)} on a DomainTensor of global shape "
                              f"{tuple(x._dec.global_shape)} sharded on "
                              f"{layout.sharded_dims_text(x._dec)}: {why}")


# -- dim reorderings ---------------------------------------------------------------------------
def _reorder(func, x: DomainTensor, args, kwargs, local_op):
    """Run a pure dim permutation: find where each dim goes by probing a meta
    tensor whose dim ``d`` has the distinct size ``d + 2``."""
    ndim = x._dec.ndim
    out = _probe(func, x, args, kwargs, shape=tuple(range(2, ndim + 2)))
    perm = [s - 2 for s in out.shape]  # out dim i is input dim perm[i]
    dim_map = {d: i for i, d in enumerate(perm)}
    out_shape = tuple(x._dec.global_shape[d] for d in perm)
    return DomainTensor(local_op(x._local), layout.remap(x._dec, out_shape, dim_map))


@register(torch.permute, T.permute, torch.transpose, T.transpose, torch.swapaxes, T.swapaxes,
          torch.swapdims, T.swapdims, torch.movedim, T.movedim, torch.moveaxis, T.moveaxis,
          torch.t, T.t, torch.adjoint, T.adjoint)
def reorder(func, args, kwargs):
    """Local. Permutes dims; sharded dims move with their grid axes."""
    x = _self(func, args, kwargs)
    rest, kw = _rest(args, kwargs)
    return _reorder(func, x, args, kwargs, lambda local: func(local, *rest, **kw))


def _attribute_reorder(name):
    def rule(x):
        def getter(t):
            return getattr(t, name)
        return _reorder(getter, x, (x,), {}, getter)
    return rule


for _name in ("T", "mT", "H", "mH"):
    register_attribute(_name)(_attribute_reorder(_name))


# -- squeeze / unsqueeze -----------------------------------------------------------------------
def _dim_arg(args, kwargs, position=1):
    if len(args) > position:
        return args[position]
    return kwargs.get("dim")


@register(torch.squeeze, T.squeeze)
def squeeze(func, args, kwargs):
    """Local, or collective when a sharded dim of global size 1 is squeezed
    (repartitioned to unsharded first)."""
    x = _self(func, args, kwargs)
    _probe(func, x, args, kwargs)  # torch's argument checks and errors
    dec, ndim = x._dec, x._dec.ndim
    dim = _dim_arg(args, kwargs)
    dims: Sequence[int]
    if dim is None:
        dims = range(ndim)
    elif isinstance(dim, int):
        dims = (dim,)
    else:
        dims = tuple(dim)
    if any(isinstance(d, str) for d in dims):
        raise _refuse(func, x, "named dims are not supported")
    drop = sorted({d % max(ndim, 1) for d in dims if ndim and dec.global_shape[d % ndim] == 1})
    local, src = x._local, dec
    sharded = [d for d in drop if d in dec.shard]
    if sharded:
        src = layout.unsharded(dec, sharded)
        local = ag.repartition(local, dec, src)
    keep = [d for d in range(ndim) if d not in drop]
    out_shape = tuple(dec.global_shape[d] for d in keep)
    # Squeeze exactly the dims of global size 1: a block may have other dims of size 1.
    local = local.squeeze(tuple(drop)) if drop else local
    return DomainTensor(local, layout.remap(src, out_shape, {d: i for i, d in enumerate(keep)}))


@register(torch.unsqueeze, T.unsqueeze)
def unsqueeze(func, args, kwargs):
    """Local."""
    x = _self(func, args, kwargs)
    out_shape = tuple(_probe(func, x, args, kwargs).shape)
    ndim = x._dec.ndim
    dim = _dim_arg(args, kwargs)
    dim = dim % (ndim + 1)
    dim_map = {d: d + (d >= dim) for d in range(ndim)}
    return DomainTensor(x._local.unsqueeze(dim), layout.remap(x._dec, out_shape, dim_map))


# -- expand ------------------------------------------------------------------------------------
@register(T.expand, T.expand_as, torch.broadcast_to, T.broadcast_to)
def expand(func, args, kwargs):
    """Local, or collective when a sharded dim of global size 1 grows
    (repartitioned to unsharded first)."""
    x = _self(func, args, kwargs)
    out_shape = tuple(_probe(func, x, args, kwargs).shape)
    dec = x._dec
    lead = len(out_shape) - dec.ndim
    grow = [d for d in range(dec.ndim) if out_shape[d + lead] != dec.global_shape[d]]
    local, src = x._local, dec
    sharded = [d for d in grow if d in dec.shard]
    if sharded:
        src = layout.unsharded(dec, sharded)
        local = ag.repartition(local, dec, src)
    local_shape = src.local_shape()
    sizes = list(out_shape[:lead]) + [local_shape[d] if d in src.shard else out_shape[d + lead]
                                      for d in range(dec.ndim)]
    out_dec = layout.remap(src, out_shape, {d: d + lead for d in src.shard})
    return DomainTensor(local.expand(sizes), out_dec)


# -- view / reshape ----------------------------------------------------------------------------
def _groups(old: Sequence[int], new: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Consecutive old dims and consecutive new dims with equal products (both
    shapes have the same positive number of elements)."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        o, n, po, pn = [], [], 1, 1
        if i < len(old):
            o.append(i)
            po *= old[i]
            i += 1
        if j < len(new):
            n.append(j)
            pn *= new[j]
            j += 1
        while po != pn:
            if po < pn:
                o.append(i)
                po *= old[i]
                i += 1
            else:
                n.append(j)
                pn *= new[j]
                j += 1
        groups.append((o, n))
    return groups


def _nonempty(sizes) -> int:
    return sum(1 for s in sizes if s)


class _Plan:
    """Where a reshape's sharded dims go: the source layout the block must be in
    (``src``; the input's own when no repartition is needed) and the output's."""

    def __init__(self):
        self.src_shard, self.src_sizes, self.out_shard, self.out_sizes = {}, {}, {}, {}
        self.moves: list[str] = []  # why the blocks must be repartitioned, if they must
        # New dims that take the merged grid's axes back on its parent grid (a dim cut
        # over several axes split into as many dims or more), or None.
        self.split: list[int] | None = None


def _plan(func, x: DomainTensor, dec: Decomposition, new_shape: tuple[int, ...]) -> _Plan:
    old = dec.global_shape
    plan = _Plan()
    src_shard, src_sizes = plan.src_shard, plan.src_sizes
    out_shard, out_sizes = plan.out_shard, plan.out_sizes
    for o, n in _groups(old, new_shape):
        sharded = [d for d in o if d in dec.shard]
        if not sharded:
            continue
        o_nz = [d for d in o if old[d] != 1]
        n_nz = [d for d in n if new_shape[d] != 1]
        wide = [d for d in sharded if old[d] != 1]
        # Dims on grid axes of one process are whole: they stay as they are in the
        # source and are not carried to the output (unless no other dim is cut).
        whole = [d for d in wide if not layout.cut(dec, d)]
        if whole and len(whole) < len(wide):
            for d in whole:
                src_shard[d], src_sizes[d] = dec.shard[d], dec.block_sizes(d)
            wide = [d for d in wide if d not in whole]
        elif whole:
            for d in whole[1:]:
                src_shard[d], src_sizes[d] = dec.shard[d], dec.block_sizes(d)
            wide = whole[:1]
        if not wide:
            # Only sharded size-1 dims: one alone in an all-size-1 group moves to
            # the first new dim; any other is made unsharded (src leaves it out).
            if not o_nz and len(sharded) == 1 and n:
                d = sharded[0]
                src_shard[d], src_sizes[d] = dec.shard[d], dec.block_sizes(d)
                out_shard[n[0]], out_sizes[n[0]] = dec.shard[d], dec.block_sizes(d)
            else:
                plan.moves.append(f"sharded dims {sharded} of global size 1 must be made "
                                  f"unsharded to merge old dims {o} into new dims {n}")
            continue
        if len(wide) > 1:
            raise _refuse(func, x, (
                f"old dims {wide} (global shape {tuple(old)}) are all sharded and would "
                f"merge into new dims {n} of shape {tuple(new_shape)}; one of them would have "
                f"to be gathered whole along its grid axis. Repartition first "
                f"(x.redistribute(...)) so that at most one dim of the group is sharded"))
        d = wide[0]
        if len([k for k in sharded if k not in src_shard]) > 1:
            plan.moves.append(f"sharded dims {[k for k in sharded if k != d]} of global size 1 "
                              f"must be made unsharded to merge old dims {o} into new dims {n}")
        axis, o0, n0 = dec.shard[d], o_nz[0], n_nz[0]
        inner = math.prod(old[k] for k in o_nz[1:])
        inner_new = math.prod(new_shape[k] for k in n_nz[1:])
        sizes = dec.block_sizes(d)
        if d == o0 and all(s * inner % inner_new == 0 for s in sizes):
            src_shard[d], src_sizes[d] = axis, sizes
        else:
            unit = inner_new // math.gcd(inner, inner_new)
            target = tuple(b * unit for b in balanced_sizes(old[o0] // unit, len(sizes)))
            if _nonempty(target) < min(2, _nonempty(sizes)):
                raise _refuse(func, x, (
                    f"old dims {o} of shape {tuple(old[k] for k in o)} (sharded dim {d}) become "
                    f"new dims {n} of shape {tuple(new_shape[k] for k in n)}; the blocks would "
                    f"have to be whole multiples of {unit} rows of dim {o0}, and the "
                    f"{old[o0]} rows give only one such block, which would gather the dim onto "
                    f"one rank"))
            src_shard[o0], src_sizes[o0], sizes = axis, target, target
            plan.moves.append(
                f"old dims {o} become new dims {n}, and sharded dim {d} "
                + (f"has blocks {list(dec.block_sizes(d))} that are not all multiples of "
                   f"{unit}" if d == o0 else f"is not the outermost dim of them ({o0})")
                + f": the blocks must be repartitioned to {list(target)} rows of dim {o0}")
        out_shard[n0] = axis
        out_sizes[n0] = tuple(s * inner // inner_new for s in sizes)
        grid = dec.grid
        if grid.parent is not None and axis == grid.axis_from_parent[grid.merged_axes[0]] \
                and len(n_nz) >= len(grid.merged_axes):
            plan.split = n_nz[:len(grid.merged_axes)]
    return plan


def _reshape_to(func, x: DomainTensor, new_shape: tuple[int, ...], *, view: bool):
    dec = x._dec
    if math.prod(new_shape) == 0 or not dec.shard:
        # Nothing to lay out (no elements, or no cut): the block is the whole tensor
        # or empty on every rank, and comes back unsharded.
        out = layout.derive(dec, new_shape, {}, {})
        local = _local_view(x._local, new_shape) if view else x._local.reshape(new_shape)
        return DomainTensor(local, out)
    moves: list[str] = []
    pre = _merge_groups(func, x, new_shape, moves)
    plan = _plan(func, x, pre, new_shape)
    moves += plan.moves
    src = layout.derive(pre, dec.global_shape, plan.src_shard, plan.src_sizes)
    local = x._local
    if src != dec:
        local = ag.repartition(local, dec, src)
    out = layout.derive(src, new_shape, plan.out_shard, plan.out_sizes)
    local = _local_view(local, out.local_shape()) if view else local.reshape(out.local_shape())
    if plan.split is not None and pre is dec:  # back onto the parent grid, a dim per axis
        back = layout.unmerged(out, new_shape, plan.split)
        moves.append(f"new dims {plan.split} take the grid axes {out.grid.merged_axes} that "
                     f"dim {plan.split[0]} was cut over")
        local, out = ag.repartition(local, out, back), back
    result = DomainTensor(local, out)
    if view and moves:
        aliasing.mark_copied(x, result, (
            f"{op_name(func)} of global shape {tuple(dec.global_shape)} as {tuple(new_shape)} "
            f"repartitioned its blocks: " + "; ".join(moves)))
    return result


def _merge_groups(func, x: DomainTensor, new_shape, moves: list[str]) -> Decomposition:
    """``x``'s layout, or where a group merges several cut dims (a patch grid
    flattened into tokens) the layout on the grid that merges their axes, with
    the group's outermost dim cut over all of them in whole units of rows (so
    that the group's blocks reshape locally)."""
    dec = x._dec
    old = dec.global_shape
    for o, n in _groups(old, new_shape):
        wide = [d for d in o if old[d] != 1 and layout.cut(dec, d)]
        if len(wide) < 2:
            continue
        o_nz = [d for d in o if old[d] != 1]
        n_nz = [d for d in n if new_shape[d] != 1]
        inner = math.prod(old[k] for k in o_nz[1:])
        inner_new = math.prod(new_shape[k] for k in n_nz[1:])
        unit = inner_new // math.gcd(inner, inner_new)
        parts = math.prod(dec.grid.dims[dec.shard[d]] for d in wide)
        target = tuple(b * unit for b in balanced_sizes(old[o_nz[0]] // unit, parts))
        if _nonempty(target) < 2:
            raise _refuse(func, x, (
                f"old dims {o} of shape {tuple(old[k] for k in o)} (cut dims {wide}) become new "
                f"dims {n} of shape {tuple(new_shape[k] for k in n)}; cut over their "
                f"{parts} ranks together, the blocks would have to be whole multiples of "
                f"{unit} rows of dim {o_nz[0]}, and its {old[o_nz[0]]} rows give only one such "
                f"block, which would gather the group onto one rank"))
        moves.append(f"cut dims {wide} merge into new dims {n}: dim {o_nz[0]} is cut over "
                     f"their grid axes together, {list(target)} rows")
        dec = layout.merged(dec, wide, o_nz[0], target)
    return dec


def _local_view(local: torch.Tensor, shape) -> torch.Tensor:
    """The block viewed as ``shape``, or copied when its strides do not allow a
    view: whether they do can differ between ranks (an empty or one-row block
    views where a larger one does not), and a refusal on some ranks only would
    leave the others waiting in their next collective."""
    try:
        return local.view(shape)
    except RuntimeError:
        return local.reshape(shape)


def _is_dtype_view(args, kwargs) -> bool:
    a = args[1] if len(args) > 1 else kwargs.get("dtype")
    return isinstance(a, torch.dtype)


@register(T.view, T.view_as)
def view(func, args, kwargs):
    """Local, or collective when the blocks must be repartitioned first: then a
    copy, and writes into it or its input are refused (see the module docstring)."""
    x = _self(func, args, kwargs)
    out_shape = tuple(_probe(func, x, args, kwargs).shape)
    if func is T.view and _is_dtype_view(args, kwargs):
        dtype = args[1] if len(args) > 1 else kwargs["dtype"]
        if out_shape == tuple(x._dec.global_shape):
            return DomainTensor(x._local.view(dtype), x._dec)
        if x._dec.ndim - 1 in x._dec.shard:
            raise _refuse(func, x, f"viewing it as {dtype} changes the size of the last dim, "
                                   f"which is sharded")
        return DomainTensor(x._local.view(dtype),
                            layout.remap(x._dec, out_shape, {d: d for d in x._dec.shard}))
    return _reshape_to(func, x, out_shape, view=True)


@register(torch.reshape, T.reshape, T.reshape_as, torch.flatten, T.flatten, torch.unflatten,
          T.unflatten, torch.ravel, T.ravel)
def reshape(func, args, kwargs):
    """Local, or collective when the blocks must be repartitioned first (see the
    module docstring)."""
    x = _self(func, args, kwargs)
    out_shape = tuple(_probe(func, x, args, kwargs).shape)
    return _reshape_to(func, x, out_shape, view=False)


# -- in-place shape changes: refused -----------------------------------------------------------
def _in_place_names():
    for name in ("squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_",
                 "resize_", "resize_as_", "as_strided_", "as_strided", "set_"):
        f = getattr(T, name, None)
        if f is not None:
            yield f
    if hasattr(torch, "as_strided"):
        yield torch.as_strided


@register(*_in_place_names())
def in_place_shape(func, args, kwargs):
    """Refused: in-place shape changes (resize_, set_, as_strided, squeeze_, unsqueeze_, t_,
    transpose_ ...) cannot change a layout every rank shares."""
    x = args[0]
    raise UnsupportedOpError(
        f"{op_name(func)} on a DomainTensor (global shape {tuple(x.shape)}): a DomainTensor's "
        f"global shape and strides are fixed; use the out-of-place op and assign its result "
        f"(e.g. x = x.squeeze(0) instead of x.squeeze_(0))")
