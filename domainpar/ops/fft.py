"""Distributed FFTs: torch.fft's fft, ifft, rfft, irfft, hfft and ihfft, in their
1-D, 2-D and n-D forms, on real and complex DomainTensors along any dims.

Method
------
An n-D transform is a chain of 1-D transforms, one per transform dim, each
with its own length (``n``/``s``: zero padding or trimming) and its share of the
normalisation (``norm`` scales every dim alike). A 1-D transform needs its dim
whole on every rank, so the plan (``_plan``) alternates local transforms and
transposes:

1. Transform the pending dims that are local now, in one ``torch.fft`` call
   (for the order of the real-to-complex and complex-to-real dims, see below).
2. When the dim that must go next is sharded, move its grid axis onto another
   dim (a repartition, i.e. an alltoallv; its adjoint is the reverse alltoallv):
   the lowest dim this call already transformed; else the largest other
   pending dim that is local (it is moved again later: one more alltoallv, but
   the result stays sharded on a frequency dim); else the largest dim the call
   does not transform (ties: the lowest). A dim is a
   candidate only if it is not cut already and has at least as many
   elements as the grid axis has ranks, so that no rank is left without work
   (a smaller dim would concentrate the tensor on a few ranks).
3. Repeat until every dim is transformed.

The real-to-complex transform (rfft, ihfft: on the last transform dim) goes
first, as its input is real; the complex-to-real one (irfft, hfft: on the last
transform dim) goes last, as its output is. ``n``/``s`` are applied along a dim
while it is local, inside the ``torch.fft`` call that transforms it (rfft's
by ``halfspec``: its backward stays on the half spectrum). The plan
depends on layouts and shapes only, so every rank derives the same one without
a message. Nothing is ever gathered: per-rank memory stays O(N/P).

Output layout
-------------
Dims that are already local keep their layout (their sizes change only where
``n``/``s`` or the half spectrum change them); a transform dim that was
sharded comes out whole, and the dim that took its grid axis (step 2) comes
out sharded with balanced blocks. Examples, with x sharded on H:

- ``y = rfft2(x)`` (dims H, W) comes out sharded on dim W (the frequencies,
  W // 2 + 1 of them), and ``irfft2(y, s=(H, W))`` comes back sharded on H;
- ``fftn`` over (X, Y, Z) of a field sharded on X (axis 0) and Y (axis 1) comes
  out sharded on Z (axis 0) and X (axis 1), and ``ifftn`` brings back X (axis 0)
  and Y (axis 1).

In both, each axis went onto a dim the forward had transformed, and the
inverse moves it back by the same rule: the forward's input layout returns,
with balanced blocks. ``rfft2`` of x sharded on W (the real-to-complex dim,
which goes first, before any dim is done) moves W's axis onto H, then, to
transform H, onto W's frequencies: two alltoallvs, and the result is sharded
on W's frequencies as in the first example; ``irfft2`` then brings it to H. An
axis that went onto a dim the call does not transform (step 2's last choice)
stays there: the inverse finds every dim it transforms local. A dim
sharded on a grid axis of one rank counts as local and stays sharded.

Slices of a spectrum
--------------------
An FNO keeps a few low modes of a spectrum and drops the rest, by slicing the
transform's result. Where a forward transform (not c2r) still has a transpose
ahead after its first phases, its result is a ``Deferred`` (``tensor/deferred.py``):
those phases run at once (the r2c dim always in a phase of its own, so that this
holds on one rank too), the rest at the result's first use. A slice of it
(``x_ft[..., :m1, :m2]``: slices and Ellipsis only) cuts the dims transformed so
far before the transpose, so only the kept cells travel and the remaining
transforms run on them; its other dims are sliced after. Slices that cut those
dims alike (``x_ft[..., :m, :m]`` and ``x_ft[..., -m:, :m]``) share one transpose.
A narrowed dim then takes the grid axis where it can (the plan of step 2 on the
narrowed sizes, balanced blocks); where no dim can, the whole spectrum answers.
An ``fftshift``/``ifftshift`` of such a result is in transit too (neuraloperator
shifts before it takes the centre band): a slice of it slices the other dims
first, rolls what that keeps, and slices the shifted dims after. Such a slice
is a copy where one process has a view, so a write into it or into the spectrum
is refused (``tensor/aliasing.py``). Any other use of the
result computes it whole, at the same call on every rank; after that, slices
index it as any tensor.

The inverse: a transform of a zero pad that ``F.pad`` deferred (zeros at the
high ends of transform dims only, at least 8 times the input: ``ops/pad.py``)
transforms the pad's input (a copy of it, made at the pad) with the same
lengths, as torch pads (or trims) a transform's input with those zeros
itself: the zeros are neither made, moved nor transformed. A pad already
computed (used otherwise first, or written) is transformed as it is. Likewise
a factory's zero buffer written below some end of a dim (``buf[..., :m] = v``
inside ``sharded_factories``: ``pad.zeros_past``, kept by an ``fftshift`` of
other dims, forgotten at the next write) is transformed up to that end. A c2r dim whose input is
narrower than its half spectrum goes last, in a phase of its own, so the other
dims are transformed over the narrow input only (torch would pad it first).

fftshift / ifftshift
--------------------
``torch.fft.fftshift`` and ``ifftshift`` are rolls by ``n // 2`` and
``-(n // 2)`` along the given dims (every dim when ``dim`` is None): they go to
the roll rule (``ops.index.roll``), local along unsharded dims and, along a
sharded dim, two slices cat'ed back onto the input's layout.

No free dim: transform dims over every grid axis
------------------------------------------------
When a sharded transform dim's axis has nowhere to go (step 2 finds no dim:
``rfft2`` of a ``(1, 1, H, W)`` field cut on H and W over a 2x2 grid), the
transform dims that are cut are first merged onto the lowest of them, cut over
all their grid axes together (``ProcessGrid.merged``, one alltoallv): H over
4 ranks, W whole (where that fails too, every cut dim's axes are merged onto
the largest cut dim the call does not transform: ``rfft`` along H of that field
cuts W over 4 ranks). The plan then runs on that grid (W, then H with the merged
axis moved onto W's frequencies), and the result goes back to the input's grid
and cut dims, balanced (H on axis 0, the frequencies of W on axis 1): one more
alltoallv, and ``irfft2`` of it takes the same path back. A dim cut on a grid
axis of one process is whole: it is local, and where no other dim can take a
moving axis, that axis moves onto it (rfft2 of a ``(1, 1, H, W)`` field on a
3x1 grid: H's axis goes onto W's frequencies).

Refused (UnsupportedOpError on every rank)
------------------------------------------
- a sharded transform dim whose grid axis no other dim can take (step 2) even
  after merging the cut transform dims: a 1-D tensor, or every other dim
  sharded already or smaller than the number of ranks on that axis. Add a batch
  or channel dim, shard another dim, or use fewer ranks on that axis (a
  distributed four-step 1-D FFT is not provided);
- ``out=``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from ..tensor import aliasing, layout
from ..tensor.deferred import Deferred
from ..tensor.dispatch import TAKES_DEFERRED, UnsupportedOpError, op_name, register
from ..tensor.domain_tensor import DomainTensor
from . import halfspec, index, pad, window
from .common import bind, normalize_dims


@dataclasses.dataclass(frozen=True)
class _Family:
    """The local calls of one transform family: ``half`` for the group that holds the
    last transform dim when that dim is real-to-complex or complex-to-real (``kind``),
    ``full`` (complex to complex) for the others."""
    kind: str | None  # None (c2c), "r2c" (goes first) or "c2r" (goes last)
    half: Callable[..., torch.Tensor]
    full: Callable[..., torch.Tensor]


_FAMILIES = {
    "fft": _Family(None, torch.fft.fftn, torch.fft.fftn),
    "ifft": _Family(None, torch.fft.ifftn, torch.fft.ifftn),
    "rfft": _Family("r2c", halfspec.rfftn, torch.fft.fftn),
    "ihfft": _Family("r2c", torch.fft.ihfftn, torch.fft.ifftn),
    "irfft": _Family("c2r", torch.fft.irfftn, torch.fft.ifftn),
    "hfft": _Family("c2r", torch.fft.hfftn, torch.fft.fftn),
}
# torch.fft callable -> (family, form, name): form "1" takes n and dim, "2" and "n" take s
# and dim. (The callables' own names, ``fft_fft`` ..., are not the ones users write.)
_FORMS = {getattr(torch.fft, name + suffix): (name, form, f"torch.fft.{name}{suffix}")
          for name in _FAMILIES for suffix, form in (("", "1"), ("2", "2"), ("n", "n"))}


# -- the plan ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Phase:
    """Move the block to ``src`` (a repartition; None: stay), then transform ``dims``
    (the c2r/r2c dim last) with lengths ``lengths``; the result is laid out by ``dst``."""
    src: Decomposition | None
    dims: tuple[int, ...]
    lengths: tuple[int, ...]
    half: bool
    dst: Decomposition


def _local(dec: Decomposition, d: int) -> bool:
    return d not in dec.shard or dec.grid.dims[dec.shard[d]] == 1


def _target(func, dec: Decomposition, d: int, done, pending) -> int:
    """The dim that takes ``d``'s grid axis (module docstring, step 2)."""
    axis = dec.shard[d]
    ranks = dec.grid.dims[axis]
    shape = dec.global_shape
    # Dims on no axis first; a dim on an axis of one process (whole, but it keeps
    # that axis where it can) only when none is left.
    for free in ([t for t in range(dec.ndim) if t != d and t not in dec.shard],
                 [t for t in range(dec.ndim) if t != d and not layout.cut(dec, t)]):
        free = [t for t in free if shape[t] >= ranks]
        # A transform dim before any other: the result then comes out sharded on a
        # frequency dim, where the channel mixing that follows a transform (an FNO's
        # einsum) stays local; on the channels it would contract a sharded dim.
        tiers = ([t for t in free if t in done],
                 sorted((t for t in free if t in pending), key=lambda t: (-shape[t], t)),
                 sorted((t for t in free if t not in pending), key=lambda t: (-shape[t], t)))
        for tier in tiers:
            if tier:
                return min(tier) if tier is tiers[0] else tier[0]
    raise UnsupportedOpError(
        f"{_FORMS[func][2]} on a DomainTensor of shape {tuple(shape)} sharded on "
        f"{layout.sharded_dims_text(dec)}: transforming dim {d} needs it whole on every rank, "
        f"and no other dim can take its grid axis {axis}: each is sharded already or has fewer "
        f"than the {ranks} ranks of that axis. Add a batch or channel dim of at least {ranks}, "
        f"shard another dim (redistribute), or use fewer ranks on grid axis {axis}")


