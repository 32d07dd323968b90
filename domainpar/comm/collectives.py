"""Collectives on arrays laid out by a Decomposition: allreduce, bcast,
allgatherv, scatterv, gatherv and repartition (alltoallv). The pairwise
exchanges along one grid axis (a flip's mirror exchange, ring attention's ring
shift) are in ``pairwise``.

Block data travels as bytes, so every dtype numpy or CuPy knows (complex,
float16, bool) moves unchanged; only allreduce needs MPI arithmetic types.
Blocks are packed into contiguous buffers in rank order and unpacked into
their boxes of the destination; no rank ever builds a global array unless the
operation's result is one (allgatherv, gatherv on the root).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias, TypeVar

import numpy as np
from mpi4py import MPI

from . import buffers, packing
from .buffers import Array
from .clock import blocking, starting
from .decomposition import Decomposition
from .errors import LayoutError, agree, signature_of
from .wire import copy_back, from_wire, to_wire

Box: TypeAlias = tuple[slice, ...]
# One side of a repartition plan: boxes, byte counts, byte displacements.
_Plan: TypeAlias = tuple[list[Box], list[int], list[int]]
_A = TypeVar("_A")

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
_MAX_COUNT = 2**31 - 1  # MPI-3 counts are C ints


def _byte_counts(sizes: Iterable[int], itemsize: int) -> tuple[list[int], list[int]]:
    """Byte counts and displacements of blocks of ``sizes`` elements, back to back."""
    counts = [int(n) * itemsize for n in sizes]
    if sum(counts) > _MAX_COUNT:  # displacements are C ints too
        raise LayoutError(f"{sum(counts)} bytes in one collective exceed MPI's count limit "
                          f"of {_MAX_COUNT} bytes: use more ranks or smaller blocks")
    displs: list[int] = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64).tolist()
    return counts, displs


def _pack_boxes(arr: Array, boxes: Sequence[Box], itemsize: int) -> Array:
    """``arr[box]`` for each box, back to back in one byte buffer."""
    sizes = [arr[b].size for b in boxes]
    buf = buffers.empty((sum(sizes) * itemsize,), np.uint8, arr)
    pos = 0
    for box, n in zip(boxes, sizes):
        packing.pack(arr[box], buf[pos:pos + n * itemsize])
        pos += n * itemsize
    return buf


def _unpack_boxes(buf: Array, arr: Array, boxes: Sequence[Box], itemsize: int) -> None:
    pos = 0
    for box in boxes:
        view = arr[box]
        n = view.size * itemsize
        packing.unpack(view, buf[pos:pos + n])
        pos += n


def _intersect(a: Box, b: Box) -> Box | None:
    """The box shared by slice tuples ``a`` and ``b`` (global coords), or None."""
    out: list[slice] = []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def _shift(box: Box, origin: Sequence[int]) -> Box:
    """Global box -> local box of a block starting at ``origin``."""
    return tuple(slice(s.start - o, s.stop - o) for s, o in zip(box, origin))


def _check_block(op: str, dec: Decomposition, arr_or_exc: Array | Exception | None,
                 problem: str | None = None, root: object = None) -> None:
    """Collective: every rank's block must match its local shape and all dtypes
    (and ``root``, when given) agree."""
    dtype: object = "?"
    if isinstance(arr_or_exc, Exception):
        problem = f"{op}: {arr_or_exc}"
    elif arr_or_exc is not None:
        dtype = arr_or_exc.dtype
        if tuple(arr_or_exc.shape) != dec.local_shape():
            problem = (f"{op}: block shape {tuple(arr_or_exc.shape)} does not match the "
                       f"decomposition's local shape {dec.local_shape()}")
    if root is None:
        what, described = f"{op} dtypes", str(dtype)
    else:
        problem = problem or _root_problem(op, root, dec.grid.size)
        what, described = f"{op} dtypes or roots", f"dtype={dtype} root={root}"
    agree(dec.grid.comm, problem, signature=signature_of(getattr(dtype, "str", dtype), str(root)),
          what=what, described=described)


def _check_own_block(op: str, dec: Decomposition, arr_or_exc: Array | Exception,
                     problem: str | None = None) -> None:
    """Local. ``_check_block`` for callers whose blocks follow from a layout every
    rank shares: a block that does not fit is a caller's bug, raised on this rank."""
    if problem is not None:
        raise LayoutError(problem)
    if isinstance(arr_or_exc, Exception):
        raise LayoutError(f"{op}: {arr_or_exc}")
    if tuple(arr_or_exc.shape) != dec.local_shape():
        raise LayoutError(f"{op}: block shape {tuple(arr_or_exc.shape)} does not match the "
                          f"decomposition's local shape {dec.local_shape()}")


