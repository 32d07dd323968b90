"""One torch.autograd.Function per communication primitive, forward and adjoint
side by side.

Every Function here works on plain local tensors (a rank's block, or a value
replicated on every rank) and takes the layout it needs (a Decomposition, a
HaloExchange or a communicator) as a non-tensor argument. The primitives come
in adjoint pairs, and each one's ``backward`` is its partner's ``forward``:

=========================  ==========================================
forward                    backward (the adjoint)
=========================  ==========================================
HaloFill                   halo accumulate (HaloAccumulate's forward)
AllreduceSum -> replicated identity (Broadcast's forward)
Broadcast (replicated in)  allreduce-sum (AllreduceSum's forward)
Scatter  (root -> blocks)  gatherv to the root (Gather's forward)
Gather   (blocks -> root)  scatterv from the root
Allgather (-> replicated)  slice this rank's block (Shard's forward)
Shard (replicated -> blk)  allgatherv (Allgather's forward)
Repartition src -> dst     repartition dst -> src
MirrorExchange c <-> P-1-c  the same exchange (an involution)
RingShift c -> c+s         the shift the other way, c -> c-s
=========================  ==========================================

A value is *replicated* when every rank of the communicator holds the same
copy; its gradient is one logical gradient, held (identically) by every rank,
and never multiplied by the number of ranks (docs/design.md, "Autograd semantics").
Inner products for the adjoint tests count a replicated value once and a
distributed one as the sum over blocks (``domainpar.testing.adjoint_test``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from mpi4py import MPI

from ..comm import HaloExchange, collectives, pairwise
from ..comm.decomposition import Decomposition
from ._arrays import from_array, to_array

# MPI has no arithmetic on half types: they are reduced in float32.
_WIDENED = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format)


def allreduce_tensor(t: torch.Tensor, comm: MPI.Comm, op: str = "sum") -> torch.Tensor:
    """Collective over ``comm``. A new tensor: ``t`` reduced elementwise with ``op``
    over the ranks of ``comm``. Not differentiable (a building block)."""
    if comm.Get_size() == 1:
        return _contiguous_copy(t)
    wide = _WIDENED.get(t.dtype)
    out = t.detach().to(wide, memory_format=torch.contiguous_format, copy=True) if wide \
        else _contiguous_copy(t)
    # No agreement check: callers derive the shape from a layout all ranks share.
    collectives.allreduce(to_array(out), comm, op, check=False)
    return out.to(t.dtype) if wide else out


# -- halo fill / accumulate -------------------------------------------------------------
# The pair in place, for Functions that fuse the exchange with their local work
# (ops/conv.py's HaloConv) and own their buffer; HaloFill/HaloAccumulate below
# are the same pair on a copy, as autograd Functions.
def fill_in_place(t: torch.Tensor, halo: HaloExchange) -> torch.Tensor:
    """Neighbour-wise collective. ``halo.fill`` on the contiguous ``t``, in place:
    its ghost cells get the owners' values. Adjoint: ``accumulate_in_place``."""
    halo.fill(to_array(t), check=False)
    return t


def accumulate_in_place(t: torch.Tensor, halo: HaloExchange) -> torch.Tensor:
    """Neighbour-wise collective. ``halo.accumulate`` on the contiguous ``t``, in
    place: ghost cells are added into their owners and zeroed; half types add in
    float32 (bfloat16 travels as its bit pattern, which numpy would add as
    integers). Adjoint: ``fill_in_place``."""
    wide = _WIDENED.get(t.dtype)
    if wide is None:
        halo.accumulate(to_array(t), check=False)
        return t
    w = t.to(wide)
    halo.accumulate(to_array(w), check=False)
    return t.copy_(w)


class HaloFill(torch.autograd.Function):
    """Neighbour-wise collective. Ghost cells of a padded block get the owners'
    values. Adjoint: ghosts are sent back, added to the owners, and zeroed.

    ``in_place``: the caller owns the contiguous ``padded`` (a buffer it just
    made, which nothing else reads), so its ghosts are filled where they are
    (marked dirty for autograd) instead of in a copy."""

    @staticmethod
    def forward(ctx: Any, padded: torch.Tensor, halo: HaloExchange,
                in_place: bool = False) -> torch.Tensor:
        ctx.halo = halo
        if in_place:
            ctx.mark_dirty(padded)
            return fill_in_place(padded, halo)
        return fill_in_place(_contiguous_copy(padded), halo)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return HaloAccumulate.apply(grad, ctx.halo), None, None


class HaloAccumulate(torch.autograd.Function):
    """Neighbour-wise collective. The adjoint of HaloFill (and HaloFill its adjoint)."""

    @staticmethod
    def forward(ctx: Any, padded: torch.Tensor, halo: HaloExchange) -> torch.Tensor:
        ctx.halo = halo
        return accumulate_in_place(_contiguous_copy(padded), halo)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return HaloFill.apply(grad, ctx.halo), None


