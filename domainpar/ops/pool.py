"""Pooling, 1-, 2- and 3-D, on inputs sharded along any spatial dims and along the
batch and channel dims (pooling treats every (batch, channel) plane alike), batched
or unbatched.

- max_pool: every rank gathers the input cells its outputs read
  (``window.gather``: a halo fill, the dtype's lowest value as padding, which no
  window can pick), then runs torch's max pool with no padding and no ceil_mode
  on them: the gathered range already holds the windows that ceil_mode lets
  reach past the padded input. Output layout: ``window.sliding`` (output ``j``
  goes to the rank holding its window's centre cell). ``return_indices`` gives
  global flat indices into the spatial dims of the global input, as torch does,
  on the output's layout; they are made global only when asked (that costs
  more than the pool).
- avg_pool: the window sums of the zero-padded cells, divided by the divisor
  torch uses for each output (per dim, the window ``[o*s - p, min(o*s - p + k,
  n + p))``, clipped to ``[0, n)`` when ``count_include_pad`` is False; the
  product over dims; or ``divisor_override``), computed from the output's global
  indices.
- adaptive pools: local where no spatial dim is sharded. A sharded dim whose
  output size ``m`` divides its size ``n`` is a regular pool there (kernel =
  stride = ``n / m``, gathered as for max_pool, torch's adaptive pool run on the
  gathered cells). A sharded dim with output size 1 is a global reduction over
  its grid axis (allreduce of block sums or maxima; never a gather of the dim
  onto one rank); the result is replicated along that axis, and a plain tensor
  when no sharded dim remains, as for the reductions.
- lp_pool: torch's own formula (``avg_pool`` of ``x ** p``, or a max pool of
  ``|x|`` for p = inf) on top of the rules above.

torch itself validates every call first, on the meta device with the global
shapes, so bad arguments get torch's own error on every rank before any message.
A max or avg pool makes that check and its window plans once per layout and
arguments (``layout.planned``), an adaptive pool its check once per signature.

Refused (UnsupportedOpError on every rank):

- an adaptive pool with a sharded dim whose output size is neither 1 nor a
  divisor of its size;
- ``return_indices`` of an adaptive max pool with output size 1 along a
  sharded dim.

Known differences from one process: where a max-pool window holds only -inf
values (or, for an adaptive max pool with output size 1 along a sharded dim,
exact ties across dims), the index (and gradient) may go to another of the
tied cells than torch's.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, op_name, register
from ..tensor.domain_tensor import DomainTensor
from . import window
from .common import bind, meta_call, stand_in
from .reduce import allreduce_extremum, global_first_index, global_flat_index, lowest

_NN = torch._C._nn

# The canonical torch kernels the rules run on plain blocks, per spatial rank.
_MAX_WITH_INDICES = {1: torch.max_pool1d_with_indices, 2: _NN.max_pool2d_with_indices,
                     3: _NN.max_pool3d_with_indices}
_AVG: dict[int, Callable[..., torch.Tensor]] = {1: torch.avg_pool1d, 2: _NN.avg_pool2d,
                                                3: _NN.avg_pool3d}
_ADAPTIVE_AVG = {1: torch.adaptive_avg_pool1d, 2: _NN.adaptive_avg_pool2d,
                 3: _NN.adaptive_avg_pool3d}
_ADAPTIVE_MAX = {1: torch.adaptive_max_pool1d, 2: _NN.adaptive_max_pool2d,
                 3: _NN.adaptive_max_pool3d}


# -- shared helpers -----------------------------------------------------------------------------
def _expand(v, n: int) -> tuple[int, ...]:
    """An int or a sequence (of length 1 or n) as n ints, as torch reads them."""
    if isinstance(v, (tuple, list, torch.Size)):
        return tuple(int(a) for a in v) * (n if len(v) == 1 else 1)
    return (int(v),) * n


def _input(func, x) -> DomainTensor:
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: only the input may be a DomainTensor")
    return x


def _spatial(x: DomainTensor, nsp: int) -> list[int]:
    return list(range(x.ndim - nsp, x.ndim))


def _empty(local_shape, *tensors) -> bool:
    # torch's pools refuse empty non-batch dims: empty blocks take the placeholder path
    return 0 in tuple(local_shape) or any(t.numel() == 0 for t in tensors)


def _result(out, indices, out_dec, with_indices: bool):
    """Wrap the blocks on ``out_dec``; plain (replicated) tensors when it shards nothing."""
    wrap = (lambda t: DomainTensor(t, out_dec)) if out_dec.shard else (lambda t: t)
    return (wrap(out), wrap(indices)) if with_indices else wrap(out)


# -- max and avg pooling on a sliding window ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _SlidingPlan:
    """What a max or avg pool derives from layouts and arguments alone, made once
    per layout and arguments (``layout.planned``): its output layout and, where a
    spatial dim is sharded, each pooled dim's window plan and the global index of
    this rank's first gathered cell (``plans`` None: torch's pool on the block as
    it is, its padding included)."""
    out_dec: Decomposition
    plans: dict[int, window.AxisPlan] | None
    origins: tuple[int, ...] = ()


def _sliding_plan(key, x: DomainTensor, nsp: int, out_of: Callable[[torch.Tensor], torch.Tensor],
                  kernel, stride, padding, dilation) -> _SlidingPlan:
    """Local. The plan of a pool over ``x``, cached under ``key``: ``out_of`` runs the
    pool on ``x``'s meta stand-in (torch's argument checks, alike on every rank, and
    the output's shape)."""
    def make() -> _SlidingPlan:
        out_shape = tuple(out_of(stand_in(x)).shape)
        dec = x._dec
        if not _sharded_spatial(x, nsp):
            return _SlidingPlan(window.out_layout(dec, out_shape, {}), None)
        plans = {d: window.sliding(x.shape[d], window.block_sizes(dec, d), out_shape[d],
                                   kernel[i], stride[i], dilation[i], padding[i])
                 for i, d in enumerate(_spatial(x, nsp))}
        origins = tuple(p.need[window.coordinate(dec, d)][0] for d, p in plans.items())
        return _SlidingPlan(window.out_layout(dec, out_shape, plans), plans, origins)
    return layout.planned(key, make)


