"""Autograd Functions for the communication primitives (one per primitive,
forward and adjoint side by side) and functional forms of them.

The functional forms skip the Function when nothing needs a gradient and the
primitive is the identity (``broadcast``) or when the layouts already agree
(``repartition``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from mpi4py import MPI

from ..comm import HaloExchange
from ..comm.decomposition import Decomposition
from .primitives import (
    Allgather,
    AllreduceSum,
    Broadcast,
    Gather,
    HaloAccumulate,
    HaloFill,
    MirrorExchange,
    Repartition,
    RingShift,
    Scatter,
    Shard,
    allreduce_tensor,
)


def halo_fill(padded: torch.Tensor, halo: HaloExchange) -> torch.Tensor:
    """Neighbour-wise collective. ``padded`` with its ghosts filled (a new tensor)."""
    return HaloFill.apply(padded, halo)


def halo_accumulate(padded: torch.Tensor, halo: HaloExchange) -> torch.Tensor:
    """Neighbour-wise collective. The adjoint of ``halo_fill`` (a new tensor)."""
    return HaloAccumulate.apply(padded, halo)


def allreduce_sum(partial: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
    """Collective over ``comm``. Partial values summed into a replicated value."""
    return AllreduceSum.apply(partial, comm)


def broadcast(replicated: torch.Tensor, comm: MPI.Comm,
              defer: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """A replicated value entering per-rank work; backward sums over ``comm``
    (collective) or hands the partial gradient to ``defer``."""
    if comm.Get_size() == 1 and defer is None:
        return replicated
    return Broadcast.apply(replicated, comm, defer)


def scatter(global_or_placeholder: torch.Tensor, dec: Decomposition, root: int = 0):
    """Collective. The root's tensor cut into blocks (others pass a placeholder)."""
    return Scatter.apply(global_or_placeholder, dec, root)


def gather(block: torch.Tensor, dec: Decomposition, root: int = 0) -> torch.Tensor:
    """Collective. The global tensor on ``root``; an empty tensor elsewhere."""
    return Gather.apply(block, dec, root)


def allgather(block: torch.Tensor, dec: Decomposition) -> torch.Tensor:
    """Collective. The global tensor, replicated on every rank."""
    return Allgather.apply(block, dec)


def shard(replicated: torch.Tensor, dec: Decomposition) -> torch.Tensor:
    """Local (collective in backward). This rank's block of a replicated tensor."""
    return Shard.apply(replicated, dec)


def repartition(block: torch.Tensor, src: Decomposition, dst: Decomposition) -> torch.Tensor:
    """Collective. ``block`` moved from layout ``src`` to layout ``dst``."""
    if src == dst:
        return block
    return Repartition.apply(block, src, dst)


def mirror(block: torch.Tensor, comm: MPI.Comm, recv_shape) -> torch.Tensor:
    """Pairwise collective over the 1-D ``comm``. The block of the rank at the
    mirrored position (``size - 1 - rank``), of shape ``recv_shape``."""
    if comm.Get_size() == 1:
        return block
    return MirrorExchange.apply(block.contiguous(), comm, tuple(recv_shape))


def ring_shift(block: torch.Tensor, comm: MPI.Comm, recv_shape=None,
               shift: int = 1) -> torch.Tensor:
    """Pairwise collective over the 1-D ``comm``. The block of the rank ``shift``
    places back around the ring (``(rank - shift) % size``), of shape
    ``recv_shape`` (default: ``block``'s); this rank's block goes ``shift``
    places on."""
    if comm.Get_size() == 1:
        return block
    shape = block.shape if recv_shape is None else recv_shape
    return RingShift.apply(block.contiguous(), comm, tuple(shape), int(shift))


__all__ = ["Allgather", "AllreduceSum", "Broadcast", "Gather", "HaloAccumulate", "HaloFill",
           "MirrorExchange", "Repartition", "RingShift", "Scatter", "Shard", "allgather",
           "allreduce_sum", "allreduce_tensor", "broadcast", "gather", "halo_accumulate",
           "halo_fill", "mirror", "repartition", "ring_shift", "scatter", "shard"]