# -- allreduce to a replicated value / broadcast of a replicated value -------------------
class AllreduceSum(torch.autograd.Function):
    """Collective over ``comm``. Per-rank partial values summed into one value
    replicated on every rank. Backward: identity, since the replicated upstream
    gradient is one logical gradient, which every partial receives whole."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
        ctx.comm = comm
        return allreduce_tensor(partial, comm, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return Broadcast.apply(grad, ctx.comm, None), None


class Broadcast(torch.autograd.Function):
    """Local forward, collective backward over ``comm``. A replicated value (a
    parameter, say) entering per-rank computations: the identity forward, and
    the sum of the per-rank partial gradients backward.

    ``defer``, when given, receives the partial gradient instead and the
    Function returns none: DomainParallel reduces it later, bucketed.
    """

    @staticmethod
    def forward(ctx: Any, replicated: torch.Tensor, comm: MPI.Comm,
                defer: Callable[[torch.Tensor], None] | None) -> torch.Tensor:
        ctx.comm, ctx.defer = comm, defer
        return replicated.view_as(replicated)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.defer is not None:
            ctx.defer(grad)
            return None, None, None
        return AllreduceSum.apply(grad, ctx.comm), None, None


# -- scatter / gather between one root and the blocks ------------------------------------
class Scatter(torch.autograd.Function):
    """Collective. The root's global tensor cut into every rank's block. Other
    ranks pass a placeholder with the right dtype and device (and the root's
    requires_grad, so that every rank takes part in backward). Adjoint: Gather."""

    @staticmethod
    def forward(ctx: Any, global_or_placeholder: torch.Tensor, dec: Decomposition, root: int) -> torch.Tensor:
        ctx.dec, ctx.root = dec, root
        like = global_or_placeholder
        mine = to_array(like) if dec.grid.rank == root else None
        return from_array(collectives.scatterv(mine, dec, root), like)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return Gather.apply(grad, ctx.dec, ctx.root), None, None


class Gather(torch.autograd.Function):
    """Collective. Every block assembled into the global tensor on ``root``; the
    other ranks get an empty tensor. Adjoint: Scatter."""

    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, dec: Decomposition, root: int) -> torch.Tensor:
        ctx.dec, ctx.root = dec, root
        out = collectives.gatherv(to_array(block), dec, root)
        if out is None:
            return block.new_empty((0,))
        return from_array(out, block)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return Scatter.apply(grad, ctx.dec, ctx.root), None, None


# -- allgather to a replicated tensor / shard of a replicated tensor ---------------------
class Allgather(torch.autograd.Function):
    """Collective. Every block assembled into the global tensor, replicated on
    every rank. Adjoint: Shard (each rank keeps its block of the one logical
    gradient)."""

    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, dec: Decomposition) -> torch.Tensor:
        ctx.dec = dec
        return from_array(collectives.allgatherv(to_array(block), dec, check=False), block)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return Shard.apply(grad, ctx.dec), None


class Shard(torch.autograd.Function):
    """Local forward, collective backward. A replicated global tensor cut to this
    rank's block (no message). Adjoint: Allgather, which assembles the blocks'
    gradients into the replicated tensor's gradient."""

    @staticmethod
    def forward(ctx: Any, replicated: torch.Tensor, dec: Decomposition) -> torch.Tensor:
        ctx.dec = dec
        return _contiguous_copy(replicated[dec.local_slices()])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return Allgather.apply(grad.contiguous(), ctx.dec), None


# -- repartition ----------------------------------------------------------------------------
class Repartition(torch.autograd.Function):
    """Collective. A block laid out by ``src`` moved into the layout ``dst`` of
    the same global shape (alltoallv). Adjoint: the reverse repartition."""

    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, src: Decomposition, dst: Decomposition) -> torch.Tensor:
        ctx.src, ctx.dst = src, dst
        # strided as it is: the send boxes are packed out of it, one copy either way
        sent = to_array(block, contiguous=False)
        return from_array(collectives.repartition(sent, src, dst, check=False), block)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return Repartition.apply(grad, ctx.dst, ctx.src), None, None


# -- mirror exchange (the data movement of a flip along a sharded dim) ----------------------
class MirrorExchange(torch.autograd.Function):
    """Pairwise collective over ``comm`` (a 1-D axis communicator). Every rank
    sends its block to the rank at the mirrored position ``size - 1 - rank`` and
    receives that rank's block, of shape ``recv_shape``. A permutation that is its
    own inverse, so the adjoint is the same exchange with the shapes swapped."""

    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, comm: MPI.Comm, recv_shape: tuple[int, ...]) -> torch.Tensor:
        ctx.comm, ctx.send_shape = comm, tuple(block.shape)
        return _mirror(block, comm, tuple(recv_shape))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return MirrorExchange.apply(grad.contiguous(), ctx.comm, ctx.send_shape), None, None


def _mirror(block: torch.Tensor, comm: MPI.Comm, recv_shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(recv_shape, dtype=block.dtype, device=block.device)
    pairwise.mirror_exchange(to_array(block), to_array(out), comm)
    return out


# -- ring shift (the data movement of ring attention) ----------------------------------------
class RingShift(torch.autograd.Function):
    """Pairwise collective over ``comm`` (a 1-D axis communicator). Every rank sends
    its block to the rank ``shift`` places on around the ring and receives the
    block of the rank ``shift`` places back, of shape ``recv_shape``. A
    permutation, so the adjoint is its inverse: the shift the other way, with
    the shapes swapped."""

    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, comm: MPI.Comm, recv_shape: tuple[int, ...],
                shift: int) -> torch.Tensor:
        ctx.comm, ctx.send_shape, ctx.shift = comm, tuple(block.shape), shift
        return _ring(block, comm, tuple(recv_shape), shift)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return RingShift.apply(grad.contiguous(), ctx.comm, ctx.send_shape, -ctx.shift), \
            None, None, None


def _ring(block: torch.Tensor, comm: MPI.Comm, recv_shape: tuple[int, ...], shift: int) -> torch.Tensor:
    out = torch.empty(recv_shape, dtype=block.dtype, device=block.device)
    pairwise.ring_shift([to_array(block)], [to_array(out)], comm, shift).wait()
    return out
