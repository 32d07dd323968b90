"""What every point-set function needs: the point dim's grid axis, its
communicator and block offsets, and the layout of a result sharded like it."""
from __future__ import annotations

import torch

from ..comm.decomposition import Decomposition
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError
from ..tensor.domain_tensor import DomainTensor


def point_axis(dec: Decomposition, dim: int, what: str) -> int:
    """Local. The grid axis cutting ``dim``, the only sharded dim of ``dec``;
    UnsupportedOpError otherwise (metadata: every rank refuses alike)."""
    other = [d for d in dec.shard if d != dim]
    if dim not in dec.shard or other:
        raise UnsupportedOpError(
            f"{what}: needs a DomainTensor sharded on dim {dim} (the point dim) and no "
            f"other dim; got {layout.sharded_dims_text(dec)}")
    return dec.shard[dim]


def point_comm(dec: Decomposition, dim: int):
    """The communicator of the blocks along ``dim``'s axis (replicas apart)."""
    return dec.grid.axis_comm(dec.shard[dim])


def offsets(dec: Decomposition, dim: int) -> torch.Tensor:
    """Local. Block starts along ``dim`` plus the global size, as int64."""
    return torch.as_tensor(dec.block_offsets(dim), dtype=torch.int64)


def global_index(dec: Decomposition, dim: int, device=None) -> torch.Tensor:
    """Local. The global indices of this rank's rows along ``dim``."""
    start = dec.offsets()[dim]
    return torch.arange(start, start + dec.local_shape()[dim], device=device)


def like_rows(dec: Decomposition, dim: int, shape, new_dim: int = 0) -> Decomposition:
    """Local. A layout of global ``shape`` whose dim ``new_dim`` is cut like
    ``dec``'s ``dim`` (same axis, same block sizes) and nothing else."""
    return layout.derive(dec, shape, {new_dim: dec.shard[dim]}, {new_dim: dec.block_sizes(dim)})


def points_arg(x, what: str, ndim: int = 2) -> DomainTensor:
    """``x`` checked to be a point set: an (N, D) DomainTensor sharded on dim 0 only."""
    if not isinstance(x, DomainTensor) or x.ndim != ndim:
        raise UnsupportedOpError(f"{what}: needs an (N, D) DomainTensor of points sharded on "
                                 f"dim 0 (dp.scatter or DomainTensor.from_local), got "
                                 f"{type(x).__name__} of shape {tuple(getattr(x, 'shape', ()))}")
    point_axis(x.decomposition, 0, what)
    return x