def _check_shape(op: str, comm: MPI.Comm, arr_or_exc: Array | Exception, problem: str | None,
                 check: bool) -> None:
    """Collective where ``check``: every rank agrees on the array's shape and dtype
    and raises alike on any rank's ``problem``. Local otherwise (callers whose
    arrays follow from a layout every rank shares): ``problem`` raised here."""
    if check:
        shape = ("?" if isinstance(arr_or_exc, Exception)
                 else f"{arr_or_exc.dtype}{tuple(arr_or_exc.shape)}")
        agree(comm, problem, signature=signature_of(shape), what=f"{op} shapes or dtypes",
              described=shape)
    elif problem:
        raise LayoutError(problem)


def _root_problem(op: str, root: object, size: int) -> str | None:
    if isinstance(root, (bool, np.bool_)) or not isinstance(root, (int, np.integer)) \
            or not 0 <= root < size:
        return f"{op}: root {root!r} is not a rank of the grid's {size} processes"
    return None


def _as_array_or_error(a: Any) -> Array | TypeError:
    try:
        return buffers.as_array(a)
    except TypeError as exc:
        return exc


# -- allreduce ----------------------------------------------------------------------------
@blocking
def allreduce(a: _A, comm: MPI.Comm, op: str = "sum", *, check: bool = True) -> _A:
    """Collective over ``comm``. Reduce ``a`` elementwise over all processes
    with ``op`` ('sum', 'max', 'min' or 'prod'), in place; returns ``a``.

    ``check`` first makes every rank agree on shape and dtype (one more small
    allreduce); ``check=False`` is for callers whose arrays follow from a layout
    every rank shares (the autograd layer)."""
    arr = _as_array_or_error(a)
    problem = None
    if isinstance(arr, Exception):
        problem = f"allreduce: {arr}"
    elif op not in _OPS:
        problem = f"allreduce: op {op!r} is not one of {sorted(_OPS)}"
    else:
        try:
            MPI._typedict[arr.dtype.char]
        except KeyError:
            problem = f"allreduce: MPI has no arithmetic type for dtype {arr.dtype}"
    _check_shape("allreduce", comm, arr, problem, check)
    assert not isinstance(arr, Exception)  # else agree raised, on every rank
    if comm.Get_size() == 1 or arr.size == 0:
        return a
    work = arr if arr.flags.c_contiguous else buffers.namespace(arr).ascontiguousarray(arr)
    wire = to_wire(work)
    comm.Allreduce(MPI.IN_PLACE, wire, op=_OPS[op])
    if wire is not arr:
        copy_back(wire, arr)
    return a


class PendingReduction:
    """A started ``iallreduce``: ``wait()`` completes it (and, for a device array
    staged through the host, copies the result back)."""

    def __init__(self, request: MPI.Request, wire: Array, arr: Array) -> None:
        self.request, self._wire, self._arr = request, wire, arr

    def test(self) -> bool:
        """Drive the reduction on (MPI progresses nonblocking work inside calls);
        True once it is complete."""
        return self.request.Test()

    @blocking
    def wait(self) -> None:
        """Collective (completes the reduction every rank of ``comm`` started). Block
        until it is complete and the result is in the caller's array."""
        self.request.Wait()
        if self._wire is not self._arr:
            copy_back(self._wire, self._arr)


@starting
def iallreduce(a: Any, comm: MPI.Comm, op: str = "sum") -> PendingReduction:
    """Nonblocking collective over ``comm``. Start reducing the C-contiguous array
    ``a`` in place with ``op``; the result is there after ``wait()``. For hot
    paths (bucketed gradient reduction): no cross-rank agreement check, so every
    rank must pass the same shape and dtype."""
    arr = buffers.as_array(a)
    if not arr.flags.c_contiguous:
        raise LayoutError("iallreduce needs a C-contiguous array (it reduces in place)")
    wire = to_wire(arr)
    return PendingReduction(comm.Iallreduce(MPI.IN_PLACE, wire, op=_OPS[op]), wire, arr)