def _moved(dec: Decomposition, d: int, t: int) -> Decomposition:
    """``dec`` with ``d``'s grid axis on ``t`` (balanced blocks) and ``d`` whole."""
    shard = {k: a for k, a in dec.shard.items() if k != d}
    shard[t] = dec.shard[d]
    sizes = {k: dec.block_sizes(k) for k in shard if k != t}
    return layout.derive(dec, dec.global_shape, shard, sizes)


def _transformed(dec: Decomposition, out_sizes: dict[int, int]) -> Decomposition:
    """``dec`` after local transforms resize the dims in ``out_sizes``."""
    shape = list(dec.global_shape)
    for d, n in out_sizes.items():
        shape[d] = n
    sizes = {k: ((shape[k],) if k in out_sizes else dec.block_sizes(k)) for k in dec.shard}
    return layout.derive(dec, shape, dec.shard, sizes)


def _plan(func, dec: Decomposition, dims, lengths, out_lengths, kind,
          done: tuple[int, ...] = (), split: bool = False) -> list[_Phase]:
    """The phases of a transform over ``dims`` (torch's order; the half dim last)
    with input lengths ``lengths`` (c2r: output lengths) and output sizes
    ``out_lengths``; ``done``: dims an earlier part of the call transformed;
    ``split``: the half dim in a phase of its own (module docstring, "Slices of
    a spectrum")."""
    length = dict(zip(dims, lengths))
    out_length = dict(zip(dims, out_lengths))
    half = dims[-1] if kind else None
    pending, phases = list(dims), []
    finished = list(done)
    while pending:
        src = None
        if kind == "r2c" and half is not None and half in pending:
            if not _local(dec, half):
                src = dec = _moved(dec, half, _target(func, dec, half, finished, pending))
            group = [half] if split else \
                [d for d in pending if d != half and _local(dec, d)] + [half]
        elif all(_local(dec, d) for d in pending):
            group = [d for d in pending if d != half] if split and kind == "c2r" and \
                len(pending) > 1 else list(pending)
        else:
            full = [d for d in pending if d != half]
            group = [d for d in full if _local(dec, d)]
            if not group:
                d = full[0] if full else half
                assert d is not None  # only the half dim is left
                src = dec = _moved(dec, d, _target(func, dec, d, finished, pending))
                group = [d]
        dst = _transformed(dec, {d: out_length[d] for d in group})
        phases.append(_Phase(src, tuple(group), tuple(length[d] for d in group),
                             half in group, dst))
        dec = dst
        finished += group
        pending = [d for d in pending if d not in group]
    return phases


