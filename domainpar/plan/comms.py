"""The time model's communication: what a training step sends, recorded from
the ops themselves, and the same counts evaluated on any other grid.

``record()`` observes the comm layer for the length of a ``with`` block,
through its public hook ``comm.clock.observing`` (no method is patched):
``HaloExchange.fill`` / ``accumulate``, the collectives (allreduce,
iallreduce, repartition, ring shifts, gathers, broadcasts), ``agree`` and
DomainParallel's per-step agreement (``completes_within``). Each call becomes an
``Event`` holding the layout the op passed (global shape, shard map, halo
widths, wraps, bytes per element) and the bytes and messages this rank really
exchanged in it (read off the exchange's own plan: the halo's receive boxes,
the repartition's byte counts; transfers to itself excluded).

``traffic(event, ...)`` is the model's side: the bytes and messages of the
same event for a rank of another grid, from the layout alone (index math, no
MPI), with the event's global extents scaled like the model's input
(``scale[d]``: a dim of the event scales like the input dim of the same
index; true of conv nets such as the UNet, not of reshaped tokens or
fixed-mode spectra, which should be traced at the shape they run). The
serial and MPI tests check ``traffic`` against ``record``'s counts.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

# The collectives a step may call, by how the model prices them (the rest: rooted).
_REDUCE = ("allreduce", "iallreduce")
_MOVE = ("repartition",)
_RING = ("ring_shift", "mirror_exchange")


@dataclass
class Event:
    """One communication call of a step, as ``record`` saw it."""
    kind: str                       # halo, allreduce, repartition, ring, rooted, agree
    name: str                       # the comm function (fill, accumulate, iallreduce ...)
    itemsize: int = 0
    shape: tuple = ()               # the global shape of the layout (halo, repartition)
    shard: dict = field(default_factory=dict)     # dim -> grid axis (or axes)
    dst_shard: dict = field(default_factory=dict)  # repartition's destination
    lo: tuple = ()
    hi: tuple = ()
    wraps: tuple = ()
    sizes: dict = field(default_factory=dict)      # dim -> block extents (source layout)
    dst_sizes: dict = field(default_factory=dict)
    ranks: int = 1                  # the communicator's size
    nbytes: int = 0                 # this rank's bytes received (or reduced) in the call
    messages: int = 0               # this rank's messages received (self excluded)
    seconds: float = 0.0            # the call's wall time, as recorded
    hops: int = 0                   # ring shift: hops of its pass less the ring's size
    work: int = 0                   # attention: the kernels' work (``timeattn``)

    def as_dict(self) -> dict:
        """Local. The event as JSON-ready data (int dict keys as strings)."""
        d = asdict(self)
        d["shard"] = {str(k): v for k, v in self.shard.items()}
        for key in ("dst_shard", "sizes", "dst_sizes"):
            d[key] = {str(k): v for k, v in getattr(self, key).items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Event:
        """Local. The event that ``as_dict`` gave ``d``."""
        d = dict(d)
        for key in ("shard", "dst_shard", "sizes", "dst_sizes"):
            d[key] = {int(k): (tuple(v) if isinstance(v, list) else v)
                      for k, v in d[key].items()}
        for key in ("shape", "lo", "hi", "wraps"):
            d[key] = tuple(d[key])
        return cls(**d)


# -- recording (real calls) --------------------------------------------------------------------
# Each observed call's parameters by position (``comm.clock.observing`` hands
# over the arguments as passed).
_PARAMS = {"allreduce": ("a", "comm"), "iallreduce": ("a", "comm"),
           "bcast": ("a", "comm"), "allgatherv": ("block", "dec"),
           "gatherv": ("block", "dec"), "scatterv": ("global_array", "dec"),
           "repartition": ("block", "src", "dst"),
           "ring_shift": ("send", "recv", "comm", "shift", "tag"),
           "mirror_exchange": ("send", "recv", "comm"),
           "HaloExchange.fill": ("halo", "a"), "HaloExchange.accumulate": ("halo", "a"),
           "agree": ("comm", "problem"), "completes_within": ("request", "limit")}


@contextlib.contextmanager
def record() -> Iterator[list[Event]]:
    """Local. Within the block, every outermost halo exchange and collective this
    process calls (``comm.clock.observing``, with the calls' arguments) is
    appended to the yielded list with its wall time (the calls run as usual; a
    nonblocking one's time is its start's)."""
    from ..comm import clock
    events: list[Event] = []

    @contextlib.contextmanager
    def observed(name, args, kwargs):
        params = _PARAMS.get(name)
        event = None if params is None else _event(name, {**dict(zip(params, args)), **kwargs})
        t0 = time.perf_counter()
        yield
        if event is not None:
            event.seconds = time.perf_counter() - t0
            events.append(event)

    with clock.observing(observed, arguments=True):
        yield events


def _event(name: str, call: dict) -> Event:
    """The event of one observed call, from its arguments."""
    from ..comm import buffers
    if name.startswith("HaloExchange."):
        return _halo_event(call["halo"], call["a"], name.endswith("accumulate"))
    if name == "agree":  # three int64s: the error flag and a signature, both ways
        size = call["comm"].Get_size()
        return Event("allreduce", name, 8, (3,), ranks=size, nbytes=24 if size > 1 else 0,
                     messages=int(size > 1))
    if name == "completes_within":  # a nonblocking agreement's wait (DomainParallel's)
        return Event("agree", name, ranks=_world_size())
    if name in _RING:
        return _ring_event(name, call)
    arr = buffers.as_array(call.get("a", call.get("block", call.get("global_array"))))
    if name in _REDUCE:
        comm = call["comm"]
        return Event("allreduce", name, arr.dtype.itemsize, tuple(arr.shape),
                     ranks=comm.Get_size(), nbytes=int(arr.nbytes),
                     messages=int(comm.Get_size() > 1 and arr.size > 0))
    if name in _MOVE:
        return _repartition_event(arr, call["src"], call["dst"])
    if name == "bcast":
        ranks = call["comm"].Get_size()
        return Event("rooted", name, arr.dtype.itemsize, tuple(arr.shape), ranks=ranks,
                     nbytes=int(arr.nbytes) if ranks > 1 else 0, messages=int(ranks > 1))
    dec = call["dec"]
    whole = math.prod(dec.global_shape) * arr.dtype.itemsize
    ranks = dec.grid.size
    return Event("rooted", name, arr.dtype.itemsize, tuple(dec.global_shape), dict(dec.shard),
                 sizes=_sizes(dec), ranks=ranks, nbytes=int(whole - arr.nbytes),
                 messages=(ranks - 1) if whole > arr.nbytes else 0)


def _ring_event(name: str, call: dict) -> Event:
    from ..comm import buffers, pairwise
    sends = call["send"] if isinstance(call["send"], (list, tuple)) else [call["send"]]
    nbytes = sum(int(buffers.as_array(s).nbytes) for s in sends)
    size = call["comm"].Get_size()
    return Event("ring", name, ranks=size, nbytes=nbytes if size > 1 else 0,
                 messages=len(sends) if size > 1 else 0,
                 hops=_pass_hops(name, call.get("tag", pairwise.RING_TAG)))


def _world_size() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_size()


def _halo_event(halo, a, adjoint: bool) -> Event:
    from ..comm import buffers
    dec = halo.decomposition
    itemsize = buffers.as_array(a).dtype.itemsize
    me = dec.grid.comm.Get_rank()
    received = [t for _, _, recvs in halo.rounds for t in recvs if t.peer != me]
    cells = sum(math.prod(s.stop - s.start for s in t.box) for t in received)
    return Event("halo", "accumulate" if adjoint else "fill", itemsize, tuple(dec.global_shape),
                 dict(dec.shard), {}, halo.lo, halo.hi, halo.wraps, _sizes(dec), {},
                 dec.grid.size, cells * itemsize, len(received))


def _sizes(dec) -> dict:
    return {d: list(dec.block_sizes(d)) for d in dec.shard}


def _pass_hops(name: str, tag: int) -> int:
    """A ring shift's hops per ring pass less the ring's size, by its tag: ring
    attention's gradient accumulators travel back to their owner (P hops), the
    k/v blocks, like any other ring pass, visit the other ranks (P - 1)."""
    from ..ops.ring import _GRAD_TAG
    return 0 if name == "ring_shift" and tag >= _GRAD_TAG else -1


def _repartition_event(arr, src, dst) -> Event:
    from ..comm.collectives import _repartition_plan
    me = src.grid.comm.Get_rank()
    _, (_, counts, _) = _repartition_plan(src, dst, arr.dtype.itemsize)
    others = [c for r, c in enumerate(counts) if r != me and c]
    return Event("repartition", "repartition", arr.dtype.itemsize, tuple(src.global_shape),
                 dict(src.shard), dict(dst.shard), sizes=_sizes(src), dst_sizes=_sizes(dst),
                 ranks=src.grid.size, nbytes=int(sum(others)),
                 messages=len(others))


# -- the model's side: the same event on another grid -----------------------------------------
def balanced(n: int, p: int, c: int) -> int:
    """Local. The block extent of coordinate ``c`` of ``p`` balanced blocks of ``n``."""
    return n // p + (c < n % p)


def _axes(entry) -> tuple[int, ...]:
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


@dataclass(frozen=True)
class Where:
    """A rank of a target grid: ``dims[a]`` ranks and coordinate ``coords[a]``
    along grid axis ``a``; the event's global extents times ``scale`` (per dim,
    1 past the list)."""
    dims: tuple[int, ...]
    coords: tuple[int, ...]
    scale: tuple[float, ...] = ()

    @property
    def size(self) -> int:
        """Local. The number of ranks of the grid."""
        return math.prod(self.dims)

    def extent(self, shape: Sequence[int], d: int) -> int:
        """Local. Dim ``d`` of ``shape`` scaled as on this grid (at least 1 unless empty)."""
        s = self.scale[d] if d < len(self.scale) else 1.0
        return max(1, round(shape[d] * s)) if shape[d] else 0

    def split(self, entry) -> tuple[int, int]:
        """(ranks, this rank's index) along the axes of a shard entry (row-major)."""
        p, c = 1, 0
        for a in _axes(entry):
            p, c = p * self.dims[a], c * self.dims[a] + self.coords[a]
        return p, c

    def blocks(self, shape, shard, sizes, d: int) -> list[int]:
        """The block extents along ``d``: the recorded ``sizes`` where the grid
        and the extent are the traced ones, balanced blocks otherwise."""
        n = self.extent(shape, d)
        if d not in shard:
            return [n]
        p = self.split(shard[d])[0]
        given = sizes.get(d)
        if given is not None and len(given) == p and sum(given) == n:
            return list(given)
        return [balanced(n, p, k) for k in range(p)]

    def interval(self, shape, shard, sizes, d: int) -> tuple[int, int]:
        """(offset, extent) of this rank's block along ``d``."""
        blocks = self.blocks(shape, shard, sizes, d)
        c = self.split(shard[d])[1] if d in shard else 0
        return sum(blocks[:c]), blocks[c]


def traffic(e: Event, where: Where) -> tuple[int, int]:
    """Local. (bytes received, messages) of event ``e`` for the rank ``where``,
    from the layout alone. Halo: one round per exchanged dim in dim order, each
    side's ghosts from the neighbours (more than one when wider than their
    blocks), cross-sections including the ghosts of earlier rounds; repartition:
    what other ranks hold of this rank's new block; an allreduce, ring shift or
    rooted collective: the array (scaled like the input only for ring shifts,
    whose arrays are blocks)."""
    if e.kind == "halo":
        return _halo_traffic(e, where)
    if e.kind == "repartition":
        return _repartition_traffic(e, where)
    if e.kind in ("attention", "agree"):
        return 0, 0
    if e.kind == "ring":
        if where.size <= 1:
            return 0, 0
        cells = math.prod(where.scale) if where.scale else 1.0
        return round(e.nbytes * cells * e.ranks / where.size), e.messages
    if where.size <= 1 or e.nbytes == 0:
        return 0, 0
    if e.kind == "rooted" and e.name != "bcast":  # gathers: the field less this rank's block
        whole = math.prod(where.extent(e.shape, d) for d in range(len(e.shape)))
        own = math.prod(where.interval(e.shape, e.shard, e.sizes, d)[1]
                        for d in range(len(e.shape)))
        return (whole - own) * e.itemsize, (where.size - 1) if whole > own else 0
    return e.nbytes, 1


def _halo_traffic(e: Event, where: Where) -> tuple[int, int]:
    ndim = len(e.shape)
    ext = [where.interval(e.shape, e.shard, e.sizes, d)[1] for d in range(ndim)]
    total = messages = 0
    for d in range(ndim):
        if d not in e.shard or e.lo[d] + e.hi[d] == 0:
            continue
        c = where.split(e.shard[d])[1]
        blocks = where.blocks(e.shape, e.shard, e.sizes, d)
        cross = math.prod(x for j, x in enumerate(ext) if j != d)
        for width, side in ((e.lo[d], -1), (e.hi[d], +1)):
            cells, count, defined = _ghost_cells(blocks, c, width, e.wraps[d], side)
            total += cells * cross * e.itemsize
            messages += count
            ext[d] += defined
    return total, messages


def _ghost_cells(blocks: list[int], c: int, width: int, wraps: bool, side: int):
    """(cells from other ranks, messages, ghosts defined) for one side's ``width``
    ghosts of coordinate ``c``, walking the neighbours' blocks outwards."""
    p = len(blocks)
    if not wraps:  # ghosts past the domain's edge stay undefined
        width = min(width, sum(blocks[:c]) if side < 0 else sum(blocks[c + 1:]))
    if width == 0 or sum(blocks) == 0:
        return 0, 0, width
    cells = messages = 0
    need, k = width, c
    while need > 0:
        k = (k + side) % p
        take = min(need, blocks[k])
        if k != c and take:
            cells, messages = cells + take, messages + 1
        need -= take
    return cells, messages, width


def _overlaps(blocks: list[int], lo: int, hi: int) -> int:
    """How many of the non-empty ``blocks`` (laid end to end) meet ``[lo, hi)``."""
    count = off = 0
    for b in blocks:
        count += b > 0 and off < hi and lo < off + b
        off += b
    return count


def _repartition_traffic(e: Event, where: Where) -> tuple[int, int]:
    """The cells of this rank's destination block that other ranks hold under the
    source layout (it keeps its own), and how many ranks send them."""
    if where.size <= 1:
        return 0, 0
    ndim = len(e.shape)
    dst = [where.interval(e.shape, e.dst_shard, e.dst_sizes, d) for d in range(ndim)]
    src = [where.interval(e.shape, e.shard, e.sizes, d) for d in range(ndim)]
    mine = math.prod(max(0, min(a0 + a, b0 + b) - max(a0, b0))
                     for (a0, a), (b0, b) in zip(dst, src))
    cells = math.prod(n for _, n in dst)
    senders = math.prod(_overlaps(where.blocks(e.shape, e.shard, e.sizes, d), o, o + n)
                        for d, (o, n) in enumerate(dst)) if cells else 0
    return (cells - mine) * e.itemsize, senders - (mine > 0)


def scale_of(trace_shape: Sequence[int], shape: Sequence[int]) -> tuple[float, ...]:
    """Local. Per-dim ratio of a target input shape to the traced one."""
    return tuple(b / a if a else 1.0 for a, b in zip(trace_shape, shape))