@blocking
def bcast(a: _A, comm: MPI.Comm, root: int = 0, *, check: bool = True) -> _A:
    """Collective over ``comm``. ``root``'s values of the C-contiguous array ``a``
    copied into every rank's ``a`` (same shape and dtype everywhere).

    ``check`` first makes every rank agree on shape and dtype (one more small
    allreduce); ``check=False`` is for callers whose arrays follow from a layout
    every rank shares (the op rules)."""
    arr = _as_array_or_error(a)
    problem = None
    if isinstance(arr, Exception):
        problem = f"bcast: {arr}"
    elif not arr.flags.c_contiguous:
        problem = "bcast: the array must be C-contiguous (it is written in place)"
    _check_shape("bcast", comm, arr, problem, check)
    assert not isinstance(arr, Exception)  # else agree raised, on every rank
    if comm.Get_size() == 1 or arr.size == 0:
        return a
    wire = to_wire(arr)
    comm.Bcast([wire.reshape(-1).view(np.uint8), MPI.BYTE], root=root)
    if wire is not arr:
        copy_back(wire, arr)
    return a


# -- allgatherv, gatherv, scatterv ------------------------------------------------------------
def _members(dec: Decomposition, comm: MPI.Cartcomm) -> list[int]:
    """Grid ranks of the members of ``comm`` (a sub-communicator of dec.grid
    spanning the sharded axes), in ``comm``'s rank order."""
    grid, kept = dec.grid, sorted(dec.shard.values())
    out = []
    for i in range(comm.Get_size()):
        coords = list(grid.coords)
        for axis, c in zip(kept, comm.Get_coords(i) if kept else ()):
            coords[axis] = c
        out.append(grid.comm.Get_cart_rank(coords))
    return out


@blocking
def allgatherv(block: Any, dec: Decomposition, *, check: bool = True) -> Array:
    """Collective. The global array assembled from every rank's block, on every
    rank (numpy or CuPy, where ``block`` lives). Each group of replicas gathers
    among itself, so replicated axes cost nothing extra.

    ``check`` first makes every rank agree that its block fits ``dec`` and on the
    dtype (one small allreduce); ``check=False`` is for callers whose blocks
    follow from a layout every rank shares (the autograd layer)."""
    arr = _as_array_or_error(block)
    if check:
        _check_block("allgatherv", dec, arr)
    else:
        _check_own_block("allgatherv", dec, arr)
    assert not isinstance(arr, Exception)  # else _check_block raised, on every rank
    out = buffers.empty(dec.global_shape, arr.dtype, arr)
    comm = dec.grid.sub(dec.shard.values())
    members = _members(dec, comm)
    boxes = [dec.local_slices(r) for r in members]
    itemsize = arr.dtype.itemsize
    counts, displs = _byte_counts([int(np.prod(dec.local_shape(r))) for r in members], itemsize)
    send = to_wire(buffers.namespace(arr).ascontiguousarray(arr))
    recv = to_wire(buffers.empty((sum(counts),), np.uint8, arr))
    comm.Allgatherv([send.reshape(-1).view(np.uint8), MPI.BYTE],
                    [recv, (counts, displs), MPI.BYTE])
    _unpack_boxes(from_wire(recv, arr), out, boxes, itemsize)
    return out


@blocking
def gatherv(block: Any, dec: Decomposition, root: int = 0) -> Array | None:
    """Collective. The global array on ``root`` (None elsewhere), from the
    blocks of the ranks at coordinate 0 of every replicated axis."""
    arr = _as_array_or_error(block)
    _check_block("gatherv", dec, arr, root=root)
    assert not isinstance(arr, Exception)  # else _check_block raised, on every rank
    grid = dec.grid
    senders = [r for r in range(grid.size)
               if all(grid.coords_of(r)[a] == 0 for a in dec.replicated_axes)]
    itemsize = arr.dtype.itemsize
    sizes = [int(np.prod(dec.local_shape(r))) if r in senders else 0 for r in range(grid.size)]
    counts, displs = _byte_counts(sizes, itemsize)
    mine = arr if grid.rank in senders else arr[tuple(slice(0, 0) for _ in arr.shape)]
    send = to_wire(buffers.namespace(arr).ascontiguousarray(mine))
    if grid.rank != root:
        grid.comm.Gatherv([send.reshape(-1).view(np.uint8), MPI.BYTE], None, root=root)
        return None
    recv = to_wire(buffers.empty((sum(counts),), np.uint8, arr))
    grid.comm.Gatherv([send.reshape(-1).view(np.uint8), MPI.BYTE],
                      [recv, (counts, displs), MPI.BYTE], root=root)
    out = buffers.empty(dec.global_shape, arr.dtype, arr)
    _unpack_boxes(from_wire(recv, arr), out, [dec.local_slices(r) for r in senders], itemsize)
    return out


