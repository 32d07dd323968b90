"""HaloExchange: fill ghost cells from their owners, and its adjoint, accumulate.

Arrays are laid out as the owned block padded by ``lo`` ghost cells before and
``hi`` after it along each dim. The exchange runs one round per sharded dim with
a non-zero width, in dim order. Round ``d`` moves slabs that span, along every
dim already exchanged, the owned cells plus the ghosts filled so far, and along
every other dim the owned cells only; so edges and corners arrive through two or
three rounds without diagonal messages, for any number of sharded dims.

Within a round, the ghost range of every block is cut into pieces by the blocks
that own them (wrapping on periodic axes), so a width larger than a neighbour's
block, even one spanning several blocks or zero-size blocks, simply reaches
further: every piece comes straight from its owner. All of this is index math
that every rank does alike, so both ends of every message agree on its size.

``accumulate`` runs the rounds backwards with the roles of each message swapped:
ghost values go back to their owners and are added there, and the ghost cells
that ``fill`` writes are zeroed. Ghost cells outside a non-periodic domain are
left alone by both, which makes the pair exactly adjoint on the whole array.

(Over 500 lines on purpose: HaloExchange and its execution plan, ``_Plan``,
which holds persistent requests, wire buffers and the packing, are one unit
with private types between them; nothing else uses the plan, and splitting
them would make those types module-public. The public class carries its
numpydoc sections.)
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import numpy as np
from mpi4py import MPI

from . import buffers, packing, runtime
from .buffers import Array
from .clock import blocking
from .decomposition import Decomposition
from .errors import LayoutError, agree, signature_of

if TYPE_CHECKING:
    from mpi4py.typing import BufSpec

_TAG_FILL, _TAG_ACCUMULATE = 7101, 7102
_A = TypeVar("_A")


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One message of a round, seen from this rank: ``box`` (a tuple of slices
    of the padded array) holds owned cells when sending, ghosts when receiving."""
    peer: int   # the other end (this rank for a local copy)
    box: tuple[slice, ...]


# One round of messages: (dim, sends, recvs).
_Round: TypeAlias = tuple[int, list[Transfer], list[Transfer]]


def _normalise_width(width: Mapping[int, int | tuple[int, int]] | int,
                     ndim: int) -> dict[int, tuple[int, int]]:
    if isinstance(width, int):
        raise LayoutError("width must be a dict {dim: int or (lo, hi)}")
    out = {}
    for dim, w in dict(width).items():
        dim = int(dim)
        if not -ndim <= dim < ndim:
            raise LayoutError(f"width names dim {dim}, but the array has {ndim} dims")
        lo, hi = (w, w) if isinstance(w, (int, np.integer)) else tuple(w)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi < 0:
            raise LayoutError(f"width {w} for dim {dim} must not be negative")
        out[dim % ndim] = (lo, hi)
    return out


def _wrapped_segments(g0: int, g1: int, n: int,
                      periodic: bool) -> Iterator[tuple[int, int, int]]:
    """Split the global index range [g0, g1) into pieces inside [0, n): yields
    (start, stop, shift) with global index ``i`` of the piece sitting at
    position ``i + shift`` of the unwrapped range."""
    if n == 0 or g0 >= g1:
        return
    if not periodic:
        if max(g0, 0) < min(g1, n):
            yield max(g0, 0), min(g1, n), 0
        return
    k = g0 // n
    while k * n < g1:
        a, b = max(g0, k * n), min(g1, (k + 1) * n)
        yield a - k * n, b - k * n, k * n
        k += 1


