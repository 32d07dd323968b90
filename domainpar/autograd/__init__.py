"""Autograd Functions for the communication primitives (one per primitive,
forward and adjoint side by side) and functional forms of them.

The functional forms skip the Function when nothing needs a gradient and the
primitive is the identity (``broadcast``) or when the layouts already agree
(``repartition``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

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


def halo_fill(padded: torch.Tensor, halo: HaloExchange, *, owned: bool = False) -> torch.Tensor:
    """Neighbour-wise collective. ``padded`` with its ghosts filled: a new tensor,
    or with ``owned`` (the caller just made ``padded`` and nothing else reads it)
    ``padded`` itself where it is contiguous, filled in place without a copy."""
    out: torch.Tensor = HaloFill.apply(padded, halo, owned and padded.is_contiguous())
    return out


def halo_accumulate(padded: torch.Tensor, halo: HaloExchange) -> torch.Tensor:
    """Neighbour-wise collective. The adjoint of ``halo_fill`` (a new tensor)."""
    out: torch.Tensor = HaloAccumulate.apply(padded, halo)
    return out


def allreduce_sum(partial: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
    """Collective over ``comm``. Partial values summed into a replicated value."""
    out: torch.Tensor = AllreduceSum.apply(partial, comm)
    return out


def broadcast(replicated: torch.Tensor, comm: MPI.Comm,
              defer: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """A replicated value entering per-rank work; backward sums over ``comm``
    (collective) or hands the partial gradient to ``defer``."""
    if comm.Get_size() == 1 and defer is None:
        return replicated
    out: torch.Tensor = Broadcast.apply(replicated, comm, defer)
    return out


def scatter(global_or_placeholder: torch.Tensor, dec: Decomposition,
            root: int = 0) -> torch.Tensor:
    """Collective. The root's tensor cut into blocks (others pass a placeholder)."""
    out: torch.Tensor = Scatter.apply(global_or_placeholder, dec, root)
    return out


def gather(block: torch.Tensor, dec: Decomposition, root: int = 0) -> torch.Tensor:
    """Collective. The global tensor on ``root``; an empty tensor elsewhere."""
    out: torch.Tensor = Gather.apply(block, dec, root)
    return out


def allgather(block: torch.Tensor, dec: Decomposition) -> torch.Tensor:
    """Collective. The global tensor, replicated on every rank."""
    out: torch.Tensor = Allgather.apply(block, dec)
    return out


def shard(replicated: torch.Tensor, dec: Decomposition) -> torch.Tensor:
    """Local (collective in backward). This rank's block of a replicated tensor."""
    out: torch.Tensor = Shard.apply(replicated, dec)
    return out


def repartition(block: torch.Tensor, src: Decomposition, dst: Decomposition) -> torch.Tensor:
    """Collective. ``block`` moved from layout ``src`` to layout ``dst`` (no message
    and no copy where every rank holds the same cells under both)."""
    if src.same_blocks(dst):
        return block
    out: torch.Tensor = Repartition.apply(block, src, dst)
    return out


def mirror(block: torch.Tensor, comm: MPI.Comm, recv_shape: Sequence[int]) -> torch.Tensor:
    """Pairwise collective over the 1-D ``comm``. The block of the rank at the
    mirrored position (``size - 1 - rank``), of shape ``recv_shape``."""
    if comm.Get_size() == 1:
        return block
    out: torch.Tensor = MirrorExchange.apply(block.contiguous(), comm, tuple(recv_shape))
    return out


def ring_shift(block: torch.Tensor, comm: MPI.Comm, recv_shape: Sequence[int] | None = None,
               shift: int = 1) -> torch.Tensor:
    """Pairwise collective over the 1-D ``comm``. The block of the rank ``shift``
    places back around the ring (``(rank - shift) % size``), of shape
    ``recv_shape`` (default: ``block``'s); this rank's block goes ``shift``
    places on."""
    if comm.Get_size() == 1:
        return block
    shape = block.shape if recv_shape is None else recv_shape
    out: torch.Tensor = RingShift.apply(block.contiguous(), comm, tuple(shape), int(shift))
    return out


__all__ = ["Allgather", "AllreduceSum", "Broadcast", "Gather", "HaloAccumulate", "HaloFill",
           "MirrorExchange", "Repartition", "RingShift", "Scatter", "Shard", "allgather",
           "allreduce_sum", "allreduce_tensor", "broadcast", "gather", "halo_accumulate",
           "halo_fill", "mirror", "repartition", "ring_shift", "scatter", "shard"]