@blocking
def scatterv(global_array: Any, dec: Decomposition, root: int = 0) -> Array:
    """Collective. Every rank's block of ``global_array``, which only ``root``
    needs to pass (others pass None). Returns a new numpy or CuPy array."""
    grid = dec.grid
    problem, meta = _root_problem("scatterv", root, grid.size), None
    if problem is None and grid.rank == root:
        arr = _as_array_or_error(global_array)
        if isinstance(arr, Exception):
            problem = f"scatterv: {arr}"
        elif tuple(arr.shape) != dec.global_shape:
            problem = (f"scatterv: the root's array has shape {tuple(arr.shape)}, the "
                       f"decomposition's global shape is {dec.global_shape}")
        else:
            meta = (arr.dtype.str, buffers.is_device(arr))
    agree(grid.comm, problem, signature=signature_of(str(root)), what="scatterv roots",
          described=f"root={root!r}")
    dtype_str, on_device = grid.comm.bcast(meta, root=root)
    dtype = np.dtype(dtype_str)
    itemsize = dtype.itemsize
    counts, displs = _byte_counts(
        [int(np.prod(dec.local_shape(r))) for r in range(grid.size)], itemsize)
    recv_host = np.empty(counts[grid.rank], np.uint8)
    if grid.rank == root:
        send = to_wire(_pack_boxes(arr, [dec.local_slices(r) for r in range(grid.size)],
                                   itemsize))
        grid.comm.Scatterv([send, (counts, displs), MPI.BYTE], [recv_host, MPI.BYTE], root=root)
    else:
        grid.comm.Scatterv(None, [recv_host, MPI.BYTE], root=root)
    block = recv_host.view(dtype).reshape(dec.local_shape())
    return buffers.to_device(block) if on_device else block


# -- repartition ------------------------------------------------------------------------------
@blocking
def repartition(block: Any, src: Decomposition, dst: Decomposition, *,
                check: bool = True) -> Array:
    """Collective. Move data laid out by ``src`` into the layout ``dst`` of the
    same global shape on the same grid, or on a grid of the same processes
    (``ProcessGrid.merged``: a dim cut over several grid axes) (alltoallv):
    e.g. from sharded-on-H to sharded-on-W, from uneven to balanced blocks, or
    from H and W on two axes to H over both. Returns this rank's new block
    (numpy or CuPy, where ``block`` lives).

    A destination block takes each piece from the source rank that shares its
    coordinates on the axes ``src`` replicates, so replicas never send twice;
    where every rank's destination block lies in its own source block (``dst``
    only cuts dims more, along axes ``src`` replicates), no message is sent.

    ``check`` first makes every rank agree that its block fits ``src`` and on the
    dtype (one small allreduce); ``check=False`` is for callers whose blocks
    follow from a layout every rank shares (the autograd layer). Either way every
    rank raises alike on layouts that do not fit, the count limit included: a
    rank's message sizes are checked where any rank's block could reach it.
    """
    arr = _as_array_or_error(block)
    problem = plan = None
    if src.grid.root is not dst.grid.root:
        problem = ("repartition: source and destination decompositions are on different grids "
                   "(neither is ProcessGrid.merged from the other's root)")
    elif src.global_shape != dst.global_shape:
        problem = (f"repartition: global shapes differ ({src.global_shape} -> "
                   f"{dst.global_shape})")
    if not check and not isinstance(arr, Exception) and (
            problem is not None or not _within_count(src, dst, arr.dtype.itemsize)):
        check = True  # a problem every rank shares, or one this rank alone may meet
    if problem is None and not isinstance(arr, Exception):
        try:  # this rank's message sizes: over the count limit on one rank only
            plan = _repartition_plan(src, dst, arr.dtype.itemsize)
        except LayoutError as exc:
            problem = f"repartition: {exc}"
    if check:
        _check_block("repartition", src, arr, problem)
    else:
        _check_own_block("repartition", src, arr, problem)
    assert plan is not None and not isinstance(arr, Exception)  # else _check_block raised
    (send_boxes, scounts, sdispls), (recv_boxes, rcounts, rdispls) = plan
    out = buffers.empty(dst.local_shape(), arr.dtype, arr)
    if _stays_local(src, dst):  # its own piece (or none), copied straight: no message
        for sent, kept in zip(send_boxes, recv_boxes):
            out[kept] = arr[sent]
        return out
    send = _pack_boxes(arr, send_boxes, arr.dtype.itemsize)
    recv = buffers.empty((sum(rcounts),), np.uint8, arr)
    wire_send, wire_recv = to_wire(send), to_wire(recv)
    src.grid.comm.Alltoallv([wire_send, (scounts, sdispls), MPI.BYTE],
                            [wire_recv, (rcounts, rdispls), MPI.BYTE])
    _unpack_boxes(from_wire(wire_recv, arr), out, recv_boxes, arr.dtype.itemsize)
    return out