def _sharded_spatial(x: DomainTensor, nsp: int) -> list[int]:
    return [d for d in _spatial(x, nsp) if d in x._dec.shard]


def max_pool(x: DomainTensor, nsp: int, kernel, stride, padding, dilation, ceil_mode: bool,
             with_indices: bool = False):
    """Neighbour-wise collective. The max pool as a DomainTensor, and with
    ``with_indices`` its global flat indices as another (else None; a rank's
    indices are made global only when asked: that costs more than the pool)."""
    plan = _sliding_plan(("max_pool", nsp, x._dec, x.dtype, kernel, stride, padding, dilation,
                          ceil_mode), x, nsp,
                         lambda m: _MAX_WITH_INDICES[nsp](m, kernel, stride, padding, dilation,
                                                          ceil_mode)[0],
                         kernel, stride, padding, dilation)
    if plan.plans is None:
        cells, rest = x._local, (padding, dilation, ceil_mode)
    else:  # the gathered cells hold every window ceil_mode lets reach past the padding
        cells, rest = window.gather(x, plan.plans, fill=lowest(x.dtype)), (0, dilation, False)
    local_shape = plan.out_dec.local_shape()
    if _empty(local_shape, cells):
        out = window.placeholder(local_shape, cells, cells)
        return _result(out, out.detach().long(), plan.out_dec, with_indices)
    out, idx = _MAX_WITH_INDICES[nsp](cells, kernel, stride, *rest)
    if with_indices and plan.plans is not None:
        idx = global_flat_index(idx, cells.shape[-nsp:], plan.origins, x.shape[-nsp:])
    return _result(out, idx, plan.out_dec, with_indices)


def _window_sums(cells: torch.Tensor, nsp: int, kernel, stride) -> torch.Tensor:
    """Sums over every full window (no padding): avg_pool with divisor 1."""
    if nsp == 1:  # avg_pool1d has no divisor_override: as a 2-D pool of height 1
        return _NN.avg_pool2d(cells.unsqueeze(-2), (1, kernel[0]), (1, stride[0]), 0, False,
                              True, 1).squeeze(-2)
    return _AVG[nsp](cells, kernel, stride, 0, False, True, 1)


