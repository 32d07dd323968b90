"""Distributed FFTs: torch.fft's fft, ifft, rfft, irfft, hfft and ihfft, in their
1-D, 2-D and n-D forms, on real and complex DomainTensors along any dims.

Method
------
An n-D transform is a chain of 1-D transforms, one per transform dim, each
with its own length (``n``/``s``: zero padding or trimming) and its share of the
normalisation (``norm`` scales every dim alike). A 1-D transform needs its dim
whole on every rank, so the plan (``ops/fftplan.py``) alternates local transforms and
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
Where the slice keeps few modes of every dim still to transform that is cut
(``k`` of ``n`` over ``P`` ranks, ``2 k P <= n``), no transpose runs: a band
(``ops/fftband.py``) multiplies each rank's block by the kept rows of the DFT
matrix and sums the partial spectra in one allreduce. The result is replicated
along those dims' grid axes (``k`` lines on every rank); the band also holds the
kept modes' reflection, so that an FNO's two slices (``[:m]``, ``[-m:]``) share it.
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

Replicated in, sharded out
--------------------------
A transform of an input replicated along a grid axis of more than one rank (a
band after an FNO's channel mixing, padded back to the field's spectrum) whose
plan has no transpose cuts that axis onto the first dim it transforms with at
least as many elements as the axis has ranks, right after the phase that
transforms it, where a later phase follows: the later phases run on this rank's
block only, and the result comes out cut there, balanced. The cut sends nothing
(each rank keeps its block of what it holds whole: ``comm.collectives``'
repartition); its adjoint gathers the blocks' gradients. A c2r transform of such
an input runs its c2r dim in a phase of its own for this: ``irfft2`` of the FNO's
band transforms H whole, cuts H, and runs the c2r transform along W on the
block. A transform of one phase stays replicated. ``DOMAINPAR_FFT_BANDS=0``
turns this and the bands off.

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
from . import fftband, fftplan, halfspec, index, pad, window
from .common import bind, meta_call, normalize_dims, stand_in


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
    A slice of the result moves only the cells it keeps (a narrow band: one allreduce);
    a zero pad is not moved; a replicated input comes out cut where that saves work."""
    family, form, name = _FORMS[func]
    names = ("input", "n", "dim", "norm") if form == "1" else ("input", "s", "dim", "norm")
    a = bind(func, args, kwargs, names + ("out",),
             {"dim": -1 if form == "1" else ((-2, -1) if form == "2" else None)})
    x = a.pop("input")
    if a.pop("out") is not None:
        raise UnsupportedOpError(f"{name}: out= is not supported on DomainTensors")
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{name}: only the input may be a DomainTensor")
    # torch's own argument checks, output shape and dtype, on the global shape (planned)
    out_shape, out_dtype = layout.planned(
        ("fft", func, x._dec, x.dtype, tuple((k, tuple(v) if isinstance(v, list) else v)
                                             for k, v in a.items())),
        lambda: _probe(func, x, a))
    fam = _FAMILIES[family]
    dims, lengths, out_lengths = _dims_and_lengths(x, form, a, fam.kind, out_shape)
    x = _unpadded(x, dims)
    # the r2c dim alone first, so that a slice can narrow it before the others; the
    # c2r dim alone last where its input is narrower than its half spectrum (torch
    # would pad it first and transform the other dims over the zeros too) or
    # replicated (so that it runs on blocks: "Replicated in, sharded out")
    local, dec = x._local, x._dec
    split = fam.kind == "r2c" or (fam.kind == "c2r" and (
        x.shape[dims[-1]] < lengths[-1] // 2 + 1 or fftplan.replicated(dec)))
    phases, start = fftplan.phases(name, dec, dims, lengths, out_lengths, fam.kind, split)
    if start is None:
        phases = fftplan.cut_replicated(phases)
    else:
        local, dec = ag.repartition(local, dec, start), start
    moves = [k for k, phase in enumerate(phases) if phase.src is not None]
    head = moves[0] if moves else 1  # the phases before the first transpose
    if start is None and 0 < head < len(phases) and fam.kind != "c2r":
        return _deferred(func, fam, a["norm"], (local, dec), phases[:head], phases[head:],
                         (dims, lengths, out_lengths, out_dtype))
    local, dec = _run(fam, a["norm"], local, dec, phases)
    if start is not None:  # back to the input's grid and cut dims, balanced
        xd = x._dec
        back = layout.derive(xd, dec.global_shape, xd.shard,
                             {k: xd.block_sizes(k) for k in xd.shard if k not in dims})
        local, dec = ag.repartition(local, dec, back), back
    return DomainTensor(local, dec)


def _probe(func, x: DomainTensor, options: dict) -> tuple:
    """Local. (output shape, dtype) of the transform on ``x``'s global shape, by
    torch on the meta device (its own argument checks)."""
    out = func(stand_in(x), **options)
    return tuple(out.shape), out.dtype


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
            meta = meta_call(call, stand_in(local), **options)
            like = torch.empty((), dtype=meta.dtype, device=local.device)
            local = window.placeholder(meta.shape, like, local)
        if phase.then is not None:  # no message: each rank keeps its block
            local = ag.repartition(local, phase.dst, phase.then)
        dec = phase.out
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
    # the block RealToHalf transformed, and its options: a slice of its bins is
    # taken by HalfBins, whose backward does not fill the half spectrum
    x, phase = start[0], head[0]
    half = (x, (x.shape[phase.dims[0]], phase.lengths[0], phase.dims[0], norm)) if \
        fam.half is halfspec.rfftn and len(head) == 1 and phase.half and phase.then is None \
        and not x.is_complex() and x.numel() else None

    def take(whole: Deferred, key) -> DomainTensor | None:
        return _take(func, fam, norm, (local, dec, half), done, left, cache, whole, key)

    return Deferred(tail[-1].out, dtype, local.device,
                    lambda: _run(fam, norm, local, dec, tail)[0], take)


# why a slice taken in transit refuses writes (``aliasing.mark_copied``)
_COPIED = "a slice of a spectrum taken before the transform's transposes"


def _take(func, fam: _Family, norm, start, done, left, cache, whole: Deferred, key):
    """``whole[key]``, where ``whole`` is the Deferred of a transform whose phases
    after ``done`` are still to run: the slices of the dims it no longer transforms
    go first, and only what they keep travels, by a band (``ops/fftband.py``) where
    one pays, else by the plan's transposes; None where nothing is sliced there
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
    if tag not in cache:  # what these slices keep, and what was computed from it
        with whole.as_made():
            cache[tag] = {"in": _sliced(start, first), "bands": []}
    entry = cache[tag]
    local, dec = entry["in"]
    band = None if "whole" in entry else \
        next((b for b in entry["bands"] if fftband.holds(b[0], per)), None)
    if band is None and "whole" not in entry:
        kept = fftband.modes(dec, dims, lengths, per)
        if kept is not None:
            with whole.as_made():  # cached for later slices, as the whole is below
                band = (kept, _band(fam, norm, local, dec, (dims, lengths), kept))
            entry["bands"].append(band)
    if band is not None:
        kept, spectrum = band
        then = tuple(fftband.position(kept[d], s) if d in kept else
                     slice(None) if d in first else slice(*s) for d, s in enumerate(per))
    else:
        if "whole" not in entry:
            try:
                phases = fftplan.plan(_FORMS[func][2], dec, dims, lengths, out_lengths, kind, done)
            except UnsupportedOpError:
                return None
            with whole.as_made():  # cached for later slices: the graph of the transform's call
                entry["whole"] = DomainTensor(*_run(fam, norm, local, dec, phases))
        spectrum = entry["whole"]
        then = tuple(slice(None) if d in first else slice(*s) for d, s in enumerate(per))
    out = index.getitem(torch.Tensor.__getitem__, (spectrum, then), {})
    aliasing.mark_copied(whole, out, _COPIED)
    return out


def _sliced(start, first: dict) -> tuple[torch.Tensor, Decomposition]:
    """Local. The block and layout of a transform's result in transit (``start``:
    block, layout and ``_deferred``'s ``half``) after the slices ``first`` of dims
    it no longer transforms: RealToHalf's dim first, by HalfBins, while the
    spectrum is whole."""
    whole, dec, half = start
    bins_dim = None if half is None else half[1][2]
    local = whole
    for d in sorted(first, key=lambda d: d != bins_dim):
        lo, hi, step = first[d]
        sliced, dec = index.slice_dim(local, dec, d, lo, hi, step)
        local = halfspec.HalfBins.apply(half[0], local.detach(), lo, hi, half[1]) \
            if d == bins_dim and step == 1 and local is whole else sliced
    return local, dec


def _band(fam: _Family, norm, local, dec: Decomposition, left, kept) -> DomainTensor:
    """Collective (one allreduce over the cut transform dims' grid axes). The band
    ``kept`` (``fftband.modes``) of the c2c transform of ``local`` over the dims and
    lengths ``left``: partial DFTs along the cut dims, torch's transform along the
    others (then their band), the partial spectra summed; replicated along those axes."""
    dims, lengths = left
    cut = [d for d in dims if layout.cut(dec, d)]
    if not local.is_complex():
        local = local.to(torch.result_type(local, 1j))
    shape = list(dec.global_shape)
    for d, n in zip(dims, lengths):
        if d in cut:
            local = fftband.partial(local, dec, d, kept[d], n, fam.full is torch.fft.ifftn, norm)
            shape[d] = len(kept[d])
    comm = layout.comm_of(dec, cut)
    shard = {k: a for k, a in dec.shard.items() if k not in cut}
    dec = layout.derive(dec, shape, shard, {k: dec.block_sizes(k) for k in shard})
    rest = [(d, n) for d, n in zip(dims, lengths) if d not in cut]
    if rest:  # whole here: torch's transform, then the band
        done = fftplan.transformed(dec, dict(rest))
        phase = fftplan.Phase(None, tuple(d for d, _ in rest), tuple(n for _, n in rest), False, done)
        local, dec = _run(fam, norm, local, dec, [phase])
        for d, _ in rest:
            if d in kept:
                local = local.index_select(d, torch.tensor(kept[d], device=local.device))
                shape[d] = len(kept[d])
        dec = fftplan.transformed(dec, {d: shape[d] for d, _ in rest})
    return DomainTensor(ag.allreduce_sum(local, comm), dec)


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