@functools.lru_cache(maxsize=1024)
def _stays_local(src: Decomposition, dst: Decomposition) -> bool:
    """Local, the same on every rank. Whether every rank's ``dst`` block lies in its
    own ``src`` block: ``dst`` lays out the dims ``src`` cuts as ``src`` does (so
    it may cut more dims only along axes ``src`` replicates)."""
    return src.grid is dst.grid and all(
        dst.shard.get(d) == a and dst.block_sizes(d) == src.block_sizes(d)
        for d, a in src.shard.items())


@functools.lru_cache(maxsize=1024)
def _repartition_plan(src: Decomposition, dst: Decomposition,
                      itemsize: int) -> tuple[_Plan, _Plan]:
    """Index math of a repartition, for this rank (cached; callers do not change it):
    (boxes, byte counts, byte displacements) of what it sends, in rank order, and
    of what it receives."""
    grid, in_dst = src.grid, src.grid.ranks_in(dst.grid)  # ranks of src's grid, in dst's
    me, reps = grid.coords, src.replicated_axes
    mine_src, mine_dst = src.local_slices(), dst.local_slices()
    send_boxes: list[Box] = []
    recv_boxes: list[Box] = []
    send_sizes: list[int] = []
    recv_sizes: list[int] = []
    for r in range(grid.size):
        coords = grid.coords_of(r)
        if any(coords[a] != me[a] for a in reps):  # another replica group's business
            send_sizes.append(0)
            recv_sizes.append(0)
            continue
        out_box = _intersect(mine_src, dst.local_slices(in_dst[r]))
        in_box = _intersect(src.local_slices(r), mine_dst)
        send_sizes.append(_box_size(out_box))
        recv_sizes.append(_box_size(in_box))
        if out_box is not None:
            send_boxes.append(_shift(out_box, src.offsets()))
        if in_box is not None:
            recv_boxes.append(_shift(in_box, dst.offsets()))
    return ((send_boxes, *_byte_counts(send_sizes, itemsize)),
            (recv_boxes, *_byte_counts(recv_sizes, itemsize)))


def _within_count(src: Decomposition, dst: Decomposition, itemsize: int) -> bool:
    """Local, the same on every rank. Whether no rank's repartition from ``src`` to
    ``dst`` can pass MPI's count limit: what a rank sends is at most its source
    block, what it receives at most its destination block, and neither is larger
    than the largest block along each dim taken together."""
    return max(_largest_block(src), _largest_block(dst)) * itemsize <= _MAX_COUNT


@functools.lru_cache(maxsize=1024)
def _largest_block(dec: Decomposition) -> int:
    """Local. An upper bound on any rank's block cells under ``dec``."""
    return math.prod(max(dec.block_sizes(d)) for d in range(len(dec.global_shape)))


def _box_size(box: Box | None) -> int:
    return 0 if box is None else int(np.prod([s.stop - s.start for s in box]))
