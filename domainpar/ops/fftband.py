"""A band of a spectrum along cut dims by partial DFTs: the slice of a transform in
transit that keeps few modes (``ops/fft.py``, "Slices of a spectrum").

An FNO keeps the lowest ``m`` modes of both signs along each transform dim and
drops the rest. Where a dim still to transform is cut over ``P`` ranks, the plan
would move the block's grid axis onto another dim (an alltoallv of the whole
block, and the same again in backward) to transform ``n`` modes and keep ``2 m``.
A band computes the kept modes only: each rank multiplies its block by the
band's rows of the DFT matrix, at the columns its block holds (``k x n/P``
products per line), and one allreduce over the cut dims' grid axes sums the
partial spectra (``AllreduceSum``): every rank then holds the band whole along
those dims, replicated along their axes. The message is ``k`` lines instead of
``n/P``, and backward needs none (the allreduce's adjoint is the identity). It
is taken where it moves less: ``2 k P <= n`` along every cut dim, so a band
holds at most half as many lines of that dim as a block does (the FNO2d's:
8 channels x 16 x 8 complex modes, 16 KiB on every rank).

A band holds the slice's modes ``[lo, hi)`` and their reflection ``[n - hi, n - lo)``:
the two slices an FNO takes (``[:m]``, then ``[-m:]``) share one allreduce.
Modes with a step other than one are not banded (the plan's transposes answer).

``DOMAINPAR_FFT_BANDS=0`` turns bands off, and with them the cut of replicated
inputs (``ops/fft.py``): the transposes answer (``set_bands``; ``bench ...
--compare``). The ranks of a grid agree on the setting at its first use there.

A DFT of length ``n`` reads the first ``n`` entries of its input (trims it) and
treats missing ones as zeros (pads it), as ``torch.fft`` does; ``norm`` scales
as torch's: ``"backward"`` (the default) divides the inverse by ``n``,
``"forward"`` the forward, ``"ortho"`` both by ``sqrt(n)``.
"""
from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence

import torch

from ..comm.decomposition import Decomposition
from ..comm.errors import agree, signature_of
from ..comm.grid import ProcessGrid
from ..comm.runtime import switch
from ..tensor import layout

_SETTING, _PROBLEM = switch("DOMAINPAR_FFT_BANDS")
if _PROBLEM:
    raise ValueError(_PROBLEM)
BANDS = _SETTING != "0"
# grid -> the setting its ranks agreed on
_AGREED: weakref.WeakKeyDictionary[ProcessGrid, bool] = weakref.WeakKeyDictionary()


def set_bands(on: bool) -> None:
    """Local. Turn bands (and the cut of replicated inputs) on or off, as
    ``DOMAINPAR_FFT_BANDS`` does; every rank of a grid must call it alike."""
    global BANDS
    BANDS = bool(on)


def enabled(grid: ProcessGrid) -> bool:
    """Collective over ``grid`` the first time for it and the setting (one small
    allreduce; Local after). Whether bands are on; ranks whose settings differ
    raise a MismatchError alike."""
    if _AGREED.get(grid) is not BANDS:
        agree(grid.comm, None, signature=signature_of(BANDS), what="DOMAINPAR_FFT_BANDS",
              described=BANDS)
        _AGREED[grid] = BANDS
    return BANDS


def modes(dec: Decomposition, dims: Sequence[int], lengths: Sequence[int],
          per: Sequence[tuple[int, int, int]]) -> dict[int, tuple[int, ...]] | None:
    """Collective the first time on a grid (``enabled``), Local after; the same on
    every rank. The band's modes (sorted) along each of the transform dims ``dims``
    (lengths ``lengths``) that the slice ``per`` (one normalised ``(start, stop,
    step)`` per dim) cuts; None where a band does not pay: no transform dim cut,
    or a cut one kept whole, with a step, or too wide."""
    cut = [d for d in dims if layout.cut(dec, d)]
    if not cut or not enabled(dec.grid):
        return None
    band: dict[int, tuple[int, ...]] = {}
    for d, n in zip(dims, lengths):
        lo, hi, step = per[d]
        if (lo, hi, step) == (0, n, 1):
            continue
        if step != 1:
            return None
        band[d] = tuple(sorted(set(range(lo, hi)) | set(range(n - hi, n - lo))))
    if any(d not in band or 2 * len(band[d]) * dec.grid.dims[dec.shard[d]] > n
                      for d, n in zip(dims, lengths) if d in cut):
        return None
    return band


def holds(band: dict[int, tuple[int, ...]], per: Sequence[tuple[int, int, int]]) -> bool:
    """Local. Whether ``band`` holds every mode the slice ``per`` takes along its dims,
    in one run (so that a slice of the band answers)."""
    return all(position(kept, per[d]) is not None for d, kept in band.items())


def position(kept: tuple[int, ...], s: tuple[int, int, int]) -> slice | None:
    """Local. Where the modes ``range(*s)`` lie in the sorted band ``kept``, as a slice
    of it; None where some are missing or they are not adjacent there."""
    wanted = range(*s)
    if not wanted or s[2] != 1 or wanted[0] not in kept:
        return None
    first = kept.index(wanted[0])
    if kept[first:first + len(wanted)] != tuple(wanted):
        return None
    return slice(first, first + len(wanted))


def partial(local: torch.Tensor, dec: Decomposition, dim: int, kept: tuple[int, ...],
            n: int, inverse: bool, norm: str | None) -> torch.Tensor:
    """Local. This rank's share of the length-``n`` DFT (``inverse``: the inverse DFT)
    of a complex block cut along ``dim``, at the modes ``kept``: the block times
    those rows of the DFT matrix at its own columns. Summed over the ranks of
    ``dim``'s grid axis, the band."""
    start = dec.offsets()[dim]
    rows = _rows(kept, start, local.shape[dim], n, inverse, norm, local.dtype, local.device)
    return torch.movedim(torch.movedim(local, dim, -1) @ rows.T, -1, dim)


@functools.lru_cache(maxsize=64)
def _rows(kept: tuple[int, ...], start: int, count: int, n: int, inverse: bool,
          norm: str | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Local. Rows ``kept`` and columns ``start .. start + count`` of the DFT matrix
    of length ``n`` under ``norm`` (zero past column ``n``: the input is trimmed)."""
    k = torch.tensor(kept, dtype=torch.int64)
    j = torch.arange(start, start + count, dtype=torch.int64)
    turns = (k[:, None] * j[None, :]) % n  # exact, before the angle is formed
    angle = (2 * math.pi / n) * turns.to(torch.float64) * (1 if inverse else -1)
    scale = 1 / math.sqrt(n) if norm == "ortho" else \
        1 / n if (norm == "forward") != inverse else 1.0
    rows = torch.polar(torch.full_like(angle, scale), angle)
    rows[:, j >= n] = 0
    return rows.to(dtype=dtype, device=device)