class HaloExchange:
    """Collective (construction checks that every rank passed the same widths).
    Ghost-cell exchange for arrays laid out as a block plus ghosts per side;
    ``fill`` and ``accumulate`` are neighbour-wise collective over the grid.

    Parameters
    ----------
    decomposition : Decomposition
        The blocks.
    width : mapping
        Ghosts per side, ``{dim: w}`` or ``{dim: (lo, hi)}``.
    periodic : mapping, optional
        ``{dim: bool}``: whether ghosts wrap around the domain, overriding the
        grid axis's periodicity (zero padding on a periodic grid passes False;
        circular padding passes True on any grid).
    check : bool, default True
        Agree on the arguments across the grid; False for callers that derive
        the same arguments on every rank by construction.
    """

    def __init__(self, decomposition: Decomposition, width: Mapping[int, int | tuple[int, int]],
                 periodic: Mapping[int, bool] | None = None, *, check: bool = True):
        self.decomposition = dec = decomposition
        self.grid = dec.grid
        problem = None
        try:
            self.width = _normalise_width(width, dec.ndim)
            wraps = {int(d) % dec.ndim: bool(p) for d, p in dict(periodic or {}).items()}
        except (LayoutError, TypeError, ValueError) as exc:
            problem, self.width, wraps = f"HaloExchange width {width}: {exc}", {}, {}
        axes = [dec.axis_of(d) for d in range(dec.ndim)]
        self._wraps = tuple(wraps.get(d, a is not None and bool(self.grid.periodic[a]))
                            for d, a in enumerate(axes))
        if check:
            agree(self.grid.comm, problem,
                  signature=signature_of((sorted(self.width.items()), self._wraps)),
                  what="HaloExchange widths", described=f"{self.width}, wraps {self._wraps}")
        elif problem:
            raise LayoutError(problem)
        self.lo = tuple(self.width.get(d, (0, 0))[0] for d in range(dec.ndim))
        self.hi = tuple(self.width.get(d, (0, 0))[1] for d in range(dec.ndim))
        self.padded_shape = tuple(n + lo + h for n, lo, h in
                                  zip(dec.local_shape(), self.lo, self.hi))
        self.owned = tuple(slice(lo, lo + n) for lo, n in zip(self.lo, dec.local_shape()))
        self._rounds = self._plan_rounds()
        self._plans: dict[tuple[object, tuple[int, ...], bool], _Plan] = {}

    # -- queries (local) -------------------------------------------------------------
    def ghost_slices(self, dim: int, side: str) -> tuple[slice, ...]:
        """The ``side`` ('lo' or 'hi') ghost slab of ``dim`` in the padded array."""
        dim %= self.decomposition.ndim
        box = list(self.owned)
        n = self.owned[dim]
        box[dim] = slice(0, self.lo[dim]) if side == "lo" else slice(n.stop, n.stop + self.hi[dim])
        return tuple(box)

    def valid_range(self, dim: int) -> slice:
        """Padded positions along ``dim`` that ``fill`` defines: the owned cells
        plus the ghosts that map into the domain (all of them on a periodic axis)."""
        dec, axis = self.decomposition, self.decomposition.axis_of(dim)
        lo, hi, n = self.lo[dim], self.hi[dim], dec.local_shape()[dim]
        if axis is None:
            return slice(lo, lo + n)
        if self._wraps[dim] and dec.global_shape[dim] > 0:
            return slice(0, lo + n + hi)
        off, size = dec.offsets()[dim], dec.global_shape[dim]
        return slice(lo - min(lo, off), lo + n + min(hi, max(size - off - n, 0)))

    # -- planning: pure index math, the same on every rank ------------------------------
    def _plan_rounds(self) -> list[_Round]:
        dec = self.decomposition
        rounds: list[_Round] = []
        exchanged: list[int] = []
        for dim in range(dec.ndim):
            axis = dec.axis_of(dim)
            if axis is None or self.lo[dim] + self.hi[dim] == 0:
                continue
            cross = [self.valid_range(j) if j in exchanged else self.owned[j]
                     for j in range(dec.ndim)]
            sends, recvs = self._round(dim, axis, cross)
            rounds.append((dim, sends, recvs))
            exchanged.append(dim)
        return rounds

    def _round(self, dim: int, axis: int,
               cross: list[slice]) -> tuple[list[Transfer], list[Transfer]]:
        dec, grid = self.decomposition, self.grid
        sizes, offs = dec.block_sizes(dim), dec.block_offsets(dim)
        n, periodic, lo = dec.global_shape[dim], self._wraps[dim], self.lo[dim]
        me = grid.coords[axis]

        def rank_at(c: int) -> int:
            coords = list(grid.coords)
            coords[axis] = c
            return grid.comm.Get_cart_rank(coords)

        def box(start: int, stop: int) -> tuple[slice, ...]:
            b = list(cross)
            b[dim] = slice(start, stop)
            return tuple(b)

        def pieces(dst: int) -> Iterator[tuple[int, int, int, int]]:
            """(src, start, stop, shift) for every piece of block ``dst``'s ghosts,
            in one fixed order: both ends of any pair of ranks list the messages
            between them in the same order, which MPI keeps for equal source,
            tag and communicator."""
            ghosts = ((offs[dst] - lo, offs[dst]),
                      (offs[dst] + sizes[dst], offs[dst] + sizes[dst] + self.hi[dim]))
            for g0, g1 in ghosts:
                for a, b, shift in _wrapped_segments(g0, g1, n, periodic):
                    # the owners of [a, b): from the block holding a, onwards
                    src = bisect.bisect_right(offs, a, hi=len(sizes)) - 1
                    while src < len(sizes) and offs[src] < b:
                        p0, p1 = max(a, offs[src]), min(b, offs[src] + sizes[src])
                        if p0 < p1:
                            yield src, p0, p1, shift
                        src += 1

        recvs = []
        base = offs[me] - lo  # global index of this rank's padded position 0
        for src, p0, p1, shift in pieces(me):
            recvs.append(Transfer(rank_at(src), box(p0 + shift - base, p1 + shift - base)))
        sends = []
        for dst in range(len(sizes)):
            for src, p0, p1, _ in pieces(dst):
                if src == me:
                    sends.append(Transfer(rank_at(dst), box(p0 - offs[me] + lo,
                                                            p1 - offs[me] + lo)))
        return sends, recvs

    # -- execution ------------------------------------------------------------------------
    def _check(self, a: Any, op: str, collective: bool) -> Array:
        """This rank's array, once every rank has a well-shaped one of one dtype
        (with ``collective``; else only this rank's array is checked)."""
        problem = None
        try:
            arr = buffers.as_array(a)
            if arr.shape != self.padded_shape:
                problem = (f"HaloExchange.{op}: array shape {tuple(arr.shape)} does not match "
                           f"block {self.decomposition.local_shape()} plus ghosts lo={self.lo} "
                           f"hi={self.hi}, i.e. {self.padded_shape}")
        except TypeError as exc:
            arr, problem = None, f"HaloExchange.{op}: {exc}"
        if not collective:
            if problem:
                raise LayoutError(problem)
            return arr
        dtype = arr.dtype if arr is not None else "?"  # named only if ranks differ
        agree(self.grid.comm, problem, signature=signature_of(getattr(dtype, "str", dtype)),
              what=f"HaloExchange.{op} array dtypes", described=str(dtype))
        return arr

    @blocking
    def fill(self, a: _A, *, check: bool = True) -> _A:
        """Neighbour-wise collective. Copy owners' values into the ghost cells of
        ``a``. Periodic axes wrap; ghosts outside a non-periodic domain are left
        as they are.

        Parameters
        ----------
        a : numpy.ndarray, cupy.ndarray or torch.Tensor
            The padded block (``padded_shape``), modified in place.
        check : bool, default True
            First agree that every rank's array is well shaped and of one dtype
            (one 3-integer allreduce), so bad input raises on every rank alike;
            False for callers that built ``a`` from this exchange's layout (a
            bad array then raises on its rank only).

        Returns
        -------
        same type as a
            ``a`` itself.
        """
        arr = self._check(a, "fill", check)
        self._plan_for(arr).execute(arr, adjoint=False)
        return a

    @blocking
    def accumulate(self, a: _A, *, check: bool = True) -> _A:
        """Neighbour-wise collective. The adjoint of ``fill``: add the ghost cells
        of ``a`` into their owners' cells, then zero the ghosts ``fill`` writes
        (those outside a non-periodic domain are left as they are).

        Parameters
        ----------
        a : numpy.ndarray, cupy.ndarray or torch.Tensor
            The padded block, modified in place.
        check : bool, default True
            As for ``fill``.

        Returns
        -------
        same type as a
            ``a`` itself.
        """
        arr = self._check(a, "accumulate", check)
        self._plan_for(arr).execute(arr, adjoint=True)
        return a

    # -- for benchmarks: the plan's messages and tuning, read without touching state --
    @property
    def rounds(self) -> tuple[_Round, ...]:
        """Local. The message rounds, one per sharded dim: ``(dim, sends, recvs)``,
        each a list of Transfers (peer and box of the padded block)."""
        return tuple(self._rounds)

    @property
    def wraps(self) -> tuple[bool, ...]:
        """Local. Per dim of the array, whether its ghosts wrap around the domain
        (the grid axis's periodicity unless ``periodic`` overrode it)."""
        return self._wraps

    def tuning(self) -> list[dict[str, object]]:
        """Local. Per plan built so far (one per dtype, memory layout and device):
        the way its strided boxes settled on (``way``: 'datatype', 'pack' or None
        when nothing is strided or it is still tuning) and the seconds the last
        tuning timed per way (``timings``)."""
        return [{"way": p.choice, "timings": p.last_timings, "settled": p.timings is None}
                for p in self._plans.values()]

    def settle(self, a: Any) -> None:
        """Neighbour-wise collective. Run ``fill`` and ``accumulate`` on ``a`` (a
        scratch padded block: its contents are overwritten) until the plan for
        its layout has made its tuning calls, so that timed calls see a settled
        plan. Every rank makes the same number of calls."""
        for _ in range(2 * TUNING_CALLS + 1):
            self.fill(a, check=False)
            self.accumulate(a, check=False)

    def _plan_for(self, arr: Array) -> _Plan:
        key = (arr.dtype, arr.strides, buffers.is_device(arr))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(self, arr)
        return plan


