"""Replicated tensors (parameters, masks, fields) entering an op on DomainTensors.

A replicated tensor used by every rank's block computation gets, on each rank,
only a partial gradient; its true gradient is the sum of the partials over the
grid axes along which the op's output is sharded (docs/design.md, "Autograd
semantics"). ``enter_domain`` puts that sum into the graph: a Broadcast
(backward: allreduce) over the axes along which the tensor is broadcast, and a
Shard (backward: allgatherv) over the axes along which it is sliced to the
block. Inside ``DomainParallel`` the sum is deferred instead: the deferrer
registered here receives the partial gradient and reduces it later, bucketed.
"""
from __future__ import annotations

import contextvars
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias

import torch
from mpi4py import MPI

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from ..comm.errors import agree, signature_of
from . import layout

# The active deferrer: ``deferrer(tensor, comm)`` returns the callable that
# receives the tensor's partial gradient, or None to reduce in the op's backward.
Deferrer: TypeAlias = Callable[[torch.Tensor, MPI.Cartcomm],
                               Callable[[torch.Tensor], None] | None]
_DEFERRER: contextvars.ContextVar[Deferrer | None] = contextvars.ContextVar(
    "domainpar_deferrer", default=None)


def set_deferrer(deferrer: Deferrer | None) -> contextvars.Token[Deferrer | None]:
    """Local. Make ``deferrer`` the active one (DomainParallel's forward); returns the
    token for ``reset_deferrer``."""
    return _DEFERRER.set(deferrer)


def reset_deferrer(token: contextvars.Token[Deferrer | None]) -> None:
    """Local. Restore the deferrer that was active before ``set_deferrer`` gave ``token``."""
    _DEFERRER.reset(token)


# Tensors already found equal on every rank (id -> tensor, weakly): each is checked once.
_CHECKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def complex_view_of(p: torch.Tensor) -> torch.Tensor | None:
    """Local. The real tensor that ``p`` is ``torch.view_as_complex`` of, or None.
    (``Tensor._base``, the base of a view, is private but documented in torch's
    "Tensor Views" page; tests/test_domain_parallel.py checks its use here,
    measured on torch 2.13.)"""
    base = p._base
    if base is None or not p.is_complex() or base.is_complex() or \
            tuple(base.shape) != tuple(p.shape) + (2,):
        return None
    return base


def parameter_view_of(p: torch.Tensor) -> torch.nn.Parameter | None:
    """Local. The parameter that ``p`` is a view of in its own dtype (a slice,
    ``param[..., :k]``, or the parameter seen whole through another view), or None.
    Its values are the parameter's, so it is checked and reduced as the parameter
    (``Tensor._base``, see ``complex_view_of``)."""
    base = p._base
    if not isinstance(base, torch.nn.Parameter) or base.dtype != p.dtype or \
            not base.is_contiguous():
        return None
    return base


def base_of(p: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """Local. The tensor whose values the view ``p`` holds, and whether ``p`` is its
    ``view_as_complex`` (``complex_view_of``; else a view of a parameter in its own
    dtype, ``parameter_view_of``); None for any other tensor."""
    base = complex_view_of(p)
    if base is not None:
        return base, True
    base = parameter_view_of(p)
    return None if base is None else (base, False)


def view_gradient(view: torch.Tensor, base: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Local. The gradient of the contiguous ``base`` from the gradient ``grad`` of its
    view ``view`` (``parameter_view_of``): ``grad`` where the view's elements lie,
    zeros elsewhere (as torch's own backward of a view), summed where an element
    lies more than once (an expanded or unfolded view)."""
    geometry = (view.shape, view.stride(), view.storage_offset() - base.storage_offset())
    out = torch.zeros(base.shape, dtype=grad.dtype, device=grad.device)
    if not _overlapping(view.shape, view.stride()):
        out.as_strided(*geometry).copy_(grad)
        return out
    where = torch.arange(base.numel(), device=grad.device).view(base.shape).as_strided(*geometry)
    out.view(-1).index_add_(0, where.reshape(-1), grad.reshape(-1))
    return out


def _overlapping(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Local. Whether a view of ``shape`` and ``stride`` may address an element twice
    (False is certain: each dim's stride passes the span of the smaller ones)."""
    span = 1
    for st, n in sorted((st, n) for st, n in zip(stride, shape) if n > 1):
        if st < span:
            return True
        span = st * n
    return False


def check_replicated(p: torch.Tensor, comm: MPI.Comm) -> None:
    """Collective over ``comm``, the first time it sees ``p``. Raise the same
    MismatchError on every rank if ``p``, which every rank must hold alike,
    differs between ranks.

    A replicated tensor that differs silently gives wrong numbers, and the usual
    cause is quiet: torch seeds every process differently, so a model built on
    each rank without a common seed, and not wrapped in DomainParallel (which
    broadcasts rank 0's parameters), has other weights on every rank. Costs one
    small allreduce per tensor, once (gradients are summed over the ranks, so
    optimizer steps keep replicated parameters equal).
    """
    viewed = base_of(p)
    if viewed is not None:  # a view holds its base's values: check the base, once
        p = viewed[0]
    if comm.Get_size() == 1 or _CHECKED.get(id(p)) is p:
        return
    data = p.detach().reshape(-1)
    data = (data.cpu() if data.device.type != "cpu" else data).contiguous()
    digest = zlib.crc32(data.view(torch.uint8).numpy().tobytes()) & 0x7FFFFFFF if data.numel() \
        else 0
    agree(comm, None, signature=signature_of(tuple(p.shape), str(p.dtype), digest),
          what=(f"the values of a replicated {tuple(p.shape)} {p.dtype} tensor (a parameter, "
                f"mask or field used with DomainTensors; torch seeds every process "
                f"differently: seed every rank alike, or wrap the model in "
                f"dp.DomainParallel, which broadcasts rank 0's parameters)"),
          described=f"checksum {digest}")
    _CHECKED[id(p)] = p


def enter_domain(p: torch.Tensor, out_dec: Decomposition, sliced: Mapping[int, int]) -> torch.Tensor:
    """This rank's share of the replicated tensor ``p`` in an op whose output is laid
    out by ``out_dec``: ``p`` cut along its dims ``sliced`` (``{p_dim: out_dim}``,
    dims of equal global size) to the output's blocks, broadcast along the others.
    Collective the first time it sees ``p`` (``check_replicated``).
    """
    grid = out_dec.grid
    check_replicated(p, grid.comm)
    slices = [slice(None)] * p.ndim
    p_shard: dict[int, int] = {}
    p_sizes: dict[int, tuple[int, ...]] = {}
    for pd, od in sliced.items():
        axis = out_dec.shard[od]
        p_shard[pd], p_sizes[pd] = axis, out_dec.block_sizes(od)
        slices[pd] = out_dec.local_slices()[od]
    if not (p.requires_grad and torch.is_grad_enabled()):
        return p[tuple(slices)] if p_shard else p
    all_axes = set(out_dec.shard.values())
    deferrer = _DEFERRER.get()
    if deferrer is not None:
        comm = grid.sub(all_axes)
        defer = deferrer(p, comm)
        if defer is not None:
            # Deferred: the zero-padded partial gradient of the slice is summed later
            # over every output axis, which assembles the sliced dims as well.
            entered = ag.broadcast(p, comm, defer)
            return entered[tuple(slices)] if p_shard else entered
    broadcast_axes = all_axes - set(p_shard.values())
    if broadcast_axes:
        p = ag.broadcast(p, grid.sub(broadcast_axes))
    if p_shard:
        p = ag.shard(p, layout.derive(out_dec, p.shape, p_shard, p_sizes))
    return p
