"""Hyperslab math: which boxes of a dataset make this rank's block plus halo.

Pure index math, identical on every rank. Along a dim with ghost widths
``(lo, hi)`` the padded block covers global cells ``[o - lo, o + n + hi)``; that
range is cut into three segments: below the domain, inside it, above it. Inside
cells come from the file (ghosts of interior neighbours included: they are read,
not exchanged); cells beyond a periodic edge come from the other end of the
file; cells beyond a non-periodic edge get the fill value (slabs, no read). A
box is one choice of file segment per dim. Every rank lists its boxes in the
same order, 3**k of them for k periodic dims with a halo, empty ones included,
so that collective transfers match call for call across ranks.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence, Set

from ..comm.decomposition import Decomposition
from ..comm.errors import LayoutError


@dataclasses.dataclass(frozen=True)
class Piece:
    """A box of the padded block read from the file: where it starts in the block
    (``mem``), its extent (``count``) and where it starts in the logical array
    (``file``)."""
    mem: tuple[int, ...]
    count: tuple[int, ...]
    file: tuple[int, ...]

    @property
    def empty(self) -> bool:
        """Local. Whether the box holds no cells."""
        return 0 in self.count


@dataclasses.dataclass(frozen=True)
class Plan:
    """The padded block's shape, its boxes, the fill slabs ``(dim, start, count)``
    beyond non-periodic edges, and the ghost widths per dim."""
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    fills: tuple[tuple[int, int, int], ...]
    widths: Mapping[int, tuple[int, int]]

    def fill_regions(self):
        """The fill slabs as slices of the padded block (corners may repeat)."""
        for d, start, count in self.fills:
            if count:
                yield tuple(slice(start, start + count) if k == d else slice(None)
                            for k in range(len(self.shape)))

    def owned(self) -> tuple[slice, ...]:
        """The owned cells' slices in the padded block."""
        return tuple(slice(self.widths.get(d, (0, 0))[0],
                           n - self.widths.get(d, (0, 0))[1]) for d, n in enumerate(self.shape))


def widths(halo, dec: Decomposition) -> dict[int, tuple[int, int]]:
    """Local. ``halo`` as ``{dim: (lo, hi)}``: an int is that width on both sides
    of every sharded dim; a dict gives ``w`` or ``(lo, hi)`` per dim (any dim)."""
    if halo is None:
        return {}
    if isinstance(halo, int) and not isinstance(halo, bool):
        if halo < 0:
            raise LayoutError(f"halo width {halo} must not be negative")
        return {d: (halo, halo) for d in dec.shard} if halo else {}
    if not isinstance(halo, Mapping):
        raise LayoutError(f"halo must be an int or a dict {{dim: w or (lo, hi)}}, got {halo!r}")
    out = {}
    for dim, w in halo.items():
        try:
            d = dec._dim(int(dim))
            lo, hi = (int(w), int(w)) if isinstance(w, int) else (int(w[0]), int(w[1]))
        except (TypeError, ValueError, IndexError):
            raise LayoutError(f"halo {halo!r}: dim {dim!r} needs an int or (lo, hi)") from None
        if lo < 0 or hi < 0:
            raise LayoutError(f"halo width {w} for dim {dim} must not be negative")
        if lo or hi:
            out[d] = (lo, hi)
    return dict(sorted(out.items()))


def periodic_dims(dec: Decomposition, override: Mapping[int, bool] | None) -> set[int]:
    """Local. The dims that wrap: a sharded dim whose grid axis is periodic, unless
    ``override`` says otherwise (which may also make an unsharded dim wrap)."""
    wraps = {d for d, a in dec.shard.items() if dec.grid.periodic[a]}
    for dim, p in (override or {}).items():
        d = dec._dim(int(dim))
        (wraps.add if p else wraps.discard)(d)
    return wraps


def _segments(o: int, n: int, size: int, lo: int, hi: int, wrap: bool):
    """Along one dim: the file segments ``(memory start, count, file start)`` (inside
    the domain, then the wrapped ones below and above on a periodic dim) and the
    fill segments ``(memory start, count)`` beyond non-periodic edges."""
    if not lo and not hi:
        return [(0, n, o)], []
    if wrap and (lo > size or hi > size):
        raise LayoutError(f"a halo of ({lo}, {hi}) wraps more than once around a periodic "
                          f"dim of size {size}")
    a, b = o - lo, o + n + hi
    below = (a, max(a, min(b, 0)))
    inside = (max(a, 0), max(max(a, 0), min(b, size)))
    above = (max(a, size), max(max(a, size), b))
    reads = [(inside[0] - a, inside[1] - inside[0], inside[0])]
    fills = []
    for (start, stop), width, shift in ((below, lo, size), (above, hi, -size)):
        if wrap and width:
            reads.append((start - a, stop - start, start + shift))
        elif stop > start:
            fills.append((start - a, stop - start))
    return reads, fills


def plan(dec: Decomposition, halo_widths: Mapping[int, tuple[int, int]],
         wraps: Set[int] = frozenset(), rank: int | None = None) -> Plan:
    """Local. The boxes of ``rank``'s block (default: this rank) padded by
    ``halo_widths``, with the dims in ``wraps`` periodic."""
    shape, offsets = dec.local_shape(rank), dec.offsets(rank)
    per_dim: list[list[tuple[int, int, int]]] = []
    fills: list[tuple[int, int, int]] = []
    for d, (o, n, size) in enumerate(zip(offsets, shape, dec.global_shape)):
        lo, hi = halo_widths.get(d, (0, 0))
        reads, fill = _segments(o, n, size, lo, hi, d in wraps)
        per_dim.append(reads)
        fills.extend((d, start, count) for start, count in fill)
    pieces = tuple(Piece(tuple(s[0] for s in combo), tuple(s[1] for s in combo),
                         tuple(s[2] for s in combo)) for combo in itertools.product(*per_dim))
    padded = tuple(n + sum(halo_widths.get(d, (0, 0))) for d, n in enumerate(shape))
    return Plan(padded, pieces, tuple(fills), dict(halo_widths))


def file_boxes(p: Plan, base: Sequence[int], fortran: bool):
    """Local. ``transfer`` boxes for ``p`` with the logical array starting at ``base``
    in the file (an index along dim 0); reversed for a Fortran-ordered file, whose
    dims are the logical dims backwards. Empty pieces are None."""
    def fix(t):
        return tuple(t[::-1]) if fortran else tuple(t)
    Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    boxes: list[Box | None] = []
    for piece in p.pieces:
        if piece.empty:
            boxes.append(None)
        else:
            start = tuple(f + b for f, b in zip(piece.file, base))
            boxes.append((fix(start), fix(piece.mem), fix(piece.count)))
    return boxes
