"""Shared by the windowed op families (conv, pool, pad, resample): which output
cells each rank owns, which input cells it needs, and how it gets them.

Along one dim, a windowed op is described by three arrays over the global
output indices ``j``:

- ``first[j]``, ``last[j]``: the global input cells output ``j`` reads
  (indices below 0 or past the end are padding);
- ``anchor[j]``, non-decreasing: the input cell output ``j`` is attached to.

Output ``j`` goes to the rank whose input block holds ``anchor[j]``: the first
output of coordinate ``c`` is the first ``j`` with ``anchor[j] >= offset[c]``.
For a sliding window (conv, pooling) the anchor is the window's centre cell,
clipped to the input: ``j * s`` for a stride-``s`` conv padded by half its
reach, so a 'same' conv keeps its input's layout and a strided one gets
``ceil(offset / s)``, and a valid conv after explicit padding (nn.Conv's
circular, reflect and replicate modes) gets back the layout from before the
padding rather than one shifted by it. The output layout follows from the input
layout and the op's arguments alone, the same on every rank without a message,
also where strides do not divide the block offsets.

A rank then needs the input cells ``[min first, max last]`` of its outputs:
its block plus ghost cells on either side (its own widths may be negative:
cells it does not need). Every rank pads its block by the same widths, the
largest any rank needs, so one ``HaloExchange`` fills them (reaching past
small neighbours where it must); each rank then cuts out the range it needs.

``AxisPlan`` holds this for one dim and every grid coordinate; ``gather``
does the padding, the exchange and the cut for a DomainTensor. Plans and
exchanges are cached: a model calls the same layer on the same layout every
step.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from .. import autograd as ag
from ..comm import HaloExchange
from ..comm.decomposition import Decomposition
from ..tensor import layout
from ..tensor.domain_tensor import DomainTensor


@dataclasses.dataclass(frozen=True)
class AxisPlan:
    """One dim of a windowed op, for every grid coordinate along its axis.

    ``out_sizes[c]``: the output block of coordinate ``c``; ``lo``, ``hi``: the
    ghost widths every rank pads its input block by; ``need[c] = (first, stop)``:
    the global input range ``[first, stop)`` coordinate ``c`` reads (empty when
    its output block is).
    """
    out_sizes: tuple[int, ...]
    out_offsets: tuple[int, ...]
    in_offsets: tuple[int, ...]
    lo: int
    hi: int
    need: tuple[tuple[int, int], ...]

    def window(self, c: int) -> tuple[int, int]:
        """(start, length) of coordinate ``c``'s needed range within its padded block."""
        first, stop = self.need[c]
        return first - (self.in_offsets[c] - self.lo), stop - first


def plan_axis(first: npt.ArrayLike, last: npt.ArrayLike, anchor: npt.ArrayLike | None,
              in_sizes: Iterable[int], starts: npt.ArrayLike | None = None) -> AxisPlan:
    """The plan for one dim from the per-output arrays (module docstring) and the
    input block sizes along it. ``starts[c]``, the first output of coordinate
    ``c``, is derived from ``anchor``, or given instead of it where ownership is
    known beforehand (the transposed conv: see ``ops/conv_transpose.transposed_plan``)."""
    firsts, lasts = np.asarray(first, np.int64), np.asarray(last, np.int64)
    sizes = [int(s) for s in in_sizes]
    in_offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    m = len(firsts)
    if starts is None:
        found = np.searchsorted(np.asarray(anchor, np.int64), in_offsets, side="left")
        found[0] = 0
        starts = found
    begins = np.asarray(starts, np.int64)
    stops = np.append(begins[1:], m)
    lo = hi = 0
    need = []
    for c, (o0, o1) in enumerate(zip(begins, stops)):
        if o1 <= o0:
            need.append((int(in_offsets[c]), int(in_offsets[c])))
            continue
        f, s = int(firsts[o0:o1].min()), int(lasts[o0:o1].max()) + 1
        need.append((f, s))
        lo = max(lo, int(in_offsets[c]) - f)
        hi = max(hi, s - int(in_offsets[c]) - sizes[c])
    return AxisPlan(out_sizes=tuple(int(b - a) for a, b in zip(begins, stops)),
                    out_offsets=tuple(int(a) for a in begins),
                    in_offsets=tuple(int(a) for a in in_offsets), lo=lo, hi=hi,
                    need=tuple(need))