def _divisor_sizes(x: DomainTensor, nsp: int, out_dec, kernel, stride, padding,
                   count_include_pad: bool) -> tuple[tuple[int, ...], ...]:
    """Local. Per pooled dim, torch's divisor factor for each of this rank's outputs
    along it: the window ``[o*s - p, min(o*s - p + k, n + p))``, clipped to
    ``[0, n)`` when ``count_include_pad`` is False (the divisor is their product)."""
    offsets, counts = out_dec.offsets(), out_dec.local_shape()
    sizes = []
    for i, d in enumerate(_spatial(x, nsp)):
        n, k, s, p = x.shape[d], kernel[i], stride[i], padding[i]
        per_dim = []
        for o in range(offsets[d], offsets[d] + counts[d]):
            start = o * s - p
            end = min(start + k, n + p)
            if not count_include_pad:
                start, end = max(start, 0), min(end, n)
            per_dim.append(end - start)
        sizes.append(tuple(per_dim))
    return tuple(sizes)


def _divided(sums: torch.Tensor, sizes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """Local. ``sums`` over the divisors of ``_divisor_sizes``: one number where
    every window along every dim has the same size (the usual case), else their
    product over the dims as a tensor broadcast against the block."""
    if all(len(set(s)) == 1 for s in sizes):
        return sums / math.prod(s[0] for s in sizes)
    div: torch.Tensor | None = None
    for i, s in enumerate(sizes):
        shape = [1] * len(sizes)
        shape[i] = len(s)
        size = torch.tensor(s, dtype=sums.dtype, device=sums.device).reshape(shape)
        div = size if div is None else div * size
    assert div is not None  # a pool has at least one spatial dim
    return sums / div


def avg_pool(x: DomainTensor, nsp: int, kernel, stride, padding, ceil_mode: bool,
             count_include_pad: bool, divisor_override):
    """Neighbour-wise collective. The average pool as a DomainTensor."""
    extra = () if nsp == 1 else (divisor_override,)
    key = ("avg_pool", nsp, x._dec, x.dtype, kernel, stride, padding, ceil_mode,
           count_include_pad, divisor_override)
    plan = _sliding_plan(key, x, nsp,
                         lambda m: _AVG[nsp](m, kernel, stride, padding, ceil_mode,
                                             count_include_pad, *extra),
                         kernel, stride, padding, (1,) * nsp)
    out_dec, local = plan.out_dec, x._local
    if plan.plans is None:
        if _empty(out_dec.local_shape(), local):
            return DomainTensor(window.placeholder(out_dec.local_shape(), local, local), out_dec)
        return DomainTensor(_AVG[nsp](local, kernel, stride, padding, ceil_mode,
                                      count_include_pad, *extra), out_dec)
    cells = window.gather(x, plan.plans, fill=0.0)
    if _empty(out_dec.local_shape(), cells):
        return DomainTensor(window.placeholder(out_dec.local_shape(), cells, cells), out_dec)
    sums = _window_sums(cells, nsp, kernel, stride)
    if divisor_override:
        return DomainTensor(sums / divisor_override, out_dec)
    sizes = layout.planned(key + ("divisors",),
                           lambda: _divisor_sizes(x, nsp, out_dec, kernel, stride, padding,
                                                  count_include_pad))
    return DomainTensor(_divided(sums, sizes), out_dec)


# -- the rules ----------------------------------------------------------------------------------
_MAX_NAMES = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
              "return_indices")
_MAX_DEFAULTS = {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False,
                 "return_indices": False}
# callable -> (spatial dims, argument names, always returns indices)
_MAX_FUNCS: dict[Any, tuple[int, tuple[str, ...], bool]] = {}
for _n in (1, 2, 3):
    _MAX_FUNCS[getattr(F, f"max_pool{_n}d")] = (_n, _MAX_NAMES, False)  # boolean_dispatch
    _MAX_FUNCS[getattr(F, f"_max_pool{_n}d")] = (_n, _MAX_NAMES, False)
    _MAX_FUNCS[getattr(F, f"max_pool{_n}d_with_indices")] = (_n, _MAX_NAMES, True)
    _MAX_FUNCS[getattr(torch, f"max_pool{_n}d")] = (_n, _MAX_NAMES[:-1], False)
    _MAX_FUNCS[_MAX_WITH_INDICES[_n]] = (_n, _MAX_NAMES[:-1], True)


