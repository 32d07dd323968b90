"""Interpolation (``F.interpolate``, ``nn.Upsample``) on inputs sharded along the
batch dim and any spatial dims.

Every mode torch has is separable: along each spatial dim, output ``j`` is a
weighted sum of a few input cells ("taps"), the same for every position along
the other dims. So each rank gathers the input cells its outputs read
(``window.gather``: one halo fill over all sharded dims), then applies the taps
one dim at a time (an ``index_select`` per tap, weighted and summed). Autograd
records those local ops; the halo fill's backward returns ghost gradients to
their owners.

Where the taps come from: torch itself. Its index and weight arithmetic
differs per mode, per dtype (float32 kernels compute source positions in
float32: bilinear 18 -> 29 reads cells 15 and 16 of a float32 input where
float64 reads 16 alone) and between versions; a re-derivation would be right
only to rounding, and a rounding difference at a ``floor`` picks another cell.
Instead we run torch's own op, with the caller's arguments, on probe tensors
whose other spatial dims are 2 -> 2 (an exact copy in every mode): cell ``i``
of probe ``r`` holds 1 (or ``i``) where ``i % P == r``, which reads off each
output's taps and weights while no two taps of one output share a residue. A
random probe checks them against torch to its own rounding, and ``P`` doubles
until it holds (``P >= n`` is the identity probe, exact by construction).
Probes are cached per (dim size, arguments, dtype, device).

Linear modes along whole trailing dims: torch's own kernels. Taps along every
dim copy the field once per tap and dim (an ``index_select`` and an
``addcmul_`` each), and along the innermost dim ``index_select`` is a gather;
torch's kernels do a dim's taps in one pass. So in modes linear, bilinear and
trilinear (no antialias) the last spatial dim, where it is not cut, goes to
torch's own linear kernel, and the last two, where neither is cut and their
planes hold more than 1024 input cells, to its bilinear kernel, in one call on
the cells viewed as ``(N, C x the other dims, ...)`` with the caller's size or
scale factor, align_corners and recompute_scale_factor for those dims (whole
dims: the global op's taps there); taps cover the rest. With no dim cut,
torch's op runs on the block as it is, but a trilinear one takes that path
too. Measured on torch 2.13.0, CPU, one thread, float32, 2x up-sampling, per
output cell (forward; forward + backward):

- along the last dim: taps 17-34 ns (21-37), torch's linear kernel 1.0-1.2 ns
  (5.6-5.9), for lines of 16 to 2048 cells;
- along the last two: taps 7-9.5 ns (12-15); torch's bilinear kernel 2.1-2.4 ns
  (8.9-9.3) on planes of more than 1024 cells, 10-14 ns (17-21) on planes of
  1024 or fewer (28^2 to 32^2), where the taps along H and torch's linear kernel
  along W are faster: 1x8x32^3 -> 64^3 6.9 ms (15.9), against 14.0 (23.4) by
  taps alone and 18.1 (32.3) by taps along D and the bilinear kernel; on
  1x8x64^3 -> 128^3 the bilinear kernel gives 33.8 ms (152), taps alone 158 (254),
  torch's trilinear 154 (354).

Nearest modes along whole dims, on large blocks: torch's own nearest kernel.
The taps of a nearest mode select cells, and along the innermost dim
``index_select`` is a gather, so tapping every dim of a large block takes a
multiple of torch's time. There the cut dims take their taps (a selection
each), then one call of torch's nearest op over every spatial dim
(``nearest_pass``) applies the caller's size or scale factor along the whole
dims and the identity (the size kept, or scale 1) along the cut ones. Measured
on B (torch 2.13.0, one thread, float32, 2x up, the dim of size 32 or 256 cut
over the ranks; taps -> this, ms): 1x16x256^2 on one rank 25.0 -> 4.6 (forward
and backward 33.0 -> 17.0), on two 11.1 -> 3.0; 1x8x64^3 on two 35.5 -> 14.5
(50 -> 36-42); 1x8x32^3 on one 6.2 -> 3.3, on two (blocks of 2^17 cells) 2.0
-> 2.1 (4.1 -> 4.8); blocks of 2^15 cells 0.7-0.8 -> 0.9-1.1. So blocks of
``NEAREST_CELLS`` (2^18) input cells or more take it, smaller ones the taps;
floating dtypes only (torch's nearest kernels take few others). Both are
exact selections: the result is torch's, bit for bit, on every rank whichever
way its block goes.

The linear kernel runs first (on the fewest cells), the bilinear one last
(after the taps along D, measured faster than before them) unless it shrinks its
dims. The result differs from torch's by rounding only (sums of products taken
in another order), as the taps' does.

Output layout: output ``j`` goes to the rank holding the input cell nearest to
its taps' weighted centre (``window.plan_axis`` anchors), so a 2x upsample of
an even layout stays even.

Supported: modes nearest, nearest-exact, linear, bilinear, bicubic, trilinear,
area; ``size`` or ``scale_factor`` (scalar or per dim); ``align_corners``;
``recompute_scale_factor``; ``antialias`` (bilinear, bicubic). With no spatial
dim sharded, torch runs on the local block as it is (trilinear: see above).

Refused (UnsupportedOpError on every rank), with a spatial dim sharded unless
said otherwise: the channel dim 1 sharded (always); modes other than nearest
and nearest-exact on non-floating dtypes (torch's integer kernels round in
their own way); antialias with an output width of 1 and a resized height
(torch's kernel copies its first output row there: no reference to match).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, op_name, register
from ..tensor.domain_tensor import DomainTensor
from . import window
from .common import bind, meta_call, stand_in

_NAMES = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor",
          "antialias")
_DEFAULTS = {"mode": "nearest", "antialias": False}
_SELECTING = ("nearest", "nearest-exact")  # modes whose taps are pure selections
_LINEAR = ("linear", "bilinear", "trilinear")  # torch's kernel by the number of dims it takes
PLANE = 1024  # torch's bilinear kernel is fast on planes of more input cells (module docstring)
NEAREST_CELLS = 1 << 18  # torch's nearest kernel is faster on blocks of at least as many cells


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: taps() caches them
class Taps:
    """One dim of an interpolation: output ``j`` is ``sum_k weight[k, j] *
    input[index[k, j]]`` (``index`` sorted along ``k``; padding taps repeat the
    first with weight 0)."""
    index: np.ndarray   # (K, m) int64
    weight: np.ndarray  # (K, m) in the probe dtype
    plan_args: tuple[np.ndarray, np.ndarray, np.ndarray]  # (first, last, anchor) for plan_axis


def _probe_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch decides indices and weights in: float64 for float64,
    otherwise float32 (its opmath type for float32, float16 and bfloat16; and
    nearest modes, the only ones we allow on integers, compute in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run(vectors: torch.Tensor, nsp: int, axis: int, arg, by_size: bool, mode: str,
         align_corners, recompute, antialias: bool) -> torch.Tensor:
    """torch's interpolation along spatial dim ``axis`` of each row of ``vectors``
    (B, n) -> (B, m); every other spatial dim is 2 -> 2, an exact copy in every
    mode (1 -> 1 is not: torch 2.13's antialiased kernels misread a last dim of 1)."""
    shape = [vectors.shape[0], 1] + [1] * nsp
    shape[2 + axis] = vectors.shape[1]
    full = [2] * nsp
    full[axis] = vectors.shape[1]
    kw: dict[str, Any]
    if by_size:
        size = [2] * nsp
        size[axis] = arg
        kw = {"size": size}
    else:
        scale = [1.0] * nsp
        scale[axis] = arg
        kw = {"scale_factor": scale, "recompute_scale_factor": recompute}
    probe = vectors.reshape(shape).expand(*shape[:2], *full).contiguous()
    out = F.interpolate(probe, mode=mode, align_corners=align_corners, antialias=antialias, **kw)
    pick: list[Any] = [slice(None), 0] + [0] * nsp
    pick[2 + axis] = slice(None)
    return out[tuple(pick)]


@functools.lru_cache(maxsize=512)
def taps(n: int, nsp: int, axis: int, arg, by_size: bool, mode: str, align_corners,
         recompute, antialias: bool, dtype: torch.dtype, device: str) -> Taps:
    """Local (every rank computes the same). The taps torch uses along spatial dim
    ``axis`` (input size ``n``) for these arguments, read off probes (module
    docstring) in ``dtype`` on ``device``."""
    run = functools.partial(_run, nsp=nsp, axis=axis, arg=arg, by_size=by_size, mode=mode,
                            align_corners=align_corners, recompute=recompute,
                            antialias=antialias)
    g = torch.Generator().manual_seed(1234)
    check = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(dtype).double()
    i = torch.arange(n, dtype=torch.float64)
    eps = torch.finfo(dtype).eps
    p = 4
    while True:
        p = min(p, n)
        residue = torch.arange(n) % p
        ones = (residue[None, :] == torch.arange(p)[:, None]).to(torch.float64)
        rows = torch.cat([ones, ones * i, check[None]]).to(dtype=dtype, device=device)
        out = run(rows).to(device="cpu", dtype=torch.float64)
        w, v, got = out[:p], out[p:2 * p], out[2 * p]
        nz = w != 0
        if p == n:  # one cell per residue: the identity probe, exact
            index = torch.arange(n)[:, None].expand(n, w.shape[1]).clone()
            break
        index = torch.where(nz, torch.round(v / torch.where(nz, w, 1.0)), 0.0).long()
        index = index.clamp(0, n - 1)
        # Two taps of one output in one residue class would merge into one wrong
        # tap: the check probe then differs from torch beyond torch's own rounding
        # (a sum of at most p products), unless the merged weights are below it.
        want = (w * check[index]).sum(0)
        bound = 4 * (p + 2) * eps * ((w.abs() * check[index]).sum(0) + got.abs())
        if bool(((index % p == torch.arange(p)[:, None]) | ~nz).all()) and \
                bool(((want - got).abs() <= bound).all()):
            break
        p *= 2
    # Sort each output's taps by index, zero weights (taps it does not read) last.
    key = torch.where(nz, index, n + index)
    order = key.argsort(0)
    index, w, nz = index.gather(0, order), w.gather(0, order), nz.gather(0, order)
    count = nz.sum(0)
    k = max(int(count.max()) if count.numel() else 0, 1)  # area allows an empty output
    index, w, nz = index[:k], w[:k], nz[:k]
    index = torch.where(nz, index, index[:1])
    w = torch.where(nz, w, 0.0)
    first = index[0]
    last = index.gather(0, (count - 1).clamp(min=0)[None])[0]
    centre = (w * index).sum(0) / torch.where(w.sum(0) != 0, w.sum(0), 1.0)
    anchor = np.maximum.accumulate(np.clip(np.floor(centre.numpy() + 0.5), 0, n - 1))
    weight = w.numpy().astype(np.float64 if dtype == torch.float64 else np.float32)
    return Taps(index.numpy(), weight, (first.numpy(), last.numpy(), anchor.astype(np.int64)))


@functools.lru_cache(maxsize=512)
def _plan(t: Taps, in_sizes: tuple[int, ...]) -> window.AxisPlan:
    return window.plan_axis(*t.plan_args, in_sizes)


@functools.lru_cache(maxsize=1024)
def local_taps(t: Taps, start: int, stop: int, first: int, length: int, dtype: torch.dtype,
               device: str):
    """Local. This rank's taps as tensors ``(index, weight)``: outputs ``[start,
    stop)``, indices relative to its gathered cells (``length`` of them, from
    global input cell ``first``); ``weight`` None for a pure selection, and None
    for both when the taps copy the cells as they are (n -> n nearest, say)."""
    rel = t.index[:, start:stop] - first
    w = t.weight[:, start:stop]
    selection = rel.shape[0] == 1 and bool((w == 1).all())
    if selection and length == stop - start and (rel[0] == np.arange(length)).all():
        return None, None
    index = torch.as_tensor(rel, device=device)
    weight = None if selection else torch.as_tensor(w, device=device).to(dtype)
    return index, weight


def apply_taps(cells: torch.Tensor, d: int, index, weight) -> torch.Tensor:
    """Local. The taps (``local_taps``) along dim ``d`` of ``cells``. The weighted
    sum accumulates in place into the first tap's selection (a new tensor, which
    no backward reads): two tensors of the output's size per tap rather than four,
    and fewer fresh pages for glibc to fault in where they pass its mmap threshold."""
    if index is None:
        return cells
    shape = [1] * cells.ndim
    shape[d] = -1
    out = cells.index_select(d, index[0])
    if weight is None:
        return out
    out.mul_(weight[0].view(shape))
    for k in range(1, index.shape[0]):
        out.addcmul_(cells.index_select(d, index[k]), weight[k].view(shape))
    return out


def _per_dim(value, nsp: int) -> list:
    return list(value) if isinstance(value, (tuple, list, torch.Size)) else [value] * nsp


def _per_spatial_dim(opts: dict, nsp: int) -> tuple[bool, list]:
    """Whether ``opts`` gives sizes (else scale factors), and each spatial dim's."""
    by_size = opts.get("size") is not None
    return by_size, ([int(s) for s in _per_dim(opts["size"], nsp)] if by_size
                     else [float(s) for s in _per_dim(opts["scale_factor"], nsp)])


def dim_taps(shape, dtype: torch.dtype, device, opts: dict,
             dims: Sequence[int] | None = None) -> dict[int, Taps]:
    """Local. ``{dim: Taps}`` for the spatial dims ``dims`` (default: every one) of an
    input of global ``shape`` under ``F.interpolate`` options ``opts`` (size,
    scale_factor, mode, align_corners, recompute_scale_factor, antialias)."""
    nsp = len(shape) - 2
    by_size, per_dim = _per_spatial_dim(opts, nsp)
    return {d: taps(shape[d], nsp, d - 2, per_dim[d - 2], by_size, opts.get("mode", "nearest"),
                    opts.get("align_corners"), opts.get("recompute_scale_factor"),
                    bool(opts.get("antialias")), _probe_dtype(dtype), str(device))
            for d in (range(2, len(shape)) if dims is None else dims)}


def kernel_dims(dec, mode: str, antialias: bool) -> tuple[int, ...]:
    """Local. The trailing spatial dims that torch's own linear or bilinear kernel
    interpolates (module docstring): the last one where it is not sharded, and the
    one before it too where that is not sharded either and their planes hold more
    than ``PLANE`` cells; none for other modes and for antialias."""
    if mode not in _LINEAR or antialias:
        return ()
    dims: list[int] = []
    for d in reversed(range(2, dec.ndim)):
        if d in dec.shard or len(dims) == 2:
            break
        dims.insert(0, d)
    if len(dims) == 2 and dec.global_shape[dims[0]] * dec.global_shape[dims[1]] <= PLANE:
        dims = dims[1:]
    return tuple(dims)


def kernel_pass(cells: torch.Tensor, dims: tuple[int, ...], opts: dict,
                out_sizes: Sequence[int]) -> torch.Tensor:
    """Local. torch's linear (one dim) or bilinear (two) interpolation along the whole
    trailing spatial dims ``dims`` of ``cells`` (to ``out_sizes``), in one call on them
    viewed as ``(N, C x the other dims, *dims)``, with ``opts``' arguments for those dims."""
    lead = cells.shape[:cells.ndim - len(dims)]
    if cells.numel() == 0:  # torch's kernels refuse empty inputs; the graph must still be built
        return window.placeholder(tuple(lead) + tuple(out_sizes), cells, cells)
    by_size, per_dim = _per_spatial_dim(opts, cells.ndim - 2)
    picked = [per_dim[d - 2] for d in dims]
    kw = {"size": picked} if by_size else \
        {"scale_factor": picked, "recompute_scale_factor": opts.get("recompute_scale_factor")}
    flat = cells.reshape(lead[0], math.prod(lead[1:]), *cells.shape[len(lead):])
    out = F.interpolate(flat, mode=_LINEAR[len(dims) - 1],
                        align_corners=opts.get("align_corners"), **kw)
    return out.reshape(*lead, *out.shape[2:])


def nearest_pass(cells: torch.Tensor, tapped: Sequence[int], opts: dict,
                 out_shape: Sequence[int]) -> torch.Tensor:
    """Local. torch's own kernel of a nearest mode over every spatial dim of ``cells``
    at once: the caller's size or scale factor (and recompute_scale_factor) along
    the whole dims (to their sizes in the global ``out_shape``), the identity along
    the dims ``tapped``, whose taps already ran (their size kept, or scale 1:
    output ``j`` reads cell ``j`` in both nearest modes)."""
    dims = range(2, cells.ndim)
    if cells.numel() == 0:  # torch's kernels refuse empty inputs; the graph must still be built
        shape = list(cells.shape[:2]) + [cells.shape[d] if d in tapped else out_shape[d]
                                         for d in dims]
        return window.placeholder(shape, cells, cells)
    by_size, per_dim = _per_spatial_dim(opts, cells.ndim - 2)
    if by_size:
        kw: dict = {"size": [cells.shape[d] if d in tapped else per_dim[d - 2] for d in dims]}
    else:
        kw = {"scale_factor": [1.0 if d in tapped else per_dim[d - 2] for d in dims],
              "recompute_scale_factor": opts.get("recompute_scale_factor")}
    return F.interpolate(cells, mode=opts["mode"], **kw)


@register(F.interpolate)
def interpolate(func, args, kwargs):
    """Neighbour-wise collective (halo fill) when a spatial dim is sharded, else local.
    Sharded on batch and spatial dims; modes nearest, nearest-exact, (bi/tri)linear,
    bicubic, area; size or scale_factor; align_corners; recompute_scale_factor;
    antialias."""
    a = bind(func, args, kwargs, _NAMES, _DEFAULTS)
    x = a["input"]
    opts = {k: a[k] for k in _NAMES[1:]}
    # torch's own checks and output shape, from the global shape on every rank alike
    out_shape = tuple(meta_call(func, stand_in(x), **opts).shape)
    dec = x._dec
    if 1 in dec.shard:
        raise UnsupportedOpError(
            f"{op_name(func)}: the channel dim 1 is sharded ({layout.sharded_dims_text(dec)}); "
            f"redistribute so that channels are whole on every rank")
    spatial = [d for d in range(2, x.ndim) if d in dec.shard]
    mode = a["mode"]
    # nearest modes on large blocks: taps along the cut dims, then torch's nearest
    # kernel on all at once (module docstring)
    nearest = mode in _SELECTING and x.dtype.is_floating_point and \
        x._local.numel() >= NEAREST_CELLS
    kernel = tuple(d for d in range(2, x.ndim) if d not in dec.shard) if nearest else \
        kernel_dims(dec, mode, bool(a["antialias"]))
    if not spatial and (mode != "trilinear" or not kernel):  # torch's op on the block
        return DomainTensor(func(x._local, **opts), window.out_layout(dec, out_shape))
    if spatial:
        _refuse(func, x, a, out_shape)
    tapped = [d for d in range(2, x.ndim) if d not in kernel]
    all_taps = dim_taps(x.shape, x.dtype, x.device, opts, tapped)
    plans = {d: _plan(t, window.block_sizes(dec, d)) for d, t in all_taps.items()}
    out_dec = window.out_layout(dec, out_shape, plans)

    cells = window.gather(x, plans)
    # Shrinking dims first (the later passes then work on fewer cells), innermost
    # first among the rest: index_select along an outer dim copies whole rows, the
    # fast case, so it is best kept for the largest tensors (4x on a 2x trilinear).
    # torch's linear kernel goes first, its bilinear one last unless it shrinks its dims.
    kernel_first = not nearest and (len(kernel) == 1 or math.prod(
        out_shape[d] for d in kernel) < math.prod(x.shape[d] for d in kernel))
    if kernel and kernel_first:
        cells = kernel_pass(cells, kernel, opts, [out_shape[d] for d in kernel])
    for d in sorted(plans, key=lambda d: (out_shape[d] > x.shape[d], -d)):
        p, c = plans[d], window.coordinate(dec, d)
        start = p.out_offsets[c]
        first, stop = p.need[c]
        index, weight = local_taps(all_taps[d], start, start + p.out_sizes[c], first,
                                   stop - first, x.dtype, str(x.device))
        cells = apply_taps(cells, d, index, weight)
    if kernel and nearest:
        cells = nearest_pass(cells, tapped, opts, out_shape)
    elif kernel and not kernel_first:
        cells = kernel_pass(cells, kernel, opts, [out_shape[d] for d in kernel])
    return DomainTensor(cells, out_dec)


def _refuse(func, x: DomainTensor, a: dict, out_shape) -> None:
    """Raise UnsupportedOpError (alike on every rank) for what is refused with a
    spatial dim sharded (module docstring)."""
    mode, dec = a["mode"], x._dec
    if not (x.dtype.is_floating_point or mode in _SELECTING):
        raise UnsupportedOpError(
            f"{op_name(func)}: mode {mode!r} on {x.dtype} with sharded spatial dims "
            f"({layout.sharded_dims_text(dec)}) is not supported; use a floating dtype")

    if a["antialias"] and out_shape[-1] == 1 and out_shape[-2] != x.shape[-2]:
        raise UnsupportedOpError(
            f"{op_name(func)}: antialias=True with an output width of 1 and a resized height "
            f"is refused on sharded spatial dims: torch's own kernel copies the first output "
            f"row there (torch {torch.__version__}), so there is no reference to match")