@functools.lru_cache(maxsize=1024)
def sliding(n: int, in_sizes: tuple[int, ...], m: int, kernel: int, stride: int,
            dilation: int, pad_lo: int) -> AxisPlan:
    """A sliding window (conv, pooling): output ``j`` reads ``kernel`` cells
    ``dilation`` apart from ``j * stride - pad_lo``, anchored at the window's
    centre cell (the lower of two), clipped to the input."""
    j = np.arange(m, dtype=np.int64)
    first = j * stride - pad_lo
    last = first + dilation * (kernel - 1)
    return plan_axis(first, last, np.clip((first + last) // 2, 0, max(n - 1, 0)), in_sizes)


# -- moving the cells -------------------------------------------------------------------
_EXCHANGES: collections.OrderedDict = collections.OrderedDict()
_MAX_EXCHANGES = 256


def cached_exchanges() -> list:
    """Local. The HaloExchanges the windowed ops have built and keep (oldest
    first), for benchmarks that settle their tuning before timing
    (``HaloExchange.settle``)."""
    return list(_EXCHANGES.values())


def exchange(dec: Decomposition, widths: Mapping[int, tuple[int, int]],
             wraps: Mapping[int, bool]) -> HaloExchange:
    """A cached HaloExchange (its plans keep buffers and persistent requests)."""
    key = (dec, tuple(sorted(widths.items())), tuple(sorted(wraps.items())))
    halo = _EXCHANGES.get(key)
    if halo is None:
        # Every rank derives the same widths from layouts it shares: no agreement check.
        halo = HaloExchange(dec, dict(widths), dict(wraps), check=False)
        _EXCHANGES[key] = halo
        if len(_EXCHANGES) > _MAX_EXCHANGES:
            _EXCHANGES.popitem(last=False)
    else:
        _EXCHANGES.move_to_end(key)
    return halo


def out_layout(dec: Decomposition, out_shape: Sequence[int],
               sizes: Mapping[int, AxisPlan | Sequence[int]] | None = None) -> Decomposition:
    """A windowed op's output layout: the input's sharding carried over, with the
    block sizes of ``sizes`` (``{dim: AxisPlan or block sizes}``) where given and
    the input's elsewhere. Derived alike on every rank, no message."""
    sizes = sizes or {}
    blocks = {}
    for d in dec.shard:
        s = sizes.get(d, dec.block_sizes(d))
        blocks[d] = s.out_sizes if isinstance(s, AxisPlan) else tuple(s)
    return layout.derive(dec, out_shape, dec.shard, blocks)


def coordinate(dec: Decomposition, dim: int) -> int:
    """This rank's grid coordinate along ``dim``'s axis (0 for an unsharded dim)."""
    axis = dec.axis_of(dim)
    return 0 if axis is None else dec.grid.coords[axis]


def block_sizes(dec: Decomposition, dim: int) -> tuple[int, ...]:
    """Block sizes along ``dim`` (one block, the whole dim, when it is unsharded)."""
    return dec.block_sizes(dim) if dim in dec.shard else (dec.global_shape[dim],)


def gather(x: DomainTensor, plans: Mapping[int, AxisPlan], *, fill: float = 0.0,
           wrap: Sequence[int] = ()) -> torch.Tensor:
    """Neighbour-wise collective over the sharded dims among ``plans``. This
    rank's input cells for its outputs: along each dim of ``plans`` the range
    ``need[c]`` of global indices, other dims the block as it is.

    Cells outside the domain hold ``fill``, except along the sharded dims in
    ``wrap``, where they wrap around (periodic); zero padding stays zero on a
    periodic grid. Differentiable: the backward accumulates ghost gradients
    into their owners.
    """
    dec, local = x._dec, x._local
    widths = {d: (p.lo, p.hi) for d, p in plans.items() if p.lo or p.hi}
    if widths:
        pads = []
        for d in reversed(range(local.ndim)):
            pads += list(widths.get(d, (0, 0)))
        local = F.pad(local, pads, value=fill)
        exchanged = {d: w for d, w in widths.items() if d in dec.shard}
        if exchanged:
            wraps = {d: d in wrap for d in dec.shard}
            local = ag.halo_fill(local, exchange(dec, widths, wraps), owned=True)
    for d, p in plans.items():
        start, length = p.window(coordinate(dec, d))
        if (start, length) != (0, local.shape[d]):
            local = local.narrow(d, start, length)
    return local


def placeholder(shape: Sequence[int], like: torch.Tensor, *sources) -> torch.Tensor:
    """Zeros of ``shape`` that are still in the autograd graph of ``sources``.

    A rank whose output block is empty (or gets no contribution of its own) must
    still build the same graph as the others: the collective backward of the
    exchanges and parameter broadcasts that fed it runs on every rank or on none.
    """
    z = torch.zeros(tuple(shape), dtype=like.dtype, device=like.device)
    for s in sources:
        if isinstance(s, torch.Tensor) and s.requires_grad:
            zero = s.flatten()[:0].sum()
            # (.real: a complex source of a real block, without torch's warning)
            z = z + (zero.real if zero.is_complex() and not z.is_complex() else zero).to(z.dtype)
    return z
