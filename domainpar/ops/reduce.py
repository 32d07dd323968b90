"""Reductions: sum, mean, amax, amin, max, min, var, std, norm, logsumexp, all, any
(and F.normalize, a norm and a division).

Over unsharded dims a reduction is local and keeps the layout. Over sharded
dims each rank reduces its block, the partial results are combined over the
communicator of those dims' grid axes, and the result is replicated along them:
a plain tensor when no sharded dim remains, else a DomainTensor sharded on the
dims that remain. Backward follows docs/design.md: a replicated result's gradient
is one logical gradient and reaches every block whole (AllreduceSum's adjoint
is the identity).

How each combines so that values and gradients equal one process:

- sum, mean: allreduce of block sums.
- amax, amin, max(), min(): allreduce max/min of block extrema, NaN carried by
  a flag (MPI's MAX/MIN drop NaN by the order they meet it; torch returns NaN);
  the gradient is spread evenly over all elements equal to the extremum, across
  ranks, as torch does, by adding a term that is exactly zero in value and
  carries that gradient. Where the result is NaN each form follows torch: amax
  and amin give NaN to the whole slab, max() and min() share among the NaNs.
- max/min along a dim, argmax, argmin: the first index of the extremum (the
  first NaN where there is one), over all ranks.
- var, std: two passes, the global mean first, then the allreduced sum of squared
  deviations from it (never E[x^2] - E[x]^2).
- norm: block norms are themselves combined with the same norm (every p-norm of
  a vector is the p-norm of the p-norms of its pieces); torch's own norm then
  provides the gradient, zero vectors included. inf norms go through amax.
- logsumexp: with the global maximum as the shift.
"""
from __future__ import annotations

import math

import torch
from mpi4py import MPI

from .. import autograd as ag
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, op_name, register
from ..tensor.domain_tensor import DomainTensor
from .common import bind, normalize_dims
from .pointwise import elementwise

T = torch.Tensor


# -- the shared skeleton -------------------------------------------------------------------
def _bind(func, args, kwargs, names, defaults):
    """``args``/``kwargs`` of a torch reduction bound to ``names`` (first: input),
    as a list; other keywords are refused as unsupported."""
    return list(bind(func, args, kwargs, names, defaults, refuse_unknown=True).values())


def _comm(x: DomainTensor, dims):
    return layout.comm_of(x._dec, dims)


