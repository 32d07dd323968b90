"""Pairwise exchanges along one grid axis, point to point: the mirror exchange
of a flip along a sharded dim (block ``c`` to coordinate ``P-1-c``) and the
nonblocking ring shift of ring attention (block ``c`` to ``c + shift``).
Message sizes follow from a layout every rank shares, so neither sends an
agreement check; arrays travel as bytes, device arrays staged through the host
where MPI is not CUDA-aware (``wire``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from . import buffers, runtime
from .buffers import Array
from .clock import blocking, starting
from .errors import LayoutError
from .wire import copy_back, to_wire

if TYPE_CHECKING:
    from mpi4py.typing import BufSpec


# -- mirror exchange ---------------------------------------------------------------------------
@blocking
def mirror_exchange(send: Any, recv: Any, comm: MPI.Comm) -> None:
    """Pairwise collective over ``comm`` (one grid axis). Send the contiguous array
    ``send`` to the rank at the mirrored position ``size - 1 - rank`` and receive
    that rank's array into the contiguous ``recv`` (a flip along a sharded dim
    moves block ``c`` to coordinate ``P-1-c``). The middle rank of an odd axis
    copies to itself. Shapes follow from a layout every rank shares, so there
    is no agreement check."""
    send_arr, recv_arr = buffers.as_array(send), buffers.as_array(recv)
    partner = comm.Get_size() - 1 - comm.Get_rank()
    if partner == comm.Get_rank():
        buffers.namespace(recv_arr).copyto(recv_arr, send_arr.reshape(recv_arr.shape))
        buffers.synchronize(recv_arr)  # as after copy_back
        return
    wire_send, wire_recv = to_wire(send_arr), to_wire(recv_arr)
    comm.Sendrecv([wire_send.reshape(-1).view(np.uint8), MPI.BYTE], dest=partner, sendtag=71,
                  recvbuf=[wire_recv.reshape(-1).view(np.uint8), MPI.BYTE], source=partner,
                  recvtag=71)
    if wire_recv is not recv_arr:  # staged through the host: back to the device
        copy_back(wire_recv, recv_arr)


# -- ring shift (point to point along one grid axis) --------------------------------------------
RING_TAG = 83  # tags RING_TAG + i for the i-th array of one shift


class PendingShift:
    """A started ``ring_shift``: ``test()`` drives it on, ``wait()`` completes it
    (and copies receives staged through the host back to the device)."""

    def __init__(self, requests: list[MPI.Request], staged: list[tuple[Array, Array]],
                 keep: list[Array]) -> None:
        self.requests, self._staged, self._keep = requests, staged, keep

    def test(self) -> bool:
        """Let MPI move the messages on (without a progress thread it does so only
        inside calls); True once every message has arrived."""
        return not self.requests or MPI.Request.Testall(self.requests)

    @blocking
    def wait(self) -> None:
        """Neighbour-wise collective (completes the shift the ring neighbours started).
        Block until every message has arrived and staged receives are copied back to
        the device."""
        if self.requests:
            MPI.Request.Waitall(self.requests)
        for wire, arr in self._staged:
            copy_back(wire, arr)
        self.requests, self._staged, self._keep = [], [], []


def _bytes_of(arr: Array) -> BufSpec:
    if not arr.flags.c_contiguous:
        raise LayoutError("ring_shift needs C-contiguous arrays (they are sent and received "
                          "in place)")
    return [arr.reshape(-1).view(np.uint8), MPI.BYTE]


@starting
def ring_shift(send: Sequence[Any], recv: Sequence[Any], comm: MPI.Comm, shift: int = 1,
               tag: int = RING_TAG) -> PendingShift:
    """Nonblocking pairwise collective over ``comm`` (1-D: one grid axis, ranks in
    coordinate order). Start sending every array of the list ``send`` to the rank
    ``shift`` places on around the ring and receiving the arrays of the rank
    ``shift`` places back into the list ``recv``; returns the pending shift.

    Every array is C-contiguous and is handed to MPI as it is (zero-copy; device
    arrays too with CUDA-aware MPI, staged through the host otherwise). The
    ``recv`` arrays must have the sender's sizes, which callers derive from a
    layout every rank shares (no agreement check). Neither list may be touched
    before ``wait()``. One rank on the axis, or a full turn: a local copy.
    """
    sends = [buffers.as_array(a) for a in send]
    recvs = [buffers.as_array(a) for a in recv]
    size, rank = comm.Get_size(), comm.Get_rank()
    dest, source = (rank + shift) % size, (rank - shift) % size
    if dest == rank:
        for s, r in zip(sends, recvs):
            buffers.namespace(r).copyto(r, s.reshape(r.shape))
            buffers.synchronize(r)  # as after copy_back
        return PendingShift([], [], [])
    requests: list[MPI.Request] = []
    staged: list[tuple[Array, Array]] = []
    keep: list[Array] = []
    for i, r in enumerate(recvs):
        wire = r
        if buffers.is_device(r) and runtime.stages_device_buffers():
            wire = np.empty(r.shape, r.dtype)
            staged.append((wire, r))
        requests.append(comm.Irecv(_bytes_of(wire), source=source, tag=tag + i))
    for i, s in enumerate(sends):
        wire = to_wire(s)
        keep.append(wire)
        requests.append(comm.Isend(_bytes_of(wire), dest=dest, tag=tag + i))
    return PendingShift(requests, staged, keep)