def _stride(stride, kernel, nsp):
    return kernel if stride is None or (isinstance(stride, (list, tuple)) and not stride) \
        else _expand(stride, nsp)


@register(*_MAX_FUNCS)
def max_pool_rule(func, args, kwargs):
    """Neighbour-wise collective (halo fill). Sharded on batch, channel and spatial dims;
    any kernel, stride, padding, dilation, ceil_mode; return_indices (global flat indices)."""
    nsp, names, always = _MAX_FUNCS[func]
    a = bind(func, args, kwargs, names, _MAX_DEFAULTS)
    x = _input(func, a["input"])
    kernel = _expand(a["kernel_size"], nsp)
    return max_pool(x, nsp, kernel, _stride(a["stride"], kernel, nsp),
                    _expand(a["padding"], nsp), _expand(a["dilation"], nsp),
                    bool(a["ceil_mode"]), always or bool(a.get("return_indices")))


_AVG_NAMES = ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
              "divisor_override")
_AVG_DEFAULTS = {"stride": None, "padding": 0, "ceil_mode": False, "count_include_pad": True}
_AVG_FUNCS = {F.avg_pool1d: 1, F.avg_pool2d: 2, F.avg_pool3d: 3}


@register(*_AVG_FUNCS)
def avg_pool_rule(func, args, kwargs):
    """Neighbour-wise collective (halo fill). Sharded on batch, channel and spatial dims;
    any kernel, stride, padding, ceil_mode, count_include_pad, divisor_override."""
    nsp = _AVG_FUNCS[func]
    names = _AVG_NAMES[:-1] if nsp == 1 else _AVG_NAMES
    a = bind(func, args, kwargs, names, _AVG_DEFAULTS)
    x = _input(func, a["input"])
    kernel = _expand(a["kernel_size"], nsp)
    return avg_pool(x, nsp, kernel, _stride(a["stride"], kernel, nsp),
                    _expand(a["padding"], nsp), bool(a["ceil_mode"]),
                    bool(a["count_include_pad"]), a.get("divisor_override"))


# -- adaptive pooling ---------------------------------------------------------------------------
def _max_over(x: DomainTensor, dims) -> torch.Tensor:
    """Collective over the grid axes of ``dims``. This block's maximum over ``dims``
    (kept, size 1), replicated along those axes, NaN where any is; the gradient goes to
    the first maximum (the last NaN) in the global raster order of ``dims``, as torch's
    adaptive max pool."""
    local, dec = x._local, x._dec
    comm = layout.comm_of(dec, dims)
    rest = [d for d in range(local.ndim) if d not in dims]
    keep = [1 if d in dims else s for d, s in enumerate(local.shape)]
    flat = local.permute(rest + list(dims)).reshape(
        [local.shape[d] for d in rest] + [math.prod(local.shape[d] for d in dims)])
    if flat.shape[-1] == 0:
        # + the (zero) sum of the empty block: the result stays in local's graph,
        # so every rank takes part in backward's collectives.
        values = torch.full(flat.shape[:-1] + (1,), lowest(local.dtype), dtype=local.dtype,
                            device=local.device) + flat.sum(-1, keepdim=True)
        where = torch.zeros(values.shape, dtype=torch.long, device=local.device)
    else:
        where = flat.argmax(-1, keepdim=True)
        # torch's max pools take the last NaN of a window (the first of tied maxima)
        nan = torch.isnan(flat) if flat.is_floating_point() else torch.zeros_like(flat, dtype=torch.bool)
        last = flat.shape[-1] - 1 - nan.flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
        where = torch.where(nan.any(-1, keepdim=True), last, where)
        values = flat.gather(-1, where)
        where = global_flat_index(where, [local.shape[d] for d in dims],
                                  [dec.offsets()[d] for d in dims], [x.shape[d] for d in dims])
    if comm.Get_size() == 1:
        return values.reshape(keep)
    best = allreduce_extremum(values, comm, "max")
    out = best
    if values.requires_grad and torch.is_grad_enabled():
        _, mine = global_first_index(values, best, where, comm, last_nan=True)
        shift = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
        out = best + ag.allreduce_sum(torch.where(mine, values - shift, torch.zeros_like(values)),
                                      comm)
    return out.reshape(keep)


