"""Rank-agreed cases for the DomainTensor tests: 1-, 2- and 3-D process grids,
with even, uneven and zero-size blocks (``layout`` and ``sizes_for`` are
domainpar.testing's ``layout`` and ``block_sizes``), and global tensors."""
from __future__ import annotations

import torch
from mpi4py import MPI

from domainpar.testing.layouts import block_sizes as sizes_for  # noqa: F401
from domainpar.testing.layouts import layout  # noqa: F401

COMM = MPI.COMM_WORLD
SIZE, RANK = COMM.Get_size(), COMM.Get_rank()
GRID_NDIMS = (1, 2, 3)
KINDS = ("even", "uneven", "zero")
CASES = [(g, k) for g in GRID_NDIMS for k in KINDS]
DTYPES = (torch.float64, torch.float32)


def global_tensor(shape, dtype=torch.float64, seed=0):
    """The same random tensor on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