# A strided box can go to MPI as a derived datatype straight from the array
# (MPI copies it through its own pipelined buffers) or through the pack kernels.
# Neither always wins: on 2 ranks here (`domainpar bench halo`) datatypes were
# up to 1.7x faster on some faces and 2-3.5x slower on others, and for one and
# the same 16 MiB face took 5 ms in one process and 18 ms in the next, against
# a steady 7 ms packed. So a plan with strided boxes times both ways on its
# first calls, keeps the faster, and looks again every RETUNE_EVERY calls.
# Both put the same bytes on the wire, so ranks need not agree on the choice.
TUNING_CALLS = 3  # calls timed per way before a plan settles
RETUNE_EVERY = 500  # calls after which a settled plan times both ways again
_KEPT_ADDRESSES = 4  # arrays per plan whose persistent requests are kept
# "datatype" or "pack" skips the tuning and moves every eligible box that way.
FORCED_WAY = os.environ.get("DOMAINPAR_HALO_WAY") or None


@dataclasses.dataclass
class _Wire:
    """How one transfer's bytes meet MPI in a plan."""
    transfer: Transfer
    mode: str                 # "local", "direct", "datatype" or "pack" (may switch
                              # between the last two while the plan is tuning)
    buf: Array = None         # pack or staging buffer ("pack")
    datatype: MPI.Datatype | None = None  # derived datatype over the box ("datatype")
    offset: int = 0           # byte offset of the box's first element in the array
    span: int = 0             # bytes from the box's first element to past its last
    sum_buf: Array = None     # where an owned box receives a sum (accumulate)