def _reduce_to_one(x: DomainTensor, dims, kind: str) -> DomainTensor:
    """Collective over the grid axes of ``dims``. Mean or max over ``dims`` (kept,
    size 1), no longer sharded there."""
    dec = x._dec
    if kind == "avg":
        part = x._local.sum(dim=dims, keepdim=True)
        comm = layout.comm_of(dec, dims)
        if comm.Get_size() > 1:
            part = ag.allreduce_sum(part, comm)
        part = part / math.prod(x.shape[d] for d in dims)
    else:
        part = _max_over(x, dims)
    shape = [1 if d in dims else n for d, n in enumerate(x.shape)]
    kept = {d: a for d, a in dec.shard.items() if d not in dims}
    out_dec = layout.derive(dec, shape, kept, {d: dec.block_sizes(d) for d in kept})
    return DomainTensor(part, out_dec)


def adaptive_pool(func, x: DomainTensor, nsp: int, output_size, kind: str, indices: bool):
    """Local, neighbour-wise collective or collective (see the module docstring)."""
    # torch's Python wrapper resolves None entries of output_size. The max pool's
    # checks are the avg pool's; its meta kernel, unlike the avg pool's for output
    # size 1 (a decomposition into mean), does not import torch._dynamo (seconds).
    # (meta_call: cached per signature, the same layer is called alike every step)
    meta = meta_call(getattr(F, f"adaptive_max_pool{nsp}d_with_indices"), stand_in(x),
                     output_size)[0]
    out_shape = tuple(meta.shape)
    dec, sharded = x._dec, _sharded_spatial(x, nsp)
    ones = [d for d in sharded if out_shape[d] == 1 and x.shape[d] > 1]
    bad = [d for d in sharded if d not in ones and x.shape[d] % out_shape[d]]
    if bad:
        what = ", ".join(f"dim {d} (size {x.shape[d]}, output size {out_shape[d]})" for d in bad)
        raise UnsupportedOpError(
            f"{op_name(func)} on a DomainTensor sharded on {layout.sharded_dims_text(dec)}: "
            f"along a sharded dim the output size must be 1 or divide the size; {what} "
            f"does not. Pick an output size that divides it, or unshard the dim")
    if ones and indices:
        raise UnsupportedOpError(
            f"{op_name(func)} with return_indices on a DomainTensor sharded on "
            f"{layout.sharded_dims_text(dec)}: output size 1 along sharded dims {ones} is a "
            f"global reduction, which does not return indices")
    if ones and kind == "max":
        return _adaptive_max_in_order(x, nsp, out_shape)
    if ones:
        x = _reduce_to_one(x, ones, kind)
    return _adaptive_windows(x, nsp, out_shape, kind, indices)


def _adaptive_max_in_order(x: DomainTensor, nsp: int, out_shape) -> DomainTensor:
    """Collective. An adaptive max pool with output size 1 along some sharded dims:
    torch scans each window in raster order (the first of tied maxima, the last NaN
    win), so the inner dims are reduced first: the local windows, then the global
    maximum over every dim of output size 1, when these all come before the windowed
    dims (a global pool has none); the global maximum first otherwise."""
    spatial = _spatial(x, nsp)
    ones = [d for d in spatial if out_shape[d] == 1 and x.shape[d] > 1]
    windowed = [d for d in spatial if d not in ones and x.shape[d] != out_shape[d]]
    if windowed and max(ones) > min(windowed):
        return _adaptive_windows(_reduce_to_one(x, ones, "max"), nsp, out_shape, "max", False)
    inner = [x.shape[d] if d in ones else n for d, n in enumerate(out_shape)]
    return _reduce_to_one(_adaptive_windows(x, nsp, inner, "max", False), ones, "max")