# -- the rule -------------------------------------------------------------------------------------
def _dims_and_lengths(x: DomainTensor, form: str, a: dict, kind, out_shape):
    """Transform dims in torch's order and each one's length (the c2r dim: its output
    length), resolved as torch does (torch has checked the arguments on ``out_shape``)."""
    ndim = x.ndim
    if form == "1":
        dims, s = [a["dim"]], [a["n"]]
    else:
        dim, s = a["dim"], a["s"]
        if dim is None:
            dims = list(range(ndim)) if s is None else list(range(ndim - len(s), ndim))
        else:
            dims = [dim] if isinstance(dim, int) else list(dim)
        s = [None] * len(dims) if s is None else list(s)
    dims = [d % ndim for d in dims]
    lengths = [x.shape[d] if n is None or n == -1 else int(n) for d, n in zip(dims, s)]
    if kind == "c2r":
        lengths[-1] = out_shape[dims[-1]]
    return tuple(dims), tuple(lengths), tuple(out_shape[d] for d in dims)


@register(*_FORMS)
def fft(func, args, kwargs):
    """Collective (alltoallv transposes) when a transform dim is sharded, local otherwise.
    fft, ifft, rfft, irfft, hfft, ihfft and their 2-D and n-D forms: any dims, n / s
    (padding, trimming), norm; real or complex input; output layout in ``ops.fft``.
    A slice of the result moves only the cells it keeps; a zero pad is not moved."""
    family, form, name = _FORMS[func]
    names = ("input", "n", "dim", "norm") if form == "1" else ("input", "s", "dim", "norm")
    a = bind(func, args, kwargs, names + ("out",),
             {"dim": -1 if form == "1" else ((-2, -1) if form == "2" else None)})
    x = a.pop("input")
    if a.pop("out") is not None:
        raise UnsupportedOpError(f"{name}: out= is not supported on DomainTensors")
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{name}: only the input may be a DomainTensor")
    # torch's own argument checks, output shape and dtype, on the global shape
    probe = func(torch.empty(x.shape, dtype=x.dtype, device="meta"), **a)
    fam = _FAMILIES[family]
    dims, lengths, out_lengths = _dims_and_lengths(x, form, a, fam.kind, tuple(probe.shape))
    x = _unpadded(x, dims)
    # the r2c dim alone first, so that a slice can narrow it before the others; the
    # c2r dim alone last where its input is narrower than its half spectrum (torch
    # would pad it first and transform the other dims over the zeros too)
    split = fam.kind == "r2c" or (fam.kind == "c2r" and
                                  x.shape[dims[-1]] < lengths[-1] // 2 + 1)
    local, dec = x._local, x._dec
    phases, start = _phases(func, dec, dims, lengths, out_lengths, fam.kind, split)
    if start is not None:
        local, dec = ag.repartition(local, dec, start), start
    moves = [k for k, phase in enumerate(phases) if phase.src is not None]
    head = moves[0] if moves else 1  # the phases before the first transpose
    if start is None and 0 < head < len(phases) and fam.kind != "c2r":
        return _deferred(func, fam, a["norm"], (local, dec), phases[:head], phases[head:],
                         (dims, lengths, out_lengths, probe.dtype))
    local, dec = _run(fam, a["norm"], local, dec, phases)
    if start is not None:  # back to the input's grid and cut dims, balanced
        xd = x._dec
        back = layout.derive(xd, dec.global_shape, xd.shard,
                             {k: xd.block_sizes(k) for k in xd.shard if k not in dims})
        local, dec = ag.repartition(local, dec, back), back
    return DomainTensor(local, dec)


TAKES_DEFERRED.update(_FORMS)  # a deferred zero pad reaches the rule as it is (``_unpadded``)


def _run(fam: _Family, norm, local: torch.Tensor, dec: Decomposition, phases):
    """Collective (the phases' repartitions). The block and layout after ``phases``."""
    for phase in phases:
        if phase.src is not None:
            local = ag.repartition(local, dec, phase.src)
        call = fam.half if phase.half else fam.full
        options = dict(s=phase.lengths, dim=phase.dims, norm=norm)
        if local.numel():
            local = call(local, **options)
        else:  # torch's FFT backends refuse empty blocks; the graph must still be built
            meta = call(torch.empty(local.shape, dtype=local.dtype, device="meta"), **options)
            like = torch.empty((), dtype=meta.dtype, device=local.device)
            local = window.placeholder(meta.shape, like, local)
        dec = phase.dst
    return local, dec


def _deferred(func, fam: _Family, norm, start, head, tail, call) -> Deferred:
    """The transform's result as a Deferred: ``head`` (local phases) runs now, ``tail``
    (from the first transpose on) at first use, or only for what a slice takes
    (module docstring, "Slices of a spectrum")."""
    dims, lengths, out_lengths, dtype = call
    local, dec = _run(fam, norm, start[0], start[1], head)
    done = tuple(d for phase in head for d in phase.dims)
    rest = [k for k, d in enumerate(dims) if d not in done]
    # the r2c dim goes in the first phase; the c2r dim in the last
    left = (tuple(dims[k] for k in rest), tuple(lengths[k] for k in rest),
            tuple(out_lengths[k] for k in rest), None if fam.kind == "r2c" else fam.kind)
    cache: dict = {}

    def take(whole: Deferred, key) -> DomainTensor | None:
        return _take(func, fam, norm, (local, dec), done, left, cache, whole, key)

    return Deferred(tail[-1].dst, dtype, local.device,
                    lambda: _run(fam, norm, local, dec, tail)[0], take)


# why a slice taken in transit refuses writes (``aliasing.mark_copied``)
_COPIED = "a slice of a spectrum taken before the transform's transposes"


def _take(func, fam: _Family, norm, start, done, left, cache, whole: Deferred, key):
    """``whole[key]``, where ``whole`` is the Deferred of a transform whose phases
    after ``done`` are still to run: the slices of the dims it no longer transforms
    go first, and only what they keep travels; None where nothing is sliced there
    (or a plan on the slices is refused: the whole spectrum then answers)."""
    dims, lengths, out_lengths, kind = left
    shape = whole._dec.global_shape
    per = index.slices_of(torch.Tensor.__getitem__, key, shape)
    if per is None:
        return None
    first = {d: s for d, s in enumerate(per) if d not in dims and s != (0, shape[d], 1)}
    if not first:
        return None
    tag = tuple(sorted(first.items()))
    if tag not in cache:
        local, dec = start
        with whole.as_made():
            for d, (lo, hi, step) in first.items():
                local, dec = index.slice_dim(local, dec, d, lo, hi, step)
        try:
            phases = _plan(func, dec, dims, lengths, out_lengths, kind, done)
        except UnsupportedOpError:
            return None
        with whole.as_made():  # cached for later slices: the graph of the transform's call
            cache[tag] = DomainTensor(*_run(fam, norm, local, dec, phases))
    then = tuple(slice(None) if d in first else slice(*s) for d, s in enumerate(per))
    out = index.getitem(torch.Tensor.__getitem__, (cache[tag], then), {})
    aliasing.mark_copied(whole, out, _COPIED)
    return out


def _unpadded(x: DomainTensor, dims) -> DomainTensor:
    """What ``x`` holds without its zero tails along transform dims, which a transform
    of given lengths pads (or trims) with alike: the input of a deferred zero pad
    (``ops/pad.py``) not computed yet that widened only transform dims; or ``x``
    up to the ends past which it is known to hold zeros (``pad.zeros_past``: a
    factory's zero buffer written below them). Else ``x``."""
    deferred = pad.deferred_input(x)
    if deferred is not None:
        source, widened = deferred
        return source if set(widened) <= set(dims) else x
    trim = {d: end for d, end in pad.zeros_past(x).items() if d in dims}
    if not trim:
        return x
    local, dec = x._local, x._dec  # zeros past the ends: a transform's own padding
    for d, end in trim.items():
        local, dec = index.slice_dim(local, dec, d, 0, end, 1)
    return DomainTensor(local, dec)


def _phases(func, dec: Decomposition, dims, lengths, out_lengths, kind, split):
    """The plan, and None; or, where no dim can take a cut transform dim's grid
    axis, the plan from a layout ``start`` on a merged grid, and ``start``."""
    try:
        return _plan(func, dec, dims, lengths, out_lengths, kind, split=split), None
    except UnsupportedOpError as refusal:
        for start in _merged_starts(dec, dims):
            try:
                return _plan(func, start, dims, lengths, out_lengths, kind, split=split), start
            except UnsupportedOpError:
                continue
        raise refusal from None


def _merged_starts(dec: Decomposition, dims):
    """Layouts to start from when the plan finds no free dim (module docstring):
    the cut transform dims' axes merged onto the first of them; then every cut
    dim's axes merged onto the largest cut dim the call does not transform."""
    cut = [d for d in range(dec.ndim) if layout.cut(dec, d)]
    ours = [d for d in cut if d in dims]
    if len(ours) > 1:
        yield layout.merged(dec, ours, ours[0])
    others = sorted((d for d in cut if d not in dims), key=lambda d: (-dec.global_shape[d], d))
    if others and ours:
        yield layout.merged(dec, cut, others[0])


# -- fftshift, ifftshift --------------------------------------------------------------------------
@register(torch.fft.fftshift, torch.fft.ifftshift)
def fftshift(func, args, kwargs):
    """Local along unsharded dims; along a sharded dim a roll (repartitions, no gather).
    fftshift rolls by n // 2, ifftshift by -(n // 2); dim (int, sequence or None: all)."""
    a = bind(func, args, kwargs, ("input", "dim"))
    x, dim = a["input"], a["dim"]
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: only the input may be a DomainTensor")
    # torch's own argument checks (dims out of range ...) on the global shape
    func(torch.empty(x.shape, dtype=x.dtype, device="meta"), dim)
    dims = normalize_dims(dim, x.ndim) if dim is None or isinstance(dim, int) else \
        [d % x.ndim for d in dim]
    if x.ndim == 0 or not dims:
        return DomainTensor(x._local.clone(), x._dec)
    sign = 1 if func is torch.fft.fftshift else -1
    shifts = [sign * (x.shape[d] // 2) for d in dims]
    if isinstance(x, Deferred) and x.narrows:
        return _shifted_in_transit(x, shifts, list(dims))
    out = index.roll(torch.roll, (x, shifts, list(dims)), {})
    # zeros past an end of a dim not shifted stay there (neuraloperator shifts its buffer)
    pad.mark_zeros_past(out, {d: e for d, e in pad.zeros_past(x).items() if d not in dims})
    return out


TAKES_DEFERRED.update((torch.fft.fftshift, torch.fft.ifftshift))


def _shifted_in_transit(x: Deferred, shifts, dims) -> Deferred:
    """The shift of a spectrum in transit, in transit too: a slice of it slices the
    other dims of ``x`` first (``x.narrowed``), rolls what that keeps, and slices the
    shifted dims after (a roll commutes with slicing other dims)."""
    def roll(t: DomainTensor) -> DomainTensor:
        return index.roll(torch.roll, (t, shifts, dims), {})

    def take(whole: Deferred, key):
        per = index.slices_of(torch.Tensor.__getitem__, key, whole._dec.global_shape)
        if per is None:
            return None
        first = tuple(slice(None) if d in dims else slice(*s) for d, s in enumerate(per))
        narrow = x.narrowed(first)
        if narrow is None:
            return None
        then = tuple(slice(*s) if d in dims else slice(None) for d, s in enumerate(per))
        with whole.as_made():  # the roll was the shift's call
            rolled = roll(narrow)
        out = index.getitem(torch.Tensor.__getitem__, (rolled, then), {})
        aliasing.mark_copied(whole, out, _COPIED)
        return out

    return Deferred(x._dec, x.dtype, x.device, lambda: roll(x)._local, take)