# Per round: (receive requests, send requests), persistent.
_Requests: TypeAlias = tuple[list[MPI.Prequest], list[MPI.Prequest]]


def _box_datatype(view: Array) -> tuple[MPI.Datatype, int]:
    """A committed MPI datatype walking the box ``view`` from its first byte,
    and the byte span it covers."""
    shape, strides = packing._merged_layout(view)
    item = view.itemsize
    if strides[-1] == item:  # a contiguous row is one block
        dtype = MPI.BYTE.Create_contiguous(shape[-1] * item)
        chunk, shape, strides = shape[-1] * item, shape[:-1], strides[:-1]
    else:
        dtype, chunk = MPI.BYTE.Create_contiguous(item), item
    for n, stride in zip(reversed(shape), reversed(strides)):
        outer = dtype.Create_hvector(n, 1, stride)
        dtype.Free()
        dtype = outer
    span = chunk + sum((n - 1) * st for n, st in zip(shape, strides))
    return dtype.Commit(), span


class _Plan:
    """Buffers, datatypes and persistent requests of a HaloExchange for one
    dtype, memory layout and device. Each box meets MPI the cheapest way:
    contiguous boxes straight from and to the array, strided ones as derived
    datatypes or packed, whichever the first calls found faster. Device arrays
    are packed on the device and staged through pinned host memory unless MPI
    is CUDA-aware."""

    def __init__(self, halo: HaloExchange, arr: Array) -> None:
        self.comm = halo.grid.comm
        self.rank = halo.grid.rank
        self.itemsize = arr.dtype.itemsize
        self.device = buffers.is_device(arr)
        self.staged = self.device and runtime.stages_device_buffers()
        self.rounds = [([self._wire(arr, t) for t in sends], [self._wire(arr, t) for t in recvs])
                       for _dim, sends, recvs in halo._rounds]
        self.tunable = [w for sends, recvs in self.rounds for w in sends + recvs
                        if w.datatype is not None]
        # calls timed per way while tuning; None once settled (or nothing to tune)
        self.timings: dict[str, list[float]] | None = (
            {"datatype": [], "pack": []} if self.tunable else None)
        self.choice: str | None = None
        # what the last tuning measured, for reports
        self.last_timings: dict[str, list[float]] | None = None
        self.calls_since_tuning = 0
        self.forced = bool(self.tunable and FORCED_WAY)
        if self.forced and FORCED_WAY:
            self._settle(FORCED_WAY)
        # persistent requests per (array address, direction, ways), newest last
        self.requests: collections.OrderedDict[tuple[int, bool, tuple[str, ...]],
                                               list[_Requests]] = collections.OrderedDict()

    def _wire(self, arr: Array, t: Transfer) -> _Wire:
        view = arr[t.box]
        if t.peer == self.rank:
            return _Wire(t, "local")
        offset = buffers.address(view) - buffers.address(arr) if view.size else 0
        nbytes = view.size * self.itemsize
        if view.flags.c_contiguous and not self.staged:
            return _Wire(t, "direct", offset=offset, span=nbytes)
        buf = (buffers.pinned_empty(nbytes) if self.staged
               else buffers.empty((nbytes,), np.uint8, arr))
        if not self.device:
            datatype, span = _box_datatype(view)
            return _Wire(t, "datatype", buf=buf, datatype=datatype, offset=offset, span=span)
        return _Wire(t, "pack", buf=buf)

    def execute(self, arr: Array, adjoint: bool) -> None:
        """Run every round (backwards for the adjoint); while tuning, time the
        whole exchange under each way of moving the eligible boxes."""
        timings = self.timings
        if timings is not None:  # the way timed least so far
            way = min(timings, key=lambda k: len(timings[k]))
            for w in self.tunable:
                w.mode = way
        requests = self._persistent(arr, adjoint)
        order = reversed(range(len(self.rounds))) if adjoint else range(len(self.rounds))
        t0 = time.perf_counter()
        for r in order:
            self.run(arr, r, adjoint, requests[r])
        if self.device:
            # The last unpacks run on CuPy's stream; the caller may go on on
            # another one (a torch side stream), which nothing orders after them.
            buffers.synchronize(arr)
        if timings is not None:
            timings[way].append(time.perf_counter() - t0)
            if all(len(v) >= TUNING_CALLS for v in timings.values()):
                self._settle(min(timings, key=lambda k: min(timings[k])))
        elif self.choice is not None and not self.forced:
            # The faster way can change as memory and neighbours change: look again
            # now and then (a few calls in the slower way, well under 1% of calls).
            self.calls_since_tuning += 1
            if self.calls_since_tuning >= RETUNE_EVERY:
                self.timings = {"datatype": [], "pack": []}

    def _settle(self, way: str) -> None:
        if way not in ("datatype", "pack"):
            raise LayoutError(f"DOMAINPAR_HALO_WAY={way!r}: use 'datatype' or 'pack'")
        self.choice, self.last_timings, self.timings = way, self.timings, None
        self.calls_since_tuning = 0
        for w in self.tunable:
            w.mode = way

    def _message(self, address: int, w: _Wire, adjoint_recv: bool = False) -> BufSpec:
        """The MPI message spec of ``w``'s box in the array at ``address``.

        Boxes in the array are named by address, not by a view, so that the
        persistent requests built on them keep no array alive."""
        spec: BufSpec = w.buf
        if adjoint_recv:  # an owned box receives a sum, never a copy
            spec = w.sum_buf
        elif w.mode == "direct":
            spec = [MPI.buffer.fromaddress(address + w.offset, w.span), MPI.BYTE]
        elif w.mode == "datatype":
            assert w.datatype is not None  # every "datatype" wire has one
            spec = [MPI.buffer.fromaddress(address + w.offset, w.span), 1, w.datatype]
        return spec

    def _persistent(self, arr: Array, adjoint: bool) -> list[_Requests]:
        """The persistent requests of every round for the array at this address
        in this direction: built on first use, restarted on every later call.
        A few addresses are kept (arrays are usually reused); older ones freed."""
        address = buffers.address(arr)
        key = (address, adjoint, tuple(w.mode for w in self.tunable))
        found = self.requests.get(key)
        if found is not None:
            self.requests.move_to_end(key)
            return found
        tag = _TAG_ACCUMULATE if adjoint else _TAG_FILL
        built: list[_Requests] = []
        for r in range(len(self.rounds)):
            sends, recvs = self._directed(r, adjoint)
            for w in recvs:
                if adjoint and w.mode != "local" and w.sum_buf is None:
                    nbytes = arr[w.transfer.box].size * self.itemsize
                    # staged: MPI must never see device memory, sums included
                    w.sum_buf = (buffers.pinned_empty(nbytes) if self.staged
                                 else buffers.empty((nbytes,), np.uint8, arr))
            built.append((
                [self.comm.Recv_init(self._message(address, w, adjoint), w.transfer.peer, tag)
                 for w in recvs if w.mode != "local"],
                [self.comm.Send_init(self._message(address, w), w.transfer.peer, tag)
                 for w in sends if w.mode != "local"]))
        self.requests[key] = built
        while len(self.requests) > _KEPT_ADDRESSES:
            _free_requests(self.requests.popitem(last=False)[1])
        return built

    def _directed(self, r: int, adjoint: bool) -> tuple[list[_Wire], list[_Wire]]:
        """(sending wires, receiving wires) of round ``r``; for the adjoint the
        roles swap: ghosts travel back to their owners."""
        sends, recvs = self.rounds[r]
        return (recvs, sends) if adjoint else (sends, recvs)

    def run(self, arr: Array, r: int, adjoint: bool, requests: _Requests) -> None:
        sends, recvs = self._directed(r, adjoint)
        recv_requests, send_requests = requests
        MPI.Prequest.Startall(recv_requests)
        for w in sends:
            if w.mode == "pack":
                self._pack(arr[w.transfer.box], w.buf)
        # On a GPU the array's producers and the pack kernels run asynchronously:
        # all of them must be done before MPI reads device memory.
        buffers.synchronize(arr)
        MPI.Prequest.Startall(send_requests)
        # Local copies pair up in the order messages would.
        local_sends = [arr[w.transfer.box] for w in sends if w.mode == "local"]
        local_recvs = [arr[w.transfer.box] for w in recvs if w.mode == "local"]
        for src, dst in zip(local_sends, local_recvs):
            if adjoint:
                dst += src
            else:
                buffers.namespace(arr).copyto(dst, src)
        MPI.Request.Waitall(recv_requests + send_requests)
        for w in recvs:
            if w.mode == "local":
                continue
            if adjoint:
                self._unpack(arr[w.transfer.box], w.sum_buf, True)
            elif w.mode == "pack":
                self._unpack(arr[w.transfer.box], w.buf, False)
        if adjoint:  # the ghosts fill writes start from zero again
            for w in sends:
                arr[w.transfer.box][...] = 0

    def free(self) -> None:
        """Release the plan's MPI requests and datatypes (local)."""
        if MPI.Is_finalized():
            return
        while self.requests:
            _free_requests(self.requests.popitem()[1])
        for sends, recvs in self.rounds:
            for w in sends + recvs:
                if w.datatype is not None:
                    w.datatype.Free()
                    w.datatype = None

    __del__ = free

    def _pack(self, view: Array, buf: Array) -> None:
        if self.staged:
            dev = buffers.empty(view.shape, view.dtype, view)
            dev[...] = view
            dev.get(out=buf.view(view.dtype).reshape(view.shape))
        else:
            packing.pack(view, buf)

    def _unpack(self, view: Array, buf: Array, add: bool) -> None:
        if self.staged:
            src = buffers.namespace(view).asarray(buf.view(view.dtype).reshape(view.shape))
            if add:
                view += src
            else:
                view[...] = src
        else:
            packing.unpack(view, buf, add=add)


def _free_requests(rounds: Iterable[_Requests]) -> None:
    for recv_requests, send_requests in rounds:
        for request in recv_requests + send_requests:
            request.Free()
