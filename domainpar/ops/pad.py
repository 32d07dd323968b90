"""F.pad on DomainTensors: constant, reflect, replicate and circular, along any
dims, sharded ones included (this is also how nn.ConvNd's padding_mode reaches
us: it pads with F.pad, then convolves with no padding).

Along an unsharded dim torch pads the block. Along a sharded dim the padding
lands on the edge blocks: coordinate 0 grows by the low width, the last one by
the high width, the others keep their blocks. Output cell ``j`` copies input
cell ``j - lo`` mapped into the domain:

- constant: no source (the value); no message at all, unless the edge blocks
  would grow past 1.25 times a balanced block (a spectrum sliced to a few modes
  on one rank, padded back to its full length): then the output is cut into
  balanced blocks, each holding the input cells in its range, moved there by
  one repartition (its adjoint the reverse one) that carries input cells only;
- reflect: ``-i`` below the domain, ``2 (n - 1) - i`` above;
- replicate: clamped to the end cells;
- circular: wrapped around, through a halo exchange that wraps on any grid
  (the grid axis need not be periodic).

A zero pad at high ends only that makes its input at least 8 times larger (a
spectrum's few kept modes padded back to the whole spectrum) is a ``Deferred``
(``tensor/deferred.py``) that keeps a copy of its input: it is computed at its
first use, and a transform that it feeds takes the copy instead, its zeros
being the transform's own padding (``ops/fft.py``).

The edge ranks take the cells they need by a halo fill (which reaches past
neighbours whose blocks are narrower than the padding) and pick them with an
index_select, whose backward adds each padded cell's gradient into its source.
Negative widths (cropping) along a sharded dim are refused in constant and
circular mode (circular wraps the cropped tensor, so its sources would move):
slice instead. Reflect and replicate take them (the cropped end reads no source).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from ..autograd import repartition
from ..comm.decomposition import balanced_sizes
from ..tensor import layout
from ..tensor.deferred import Deferred
from ..tensor.dispatch import UnsupportedOpError, op_name, register
from ..tensor.domain_tensor import DomainTensor
from . import window
from .common import bind, stand_in

_MODES = ("constant", "reflect", "replicate", "circular")
# A deferred zero pad's mark on its result: (a copy of its input, the widened dims).
_PADDED_FROM = "_zero_padded_from"
_DEFER = 8  # a zero pad to at least this many times its input is deferred


@functools.lru_cache(maxsize=1024)
def _plan(mode: str, n: int, in_sizes: tuple[int, ...], lo: int, hi: int):
    """(AxisPlan, source index of every output cell in unwrapped global indices)."""
    j = np.arange(n + lo + hi, dtype=np.int64)
    i = j - lo
    if mode == "reflect":
        src = np.where(i < 0, -i, np.where(i >= n, 2 * (n - 1) - i, i))
    elif mode == "replicate":
        src = np.clip(i, 0, n - 1)
    else:  # circular: the halo fill wraps, so the source stays unwrapped
        src = i
    plan = window.plan_axis(src, src, i, in_sizes)
    return plan, src


def _pads_by_dim(pad, ndim: int) -> dict[int, tuple[int, int]]:
    """torch's flat pad list (last dim first) as ``{dim: (lo, hi)}``."""
    return {ndim - 1 - k: (int(pad[2 * k]), int(pad[2 * k + 1])) for k in range(len(pad) // 2)}


def _flat(pads: dict[int, tuple[int, int]], ndim: int, length: int) -> list[int]:
    """``{dim: (lo, hi)}`` as torch's flat list of ``length`` entries (the caller's:
    non-constant modes accept only certain lengths per input rank)."""
    out = []
    for d in reversed(range(ndim)):
        out += list(pads.get(d, (0, 0)))
    return out[:length]


# A constant pad along a sharded dim puts the new cells on the edge blocks, unless
# that leaves the largest block more than this many times the balanced one: then
# the output is cut into balanced blocks (a spectrum sliced to a few modes on one
# rank and padded back to full length would otherwise leave every later op's work,
# an FFT's included, on the last rank).
_EDGE_SLACK = 1.25


@functools.lru_cache(maxsize=1024)
def _constant_plan(n: int, in_sizes: tuple[int, ...], lo: int, hi: int):
    """(input block sizes, per-block (lo, hi) widths, output block sizes) of a
    constant pad by ``(lo, hi)`` of a dim of ``n`` cells cut into ``in_sizes``:
    the edge blocks grow, or, when that is too unbalanced (``_EDGE_SLACK``), the
    output is balanced and each block holds the input cells inside its range.
    Cached: a model pads the same layout every step."""
    edge = list(in_sizes)
    edge[0] += lo
    edge[-1] += hi
    even = balanced_sizes(n + lo + hi, len(in_sizes))
    if max(edge) <= _EDGE_SLACK * max(even):
        widths = [(lo if k == 0 else 0, hi if k == len(edge) - 1 else 0)
                  for k in range(len(edge))]
        return tuple(in_sizes), tuple(widths), tuple(edge)
    stops = np.cumsum(even)
    starts = stops - np.asarray(even)
    first = np.clip(starts - lo, 0, n)           # input cells each output block holds
    last = np.clip(stops - lo, 0, n)
    widths = [(int(max(0, min(b, lo) - a)), int(max(0, b - max(a, lo + n))))
              for a, b in zip(starts, stops)]
    return tuple(int(v) for v in last - first), tuple(widths), even


def _constant(x: DomainTensor, pads: dict[int, tuple[int, int]], sharded, out_shape,
              length: int, value) -> DomainTensor:
    """Constant-mode pad. Local, or collective (one repartition, moving input cells
    only) where the output is balanced (``_constant_plan``). Zeros at high ends
    only, to at least ``_DEFER`` times the input: a Deferred (module docstring)."""
    dec = x._dec
    plans = {d: _constant_plan(x.shape[d], tuple(dec.block_sizes(d)), lo, hi)
             for d, (lo, hi) in sharded.items()}
    held = layout.derive(dec, x.shape, dec.shard,
                         {d: plans[d][0] if d in plans else dec.block_sizes(d)
                          for d in dec.shard})
    local_pads = {d: p for d, p in pads.items() if d not in sharded}
    local_pads.update({d: p[1][window.coordinate(dec, d)] for d, p in plans.items()})
    out_dec = window.out_layout(dec, out_shape, {d: p[2] for d, p in plans.items()})

    def padded(block: torch.Tensor) -> torch.Tensor:
        return torch._C._nn.pad(repartition(block, dec, held), _flat(local_pads, x.ndim, length),
                                "constant", value)
    widened = tuple(d for d, p in pads.items() if p != (0, 0))
    if not value and widened and all(pads[d][0] == 0 and pads[d][1] > 0 for d in widened) \
            and _DEFER * math.prod(x.shape) <= math.prod(out_shape):
        snapshot = DomainTensor(x._local.clone(), dec)  # later writes into x do not reach it
        result = Deferred(out_dec, x.dtype, x.device, lambda: padded(snapshot._local))
        setattr(result, _PADDED_FROM, (snapshot, widened))
        return result
    return DomainTensor(padded(x._local), out_dec)


def deferred_input(t: DomainTensor) -> tuple[DomainTensor, tuple[int, ...]] | None:
    """Local. (a copy of its input, the dims it widened) where ``t`` is a deferred
    zero pad whose block is not computed yet; else None."""
    mark = getattr(t, _PADDED_FROM, None)
    return mark if mark is not None and isinstance(t, Deferred) and t._block is None else None


# -- zero tails: a tensor known to hold zeros past some index of some dims -------------------
_ZEROS_PAST = "_zeros_past"


def mark_zeros_past(t: DomainTensor, ends: dict[int, int]) -> None:
    """Local. Record that ``t`` holds zeros past index ``ends[d]`` along each dim ``d``
    (a factory's zero buffer written below those ends, ``nn/factories.py``), for as
    long as its block is not written again."""
    if ends:
        setattr(t, _ZEROS_PAST, (dict(ends), t._local._version))


def zeros_past(t: DomainTensor) -> dict[int, int]:
    """Local. ``{dim: end}``: ``t`` holds zeros past ``end`` along ``dim`` (``{}``
    when nothing is known, or ``t`` was written since it was marked)."""
    mark = getattr(t, _ZEROS_PAST, None)  # (marked on computed blocks only)
    if mark is None:
        return {}
    ends, version = mark
    return ends if t._local._version == version else {}


@register(F.pad, torch.nn.functional.pad, torch._C._nn.pad)
def pad(func, args, kwargs):
    """Local along unsharded dims; neighbour-wise collective (halo fill) along sharded
    dims for reflect, replicate and circular (any grid); for constant none, or one
    repartition where the edge blocks would grow too unbalanced (output balanced)."""
    a = bind(func, args, kwargs, ("input", "pad", "mode", "value"), {"mode": "constant"})
    x, mode, value = a["input"], a["mode"], a["value"]
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: only the input may be a DomainTensor")
    # torch's own checks (mode, pad length, widths against sizes) on the global shape
    widths = tuple(a["pad"]) if isinstance(a["pad"], (list, tuple)) else a["pad"]
    out_shape = layout.planned(("pad", x._dec, x.dtype, widths, mode, value), lambda: tuple(
        torch._C._nn.pad(stand_in(x), a["pad"], mode, value).shape))
    dec = x._dec
    pads = _pads_by_dim(a["pad"], x.ndim)
    sharded = {d: p for d, p in pads.items() if d in dec.shard and p != (0, 0)}
    local = x._local
    for d, (lo, hi) in sharded.items():
        if (lo < 0 or hi < 0) and mode in ("constant", "circular"):
            raise UnsupportedOpError(
                f"{op_name(func)}: negative padding {pads[d]} (cropping) of dim {d} in "
                f"{mode} mode, sharded on {layout.sharded_dims_text(dec)}; slice the tensor "
                f"instead")
    if mode == "constant":
        return _constant(x, pads, sharded, out_shape, len(a["pad"]), value)

    unsharded = {d: p for d, p in pads.items() if d not in sharded}
    if any(p != (0, 0) for p in unsharded.values()):
        flat = _flat(unsharded, x.ndim, len(a['pad']))
        if local.numel():
            local = torch._C._nn.pad(local, flat, mode)
        else:  # torch refuses to reflect an empty block; its padded block is empty too
            # (``unsharded`` also holds sharded dims whose padding is zero)
            shape = [n + sum(unsharded.get(d, (0, 0))) for d, n in enumerate(local.shape)]
            local = window.placeholder(shape, local, local)
    if not sharded:
        return DomainTensor(local, window.out_layout(dec, out_shape))
    # the block padded along its unsharded dims, before the sharded ones
    stage = window.out_layout(dec, tuple(out_shape[d] if d not in sharded else x.shape[d]
                                         for d in range(x.ndim)))
    plans, sources = {}, {}
    for d, (lo, hi) in sharded.items():
        plans[d], sources[d] = _plan(mode, x.shape[d], dec.block_sizes(d), lo, hi)
    cells = window.gather(DomainTensor(local, stage), plans,
                          wrap=tuple(sharded) if mode == "circular" else ())
    for d, p in plans.items():
        coord = window.coordinate(dec, d)
        o0, first = p.out_offsets[coord], p.need[coord][0]
        index = sources[d][o0:o0 + p.out_sizes[coord]] - first
        if not (len(index) == cells.shape[d] and np.array_equal(index, np.arange(len(index)))):
            cells = cells.index_select(d, torch.as_tensor(index, device=cells.device))
    return DomainTensor(cells, window.out_layout(dec, out_shape, plans))
