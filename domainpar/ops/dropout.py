"""Dropout on DomainTensors: F.dropout and F.alpha_dropout (one draw per element),
F.dropout1d/2d/3d and F.feature_alpha_dropout (one draw per sample and channel),
and the nn modules built on them.

Masks are rank-local: each rank draws the mask of its own block from its own
torch generator (``torch.manual_seed``), with torch's kernel on the block. The
global mask is therefore not the one a single process would draw, but has the
same distribution, the same scaling (kept values x / (1 - p); alpha dropout's
affine correction) and the same gradient (the mask, scaled).

Seeding:

- With the same seed on every rank (the usual ``torch.manual_seed(s)`` at
  start-up), blocks of equal shape draw the *same* pattern: rank 1's mask
  repeats rank 0's. Replicas of a block (ranks that differ only along grid axes
  that shard nothing) must draw identical masks, which this gives for free.
- For independent masks, seed by block: ``seed_per_block(s, x)`` seeds each
  rank's generator from ``s`` and the index of its block in ``x``'s layout
  (replicas share a seed). Call it once, before training.
- Blocks of unequal size draw unequal amounts, so after an elementwise dropout
  on uneven blocks the ranks' generators no longer agree: draw values that must
  be replicated (parameter initialisation, say) from an explicit
  ``torch.Generator`` seeded alike on every rank, not from the global one.

Feature dropout (dropout1d/2d/3d, feature_alpha_dropout) drops whole channels
of a sample, so every spatial block of a sample must apply the same decision.
When a spatial dim is sharded, every rank of the spatial sub-communicator draws
the (N_local, C_local) noise (so their generators advance alike) and the first
rank's draw is broadcast to the others (a collective). Batch and channel blocks
draw their own. With no spatial dim sharded it is torch's kernel on the block.

training=False (or p = 0) is the identity; inplace=True writes into the block.
Nothing is refused beyond torch's own argument errors, raised on every rank
from the global shape before any draw.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..autograd._arrays import to_array
from ..comm import collectives
from ..comm.decomposition import Decomposition
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, op_name, register
from ..tensor.domain_tensor import DomainTensor
from .common import bind

# torch's SELU constant, as in ATen's alpha dropout
_ALPHA = 1.7580993408473766

# training's default differs between the functional forms
_TRAINING_DEFAULT = {F.dropout: True, F.alpha_dropout: False, F.feature_alpha_dropout: False,
                     F.dropout1d: True, F.dropout2d: True, F.dropout3d: True}


def seed_per_block(seed: int, x: DomainTensor | Decomposition) -> int:
    """Collective on a layout's first use (a sub-communicator is made). Seed this
    rank's torch generator from ``seed`` and the index of its block in ``x``'s
    layout, so that distinct blocks draw independent dropout masks and replicas
    of a block the same one. Returns the seed used."""
    dec = x._dec if isinstance(x, DomainTensor) else x
    block = dec.grid.sub(dec.shard.values()).Get_rank()
    mixed = (int(seed) * 0x9E3779B97F4A7C15 + block + 1) % (2 ** 63)
    torch.manual_seed(mixed)
    return mixed


def _args(func, args, kwargs):
    a = bind(func, args, kwargs, ("input", "p", "training", "inplace"),
             {"p": 0.5, "training": _TRAINING_DEFAULT[func], "inplace": False})
    x = a["input"]
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: the input must be a DomainTensor")
    # torch's own argument errors (p out of range, wrong number of dims), from the
    # global shape on every rank alike; no generator is touched on the meta device.
    func(torch.empty(x.shape, dtype=x.dtype, device="meta"), a["p"], a["training"], False)
    return x, float(a["p"]), bool(a["training"]), bool(a["inplace"])


def _result(x: DomainTensor, out: torch.Tensor, inplace: bool):
    return x if inplace else DomainTensor(out, x._dec)


@register(F.dropout, F.alpha_dropout)
def dropout(func, args, kwargs):
    """Local. Rank-local masks from each rank's torch generator (module docstring:
    seeding); any p, training, inplace."""
    x, p, training, inplace = _args(func, args, kwargs)
    return _result(x, func(x._local, p, training, inplace), inplace)


def _channel_dim(func, ndim: int) -> int:
    """Where the channel dim is: dropout1d/3d take an unbatched input (C, spatial...)
    too; dropout2d and feature_alpha_dropout always read (N, C, ...)."""
    unbatched = (func is F.dropout1d and ndim == 2) or (func is F.dropout3d and ndim == 4)
    return 0 if unbatched else 1


@register(F.dropout1d, F.dropout2d, F.dropout3d, F.feature_alpha_dropout)
def feature_dropout(func, args, kwargs):
    """Collective over the axes of the sharded spatial dims (a broadcast of each
    sample's channel mask), local otherwise. Whole channels dropped on every
    block alike; any p, training, inplace; batched and unbatched inputs."""
    x, p, training, inplace = _args(func, args, kwargs)
    dec, local = x._dec, x._local
    ch = _channel_dim(func, x.ndim)
    spatial = list(range(ch + 1, x.ndim))
    comm = layout.comm_of(dec, spatial)
    if comm.Get_size() == 1 or not training or p == 0 or math.prod(x.shape) == 0:
        return _result(x, func(local, p, training, inplace), inplace)
    if p == 1:  # torch: zeros, no draw
        out = local.mul_(0) if inplace else local * 0
        return _result(x, out, inplace)

    # Torch's feature noise, one value per (sample, channel), drawn by every rank of
    # the spatial sub-communicator (same shape on each) and taken from its first.
    noise = torch.empty(tuple(local.shape[:ch + 1]) + (1,) * len(spatial), dtype=local.dtype,
                        device=local.device).bernoulli_(1 - p)
    collectives.bcast(to_array(noise), comm, root=0, check=False)
    if func is F.feature_alpha_dropout:
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
        shift = noise.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
        noise.mul_(a)
        out = local.mul_(noise).add_(shift) if inplace else local * noise + shift
    else:
        noise.div_(1 - p)
        out = local.mul_(noise) if inplace else local * noise
    return _result(x, out, inplace)