def _adaptive_windows(x: DomainTensor, nsp: int, out_shape, kind: str, indices: bool):
    """Neighbour-wise collective. The adaptive pool where each sharded dim's output
    size divides its size: gathered windows, then torch's pool on the block."""
    spatial, dec = _spatial(x, nsp), x._dec
    torch_fn = _ADAPTIVE_AVG[nsp] if kind == "avg" else _ADAPTIVE_MAX[nsp]
    plans = {}
    for d in _sharded_spatial(x, nsp):
        if out_shape[d] != x.shape[d]:
            k = x.shape[d] // out_shape[d]
            plans[d] = window.sliding(x.shape[d], dec.block_sizes(d), out_shape[d], k, k, 1, 0)
    out_dec = window.out_layout(dec, out_shape, plans)
    cells = window.gather(x, plans) if plans else x._local
    local_shape = out_dec.local_shape()
    if _empty(local_shape, cells):
        out = window.placeholder(local_shape, cells, cells)
        return _result(out, out.detach().long(), out_dec, indices)
    sizes = [local_shape[d] for d in spatial]
    if kind == "avg":
        return _result(torch_fn(cells, sizes), None, out_dec, False)
    out, idx = torch_fn(cells, sizes)
    if indices:
        # a dim without a plan is the block itself (unsharded: offset 0)
        origins = [plans[d].need[window.coordinate(dec, d)][0] if d in plans
                   else dec.offsets()[d] for d in spatial]
        idx = global_flat_index(idx, cells.shape[-nsp:], origins, x.shape[-nsp:])
    return _result(out, idx, out_dec, indices)


# callable -> (spatial dims, kind, argument names, always indices)
_ADAPTIVE_FUNCS: dict[Any, tuple[int, str, tuple[str, ...], bool]] = {}
for _n in (1, 2, 3):
    for _f in {getattr(F, f"adaptive_avg_pool{_n}d"), _ADAPTIVE_AVG[_n]}:
        _ADAPTIVE_FUNCS[_f] = (_n, "avg", ("input", "output_size"), False)
    _ADAPTIVE_FUNCS[getattr(F, f"adaptive_max_pool{_n}d")] = (
        _n, "max", ("input", "output_size", "return_indices"), False)   # boolean_dispatch
    _ADAPTIVE_FUNCS[getattr(F, f"_adaptive_max_pool{_n}d")] = (
        _n, "max", ("input", "output_size", "return_indices"), False)
    _ADAPTIVE_FUNCS[getattr(F, f"adaptive_max_pool{_n}d_with_indices")] = (
        _n, "max", ("input", "output_size", "return_indices"), True)
    _ADAPTIVE_FUNCS[_ADAPTIVE_MAX[_n]] = (_n, "max", ("input", "output_size"), True)


@register(*_ADAPTIVE_FUNCS)
def adaptive_pool_rule(func, args, kwargs):
    """Collective (halo fill; allreduce for output size 1 along a sharded dim). Sharded
    on batch, channel and spatial dims where each sharded dim's output size is 1 or
    divides its size; return_indices (global flat indices) unless an output size is 1."""
    nsp, kind, names, always = _ADAPTIVE_FUNCS[func]
    a = bind(func, args, kwargs, names, {"return_indices": False})
    x = _input(func, a["input"])
    indices = always or bool(a.get("return_indices"))
    return adaptive_pool(func, x, nsp, a["output_size"], kind, indices)


# -- power-average pooling ----------------------------------------------------------------------
_LP_FUNCS = {F.lp_pool1d: 1, F.lp_pool2d: 2, F.lp_pool3d: 3}


@register(*_LP_FUNCS)
def lp_pool_rule(func, args, kwargs):
    """Neighbour-wise collective (halo fill). Sharded on batch, channel and spatial dims;
    any norm_type (inf too), kernel, stride, ceil_mode."""
    nsp = _LP_FUNCS[func]
    a = bind(func, args, kwargs, ("input", "norm_type", "kernel_size", "stride", "ceil_mode"),
             {"ceil_mode": False})
    x, p = _input(func, a["input"]), a["norm_type"]
    kernel = _expand(a["kernel_size"], nsp)
    stride, ceil_mode = _stride(a["stride"], kernel, nsp), bool(a["ceil_mode"])
    if p in (math.inf, -math.inf):  # torch: a max pool of |x| (negated for -inf)
        sign = 1 if p > 0 else -1
        out = max_pool(DomainTensor(sign * x._local.abs(), x._dec), nsp, kernel, stride,
                       (0,) * nsp, (1,) * nsp, ceil_mode)
        return DomainTensor(sign * out._local, out._dec)
    out = avg_pool(DomainTensor(x._local.pow(p), x._dec), nsp, kernel, stride, (0,) * nsp,
                   ceil_mode, True, None)
    o = out._local
    return DomainTensor((torch.sign(o) * F.relu(torch.abs(o))).mul(math.prod(kernel))
                        .pow(1.0 / p), out._dec)
