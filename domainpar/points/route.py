"""The routed exchange: rows sent to (or fetched from) the ranks that own them,
by global index, and its adjoint.

A ``Route`` is the plan of one exchange over a communicator: for each item this
rank sends, the destination rank and the position it addresses there. Building
it costs one alltoall of counts and one alltoallv of positions; after that two
Functions use it, each the other's adjoint (docs/design.md, "Adjoint pairs"):

=========================  ==========================================
forward                    backward (the adjoint)
=========================  ==========================================
Push  (items -> owners)    Pull: the owners' rows sent back
Pull  (owners -> items)    Push: the gradients sent to the owners
=========================  ==========================================

``Push`` delivers the items in *arrival order* (by source rank, then the
sender's order); ``route.recv_local`` names the position each one addresses,
so the owner scatters (or adds, or reduces) them locally, and autograd records
that local op. ``Pull`` is the reverse: the owner lines up one row per arrival
(``rows[route.recv_local]``) and each sender receives its rows back in its own
item order. Gathering by global index is therefore ``Pull(block[recv_local])``
and the adjoint of a gather, a scatter-add to the owners, comes out of it.

Data is staged through host memory (the counts are per rank and only known at
run time; no CUDA-aware path yet).
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ..comm.errors import LayoutError

_MAX_COUNT = 2**31 - 1  # MPI counts are C ints


class Route:
    """Collective over ``comm``. The plan of a routed exchange: item ``i`` of this
    rank goes to rank ``dest_rank[i]`` and addresses position ``dest_local[i]``
    there (both 1-D integer tensors of equal length)."""

    def __init__(self, comm: MPI.Comm, dest_rank: torch.Tensor, dest_local: torch.Tensor):
        self.comm = comm
        size = comm.Get_size()
        dest_rank = dest_rank.detach().to("cpu", torch.int64).reshape(-1)
        self.n_send = int(dest_rank.numel())
        self.order = torch.argsort(dest_rank, stable=True)
        self.send_counts = torch.bincount(dest_rank, minlength=size).tolist()
        self.recv_counts = list(comm.alltoall(self.send_counts)) if size > 1 \
            else list(self.send_counts)
        local = dest_local.detach().to("cpu", torch.int64).reshape(-1)[self.order]
        self.recv_local = exchange(comm, local, self.send_counts, self.recv_counts)

    @property
    def n_recv(self) -> int:
        """Local. The number of items this rank receives."""
        return int(sum(self.recv_counts))

    def send(self, rows: torch.Tensor) -> torch.Tensor:
        """Collective. Not differentiable (``push`` is). Items, in this rank's order,
        delivered to their owners in arrival order."""
        return exchange(self.comm, rows[self.order.to(rows.device)], self.send_counts,
                        self.recv_counts)

    def send_back(self, rows: torch.Tensor) -> torch.Tensor:
        """Collective. Not differentiable (``pull`` is). One row per arrival sent
        back to its sender, in the sender's item order."""
        back = exchange(self.comm, rows, self.recv_counts, self.send_counts)
        out = torch.empty_like(back)
        out[self.order.to(back.device)] = back
        return out


def exchange(comm: MPI.Comm, rows: torch.Tensor, send_counts, recv_counts) -> torch.Tensor:
    """Collective over ``comm``. Alltoallv of whole rows (dim 0): ``send_counts[r]``
    consecutive rows go to rank ``r``; the result holds ``recv_counts[r]`` rows from
    each rank ``r``, in rank order. Same dtype and device as ``rows``."""
    rows = rows.detach()
    tail = tuple(rows.shape[1:])
    if comm.Get_size() == 1:
        return rows.clone()
    host = rows.to("cpu").contiguous()
    out = torch.empty((int(sum(recv_counts)),) + tail, dtype=rows.dtype)
    width = int(np.prod(tail, dtype=np.int64)) * host.element_size()
    scounts, sdispls = _bytes(send_counts, width)
    rcounts, rdispls = _bytes(recv_counts, width)
    comm.Alltoallv([_byte_view(host), (scounts, sdispls), MPI.BYTE],
                   [_byte_view(out), (rcounts, rdispls), MPI.BYTE])
    return out.to(rows.device)


def _byte_view(t: torch.Tensor) -> np.ndarray:
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, np.uint8)
    return flat.view(torch.uint8).numpy()


def _bytes(counts, width: int):
    sizes = [int(c) * width for c in counts]
    if sum(sizes) > _MAX_COUNT:
        raise LayoutError(f"{sum(sizes)} bytes in one routed exchange exceed MPI's count limit "
                          f"of {_MAX_COUNT}: use more ranks or fewer neighbours per point")
    displs = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64).tolist()
    return sizes, displs


class Push(torch.autograd.Function):
    """Collective over the route's communicator. Items sent to their owners
    (arrival order). Adjoint: Pull."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, route: Route):
        ctx.route = route
        return route.send(rows)

    @staticmethod
    def backward(ctx, grad):
        return Pull.apply(grad.contiguous(), ctx.route), None


class Pull(torch.autograd.Function):
    """Collective over the route's communicator. One row per arrival sent back to
    the item that asked for it. Adjoint: Push."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, route: Route):
        ctx.route = route
        return route.send_back(rows)

    @staticmethod
    def backward(ctx, grad):
        return Push.apply(grad.contiguous(), ctx.route), None


def push(rows: torch.Tensor, route: Route) -> torch.Tensor:
    """Collective. ``rows`` (one per item) delivered to the owners, arrival order."""
    return Push.apply(rows, route)


def pull(rows: torch.Tensor, route: Route) -> torch.Tensor:
    """Collective. ``rows`` (one per arrival) returned to the items that asked."""
    return Pull.apply(rows, route)


def owners(offsets: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Local. The block (rank) holding each global ``index``, given the block
    offsets ``[0, o_1, .., N]`` (empty blocks allowed: the last block starting at
    or before the index that is not empty)."""
    return torch.searchsorted(offsets[1:].to(index.device), index, right=True)


def fetch_route(comm: MPI.Comm, offsets, index: torch.Tensor) -> Route:
    """Collective. The route that fetches the rows at the global ``index`` (any
    shape, in range) from the blocks whose starts are ``offsets``."""
    offs = torch.as_tensor(offsets, dtype=torch.int64)
    flat = index.detach().reshape(-1).to("cpu", torch.int64)
    rank = owners(offs, flat)
    return Route(comm, rank, flat - offs[rank])


def fetch(block: torch.Tensor, comm: MPI.Comm, offsets, index: torch.Tensor) -> torch.Tensor:
    """Collective. The rows ``block`` (this rank's rows, dim 0) of a row-sharded
    tensor at the global ``index`` (any shape, in range): a tensor of shape
    ``index.shape + block.shape[1:]``. Differentiable in ``block``: backward
    adds each row's gradient into its owner's block (Pull's adjoint, Push)."""
    route = fetch_route(comm, offsets, index)
    rows = pull(block[route.recv_local.to(block.device)], route)
    return rows.reshape(tuple(index.shape) + tuple(block.shape[1:]))
