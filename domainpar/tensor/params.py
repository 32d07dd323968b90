"""Replicated tensors (parameters, masks, fields) entering an op on DomainTensors.

A replicated tensor used by every rank's block computation gets, on each rank,
only a partial gradient; its true gradient is the sum of the partials over the
grid axes along which the op's output is sharded (DESIGN.md, "Autograd
semantics"). ``enter_domain`` puts that sum into the graph: a Broadcast
(backward: allreduce) over the axes along which the tensor is broadcast, and a
Shard (backward: allgatherv) over the axes along which it is sliced to the
block. Inside ``DomainParallel`` the sum is deferred instead: the deferrer
registered here receives the partial gradient and reduces it later, bucketed.
"""
from __future__ import annotations

import contextvars
from typing import Callable, Mapping

import torch

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from . import layout

# The active deferrer: ``deferrer(tensor, comm)`` returns the callable that
# receives the tensor's partial gradient, or None to reduce in the op's backward.
_DEFERRER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "domainpar_deferrer", default=None)


def set_deferrer(deferrer: Callable | None) -> contextvars.Token:
    return _DEFERRER.set(deferrer)


def reset_deferrer(token: contextvars.Token) -> None:
    _DEFERRER.reset(token)


def enter_domain(p: torch.Tensor, out_dec: Decomposition, sliced: Mapping[int, int]) -> torch.Tensor:
    """This rank's share of the replicated tensor ``p`` in an op whose output is laid
    out by ``out_dec``: ``p`` cut along its dims ``sliced`` (``{p_dim: out_dim}``,
    dims of equal global size) to the output's blocks, broadcast along the others.
    """
    grid = out_dec.grid
    slices = [slice(None)] * p.ndim
    p_shard, p_sizes = {}, {}
    for pd, od in sliced.items():
        axis = out_dec.shard[od]
        p_shard[pd], p_sizes[pd] = axis, out_dec.block_sizes(od)
        slices[pd] = out_dec.local_slices()[od]
    if not (p.requires_grad and torch.is_grad_enabled()):
        return p[tuple(slices)] if p_shard else p
    all_axes = set(out_dec.shard.values())
    deferrer = _DEFERRER.get()
    defer = deferrer(p, grid.sub(all_axes)) if deferrer is not None else None
    if defer is not None:
        # Deferred: the zero-padded partial gradient of the slice is summed later
        # over every output axis, which assembles the sliced dims as well.
        return ag.broadcast(p, grid.sub(all_axes), defer)[tuple(slices)]
    broadcast_axes = all_axes - set(p_shard.values())
    if broadcast_axes:
        p = ag.broadcast(p, grid.sub(broadcast_axes))
    if p_shard:
        p = ag.shard(p, layout.derive(out_dec, p.shape, p_shard, p_sizes))
    return p