def _combine_sum(part: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
    return part if comm.Get_size() == 1 else ag.allreduce_sum(part, comm)


def _finish(x: DomainTensor, part: torch.Tensor, dims, keepdim: bool):
    """The combined block result ``part`` (reduced dims kept, size 1) as the op's result."""
    dec = x._dec
    dims = set(dims)
    kept = [d for d in range(dec.ndim) if d not in dims]
    remaining = {d: a for d, a in dec.shard.items() if d not in dims}
    if keepdim:
        shape = [1 if d in dims else n for d, n in enumerate(dec.global_shape)]
        new_dim = {d: d for d in remaining}
    else:
        part = part.reshape([part.shape[d] for d in kept])
        shape = [dec.global_shape[d] for d in kept]
        new_dim = {d: kept.index(d) for d in remaining}
    if not remaining:
        return part
    out_dec = layout.derive(dec, shape, {new_dim[d]: a for d, a in remaining.items()},
                            {new_dim[d]: dec.block_sizes(d) for d in remaining})
    return DomainTensor(part, out_dec)


def _keep_shape(local: torch.Tensor, dims) -> list[int]:
    return [1 if d in dims else n for d, n in enumerate(local.shape)]


def lowest(dtype):
    """Local. The identity of max for ``dtype``: -inf, or the integer type's minimum."""
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def highest(dtype):
    """Local. The identity of min for ``dtype``: inf, or the integer type's maximum."""
    return math.inf if dtype.is_floating_point else torch.iinfo(dtype).max


def _needs_grad(t: torch.Tensor) -> bool:
    return t.requires_grad and torch.is_grad_enabled()


def allreduce_extremum(part: torch.Tensor, comm: MPI.Comm, op: str) -> torch.Tensor:
    """Collective over ``comm``. ``part`` reduced elementwise with ``op`` ('max' or
    'min') over the ranks of ``comm``, NaN winning as in torch: MPI's MAX/MIN drop
    NaN by the order they meet it, so a NaN flag travels in the same message.
    Detached (a building block)."""
    if comm.Get_size() == 1:
        return part.detach()
    if not part.is_floating_point():
        return ag.allreduce_tensor(part, comm, op)
    nan = torch.isnan(part)
    fill = lowest(part.dtype) if op == "max" else highest(part.dtype)
    flag = nan.to(part.dtype) if op == "max" else -nan.to(part.dtype)
    both = ag.allreduce_tensor(torch.stack([torch.where(nan, fill, part.detach()), flag]),
                               comm, op)
    return torch.where(both[1] != 0, math.nan, both[0])


def global_first_index(values, best, indices, comm: MPI.Comm, last_nan: bool = False):
    """Collective over ``comm``. Per slot, the smallest of the ranks' global
    ``indices`` whose ``values`` equal ``best`` (NaN equal to NaN): the first
    extremum, as torch's max(dim) returns it; with ``last_nan`` the largest where
    ``best`` is NaN (torch's max pools). Returns it and whether this rank holds it."""
    nan = torch.isnan(best) if best.is_floating_point() else torch.zeros_like(best, dtype=torch.bool)
    same = (values == best) | (nan & torch.isnan(values))
    big = torch.iinfo(torch.long).max
    key = torch.where(nan, big - indices, indices) if last_nan else indices
    candidate = torch.where(same, key, torch.full_like(key, big))
    winner = ag.allreduce_tensor(candidate, comm, "min") if comm.Get_size() > 1 else candidate
    mine = same & (candidate == winner)
    return (torch.where(nan, big - winner, winner) if last_nan else winner), mine


# -- sum, mean -------------------------------------------------------------------------------
def global_sum(x: DomainTensor, dims, keepdim=False, dtype=None):
    """Collective over the axes that cut ``dims`` (allreduce). The sum of ``x`` over
    ``dims``, replicated on those axes."""
    part = x._local.sum(dim=dims, keepdim=True, dtype=dtype)
    return _finish(x, _combine_sum(part, _comm(x, dims)), dims, keepdim)


@register(torch.sum, T.sum, torch.nansum, T.nansum)
def _sum(func, args, kwargs):
    """Collective over the axes of the reduced sharded dims (allreduce). Any dims, keepdim,
    dtype; replicated result, or a DomainTensor where sharded dims remain."""
    x, dim, keepdim, dtype = _bind(func, args, kwargs, ("input", "dim", "keepdim", "dtype"), {})
    dims = normalize_dims(dim, x.ndim)
    part = func(x._local, dim=dims, keepdim=True, dtype=dtype)
    return _finish(x, _combine_sum(part, _comm(x, dims)), dims, bool(keepdim))


@register(torch.mean, T.mean)
def _mean(func, args, kwargs):
    """Collective over the axes of the reduced sharded dims (allreduce). Any dims, keepdim,
    dtype."""
    x, dim, keepdim, dtype = _bind(func, args, kwargs, ("input", "dim", "keepdim", "dtype"), {})
    if not (x.dtype.is_floating_point or x.dtype.is_complex) and dtype is None:
        return func(x._local, dim, keepdim)  # torch's own error for integer input
    dims = normalize_dims(dim, x.ndim)
    count = math.prod(x.shape[d] for d in dims)
    part = x._local.sum(dim=dims, keepdim=True, dtype=dtype)
    return _finish(x, _combine_sum(part, _comm(x, dims)) / count, dims, bool(keepdim))


# -- extrema ---------------------------------------------------------------------------------
def global_extremum(x: DomainTensor, dims, keepdim: bool, op: str, nan_grad: str = "all"):
    """amax (op='max') or amin (op='min') over ``dims``, with torch's gradient. Where
    the result is NaN the gradient is, as torch gives it: ``nan_grad='all'`` NaN on
    the whole slab (amax/amin), ``'even'`` shared among its NaNs (max()/min()),
    ``'none'`` zero (inf norms)."""
    local, comm = x._local, _comm(x, dims)
    if any(local.shape[d] == 0 for d in dims):
        fill = lowest(local.dtype) if op == "max" else highest(local.dtype)
        part = torch.full(_keep_shape(local, dims), fill, dtype=local.dtype, device=local.device)
    else:
        part = (local.amax if op == "max" else local.amin)(dim=dims, keepdim=True)
    m = allreduce_extremum(part, comm, op)
    if not _needs_grad(local):
        return _finish(x, m, dims, keepdim)
    # Value m exactly; gradient g / count to each element equal to the extremum.
    nan = torch.isnan(m)
    mask = torch.where(nan, torch.isnan(local), local == m) if nan_grad == "even" else local == m
    count = ag.allreduce_tensor(mask.sum(dim=dims, keepdim=True), comm, "sum").to(local.dtype)
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    zero = torch.where(mask, local - shift, torch.zeros_like(local)).sum(dim=dims, keepdim=True)
    zero = zero / count.clamp_min(1)
    if nan_grad == "all" and bool(nan.any()):  # NaN times every element: a NaN gradient
        factor = torch.where(nan, m, torch.zeros_like(m))
        zero = zero + torch.where(nan, (local * factor).sum(dim=dims, keepdim=True), 0.0)
    return _finish(x, m + _combine_sum(zero, comm), dims, keepdim)


@register(torch.amax, T.amax, torch.amin, T.amin)
def _amax_amin(func, args, kwargs):
    """Collective over the axes of the reduced sharded dims (allreduce max/min). Any dims,
    keepdim; the gradient is shared among tied maxima as torch shares it."""
    x, dim, keepdim = _bind(func, args, kwargs, ("input", "dim", "keepdim"), {"dim": ()})
    dims = normalize_dims(dim, x.ndim)
    return global_extremum(x, dims, bool(keepdim), "max" if "max" in func.__name__ else "min")


@register(torch.max, T.max, torch.min, T.min)
def _max_min(func, args, kwargs):
    """Collective over the axes of the reduced sharded dims. Whole-tensor max/min, along one
    dim with global indices, and the elementwise two-tensor form."""
    names = ("input", "dim", "keepdim")
    if len(args) > 1 and isinstance(args[1], torch.Tensor) or "other" in kwargs:
        return elementwise(func, args, kwargs)  # torch.max(a, b): elementwise
    x, dim, keepdim = _bind(func, args, kwargs, names, {})
    op = "max" if "max" in func.__name__ else "min"
    if dim is None:
        return global_extremum(x, normalize_dims(None, x.ndim), False, op, nan_grad="even")
    return _extremum_with_index(func, x, normalize_dims(dim, x.ndim)[0], bool(keepdim), op)


def _extremum_with_index(func, x: DomainTensor, dim: int, keepdim: bool, op: str):
    """max/min along one dim: values and global indices (the first index of the
    extremum, as torch returns on CPU), gradient to that element only."""
    local, dec = x._local, x._dec
    result_type = torch.return_types.max if op == "max" else torch.return_types.min
    if dim not in dec.shard:
        values, indices = func(local, dim, True)
        return result_type((_finish(x, values, (dim,), keepdim),
                            _finish(x, indices, (dim,), keepdim)))
    comm = _comm(x, (dim,))
    keep = _keep_shape(local, (dim,))
    if local.shape[dim] == 0:
        fill = lowest(local.dtype) if op == "max" else highest(local.dtype)
        # + the (zero) sum of the empty block: the result stays in local's graph,
        # so every rank takes part in backward, an empty block included.
        values = torch.full(keep, fill, dtype=local.dtype, device=local.device) + \
            local.sum(dim=dim, keepdim=True)
        indices = torch.zeros(keep, dtype=torch.long, device=local.device)
    else:
        values, indices = func(local, dim, True)
    best = allreduce_extremum(values, comm, op)
    winner, mine = global_first_index(values, best, indices + dec.offsets()[dim], comm)
    out = best
    if _needs_grad(local):
        shift = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
        zero = torch.where(mine, values - shift, torch.zeros_like(values))
        out = best + _combine_sum(zero, comm)
    return result_type((_finish(x, out, (dim,), keepdim), _finish(x, winner, (dim,), keepdim)))


@register(torch.argmax, T.argmax, torch.argmin, T.argmin)
def _argmax_argmin(func, args, kwargs):
    """Collective over the axes of the reduced sharded dims. Global indices of the first
    extremum (the first NaN where there is one), along one dim or of the flattened
    tensor, keepdim; as torch."""
    x, dim, keepdim = _bind(func, args, kwargs, ("input", "dim", "keepdim"), {})
    op = "max" if "max" in func.__name__ else "min"
    if x.numel() == 0 or x.is_complex():   # torch's own error, on every rank alike
        return func(torch.empty(x.shape, dtype=x.dtype, device="meta"), dim, bool(keepdim))
    with torch.no_grad():
        if dim is not None:
            dim = normalize_dims(dim, x.ndim)[0]
            pick = torch.max if op == "max" else torch.min
            return _extremum_with_index(pick, x, dim, bool(keepdim), op)[1]
        return _flat_arg_extremum(x, bool(keepdim), op)


def _flat_arg_extremum(x: DomainTensor, keepdim: bool, op: str) -> torch.Tensor:
    """argmax/argmin of the flattened tensor: a replicated global flat index."""
    local, dec = x._local, x._dec
    dims = tuple(range(x.ndim))
    if local.numel() == 0:
        fill = lowest(local.dtype) if op == "max" else highest(local.dtype)
        value = torch.full((), fill, dtype=local.dtype, device=local.device)
        flat = torch.zeros((), dtype=torch.long, device=local.device)
    else:
        value, flat = (local.reshape(-1).max if op == "max" else local.reshape(-1).min)(0)
    index = global_flat_index(flat, local.shape, dec.offsets(), x.shape)
    comm = _comm(x, dims)
    best = allreduce_extremum(value, comm, op)
    winner, _ = global_first_index(value, best, index, comm)
    return winner.reshape([1] * x.ndim) if keepdim else winner


def global_flat_index(flat: torch.Tensor, local_shape, offsets, global_shape) -> torch.Tensor:
    """A flat index into a block of ``local_shape`` at ``offsets`` as a flat index into
    the global shape."""
    out = torch.zeros_like(flat)
    rest, scale = flat, 1
    for size, offset, n in zip(reversed(local_shape), reversed(offsets), reversed(global_shape)):
        out = out + (rest % max(size, 1) + offset) * scale
        rest = rest // max(size, 1)
        scale *= n
    return out


# -- var, std ---------------------------------------------------------------------------------
def global_var(x: DomainTensor, dims, correction, keepdim: bool):
    """Collective over the axes that cut ``dims`` (two allreduces: the mean, then the
    squared deviations). The variance over ``dims`` with Bessel's ``correction``."""
    local, comm = x._local, _comm(x, dims)
    count = math.prod(x.shape[d] for d in dims)
    mean = _combine_sum(local.sum(dim=dims, keepdim=True), comm) / count
    # The replicated mean enters every block's computation: its gradient is the
    # sum of the blocks' contributions (Broadcast), not just this block's.
    dev = local - ag.broadcast(mean, comm)
    square = (dev.real ** 2 + dev.imag ** 2) if dev.is_complex() else dev * dev
    m2 = _combine_sum(square.sum(dim=dims, keepdim=True), comm)
    return m2 / max(count - correction, 0), mean


def _var_args(func, args, kwargs):
    """torch.var's signatures: (x, dim=None, *, correction=1, keepdim=False),
    (x, dim, unbiased, keepdim=False) and (x, unbiased)."""
    x, rest = args[0], list(args[1:])
    kwargs = dict(kwargs)
    dim = kwargs.pop("dim", None)
    if rest and isinstance(rest[0], bool):
        kwargs["unbiased"] = rest.pop(0)
    elif rest:
        dim = rest.pop(0)
    # After dim, positionals are (unbiased, keepdim), as torch's overload takes them.
    # (Popping inside a subscripted assignment would pop before the key is read.)
    if rest:
        kwargs["unbiased"] = rest.pop(0)
    if rest:
        kwargs["keepdim"] = rest.pop(0)
    correction = kwargs.pop("correction", None)
    unbiased = kwargs.pop("unbiased", None)
    keepdim = bool(kwargs.pop("keepdim", False))
    if kwargs:
        raise UnsupportedOpError(f"{op_name(func)}: arguments {sorted(kwargs)} are not supported "
                                 f"on DomainTensors")
    if correction is None:
        correction = 1 if unbiased is None else int(bool(unbiased))
    return x, normalize_dims(dim, x.ndim), correction, keepdim


@register(torch.var, T.var, torch.std, T.std, torch.var_mean, torch.std_mean)
def _var_std(func, args, kwargs):
    """Collective (two allreduce passes: the global mean, then squared deviations). Any dims,
    correction/unbiased, keepdim; var_mean, std_mean."""
    x, dims, correction, keepdim = _var_args(func, args, kwargs)
    var, mean = global_var(x, dims, correction, keepdim)
    out = var.sqrt() if func.__name__.startswith("std") else var
    if func.__name__.endswith("_mean"):
        return _finish(x, out, dims, keepdim), _finish(x, mean, dims, keepdim)
    return _finish(x, out, dims, keepdim)


# -- norms --------------------------------------------------------------------------------------
def global_vector_norm(x: DomainTensor, ord, dims, keepdim: bool, dtype=None):
    """Collective over the axes that cut ``dims`` (allreduce). The ``ord``-norm of
    ``x`` over ``dims``, computed in ``dtype`` when given."""
    local = x._local if dtype is None else x._local.to(dtype)
    if ord in (math.inf, -math.inf):
        ax = DomainTensor(local.abs(), x._dec)
        return global_extremum(ax, dims, keepdim, "max" if ord > 0 else "min", nan_grad="none")
    comm = _comm(x, dims)
    if any(local.shape[d] == 0 for d in dims):
        # Zeros that stay in the graph: every rank's result must require grad
        # alike, or only some ranks would enter the backward's collectives.
        part = local.abs().sum(dim=dims, keepdim=True)
    else:
        part = torch.linalg.vector_norm(local, ord, dims, keepdim=True)
    if comm.Get_size() == 1:
        return _finish(x, part, dims, keepdim)
    if ord == 0:  # a count: the pieces add up
        return _finish(x, _combine_sum(part, comm), dims, keepdim)
    # Every rank puts its block norm in its slot; the sum replicates the stack.
    slot, n = comm.Get_rank(), comm.Get_size()
    pad = part.new_zeros((1,) + tuple(part.shape))
    stack = torch.cat([pad.expand(slot, *part.shape), part[None],
                       pad.expand(n - slot - 1, *part.shape)])
    stack = _combine_sum(stack, comm)
    return _finish(x, torch.linalg.vector_norm(stack, ord, 0), dims, keepdim)


@register(torch.linalg.vector_norm)
def _vector_norm(func, args, kwargs):
    """Collective over the axes of the reduced sharded dims. Any ord (0, inf, -inf, p), dims,
    keepdim, dtype."""
    x, ord, dim, keepdim, dtype = _bind(func, args, kwargs,
                                        ("input", "ord", "dim", "keepdim", "dtype"), {"ord": 2})
    return global_vector_norm(x, float(ord), normalize_dims(dim, x.ndim), bool(keepdim), dtype)


@register(torch.norm, T.norm)
def _norm(func, args, kwargs):
    """Collective over the axes of the reduced sharded dims. p-norms, 'fro', inf; dims,
    keepdim, dtype."""
    # torch.norm(input, p, dim, keepdim, out, dtype); the Python wrapper passes out=None.
    x, p, dim, keepdim, out, dtype = _bind(func, args, kwargs,
                                           ("input", "p", "dim", "keepdim", "out", "dtype"),
                                           {"p": "fro"})
    if out is not None:
        raise UnsupportedOpError(f"{op_name(func)}: out= is not supported on DomainTensors")
    if p == "fro" or p is None:
        p = 2.0
    if isinstance(p, str):
        raise UnsupportedOpError(f"{op_name(func)}: p={p!r} (a matrix norm) is not supported on "
                                 f"DomainTensors; vector p-norms and 'fro' are")
    return global_vector_norm(x, float(p), normalize_dims(dim, x.ndim), bool(keepdim), dtype)


# -- logsumexp ----------------------------------------------------------------------------------
@register(torch.logsumexp, T.logsumexp)
def _logsumexp(func, args, kwargs):
    """Collective (a global max shift, then an allreduce of exponentials). Any dims, keepdim."""
    x, dim, keepdim = _bind(func, args, kwargs, ("input", "dim", "keepdim"), {})
    dims = normalize_dims(dim, x.ndim)
    local, comm = x._local, _comm(x, dims)
    if any(local.shape[d] == 0 for d in dims):
        part = torch.full(_keep_shape(local, dims), -math.inf, dtype=local.dtype,
                          device=local.device)
    else:
        part = local.detach().amax(dim=dims, keepdim=True)
    m = allreduce_extremum(part, comm, "max")
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    s = _combine_sum(torch.exp(local - shift).sum(dim=dims, keepdim=True), comm)
    return _finish(x, torch.log(s) + shift, dims, bool(keepdim))


# -- all, any ------------------------------------------------------------------------------------
@register(torch.all, T.all, torch.any, T.any)
def _all_any(func, args, kwargs):
    """Collective over the axes of the reduced sharded dims. Any dims, keepdim; a replicated
    bool result."""
    x, dim, keepdim = _bind(func, args, kwargs, ("input", "dim", "keepdim"), {})
    dims = normalize_dims(dim, x.ndim)
    part = func(x._local, dim=dims, keepdim=True).to(torch.uint8)
    op = "min" if func.__name__ == "all" else "max"
    return _finish(x, ag.allreduce_tensor(part, _comm(x, dims), op).bool(), dims, bool(keepdim))


# -- normalize ----------------------------------------------------------------------------------
@register(torch.nn.functional.normalize)
def _normalize(func, args, kwargs):
    """x / max(||x||_p over dim, eps), the norm taken globally along a sharded dim."""
    x, p, dim, eps, out = _bind(func, args, kwargs, ("input", "p", "dim", "eps", "out"),
                                {"p": 2.0, "dim": 1, "eps": 1e-12})
    if out is not None:
        raise UnsupportedOpError(f"{op_name(func)}: out= is not supported on DomainTensors")
    norm = global_vector_norm(x, float(p), normalize_dims(dim, x.ndim), True)
    if isinstance(norm, DomainTensor):  # sharded dims other than ``dim`` remain
        denom = DomainTensor(norm._local.clamp_min(eps), norm._dec)
    else:
        denom = norm.clamp_min(eps)
    return elementwise(torch.div, (x, denom), {})
