"""Shared pieces of the dp.io tests: the io modes to run (mpio and the forced
serial fallback), fresh file names, and the global-tensor oracle of a block
read with ghosts. The fixtures built on them (``shared_dir``, ``mode``) are in
conftest.py."""
from __future__ import annotations

import os

import numpy as np
import torch
from mpi4py import MPI

from domainpar.io import files

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
MODES = ("mpio", "serial") if files.has_mpi() else ("serial",)


_count = [0]


def fresh(directory: str, stem: str) -> str:
    """A file name not used before in this run (the same on every rank)."""
    _count[0] += 1
    return os.path.join(directory, f"{stem}-{_count[0]}.h5")


def expected_padded(g: torch.Tensor, dec, widths, wraps, fill=0, base=None) -> torch.Tensor:
    """The oracle: this rank's block padded by ghosts, cut from the global tensor
    (wrapped indices on periodic dims, ``fill`` beyond the others)."""
    index, valid = [], []
    for d, (o, n, size) in enumerate(zip(dec.offsets(), dec.local_shape(), dec.global_shape)):
        lo, hi = widths.get(d, (0, 0))
        idx = np.arange(o - lo, o + n + hi)
        ok = np.ones(idx.shape, bool)
        if d in wraps:
            idx = idx % max(size, 1)
        else:
            ok = (idx >= 0) & (idx < size)
            idx = np.clip(idx, 0, max(size - 1, 0))
        if base is not None:
            idx = idx + base[d]
        index.append(torch.as_tensor(idx))
        valid.append(torch.as_tensor(ok))
    if 0 in g.shape:
        return torch.zeros([len(i) for i in index], dtype=g.dtype)
    out = g[torch.meshgrid(*index, indexing="ij")].clone()
    mask = torch.ones(out.shape, dtype=torch.bool)
    for d, ok in enumerate(valid):
        shape = [1] * out.ndim
        shape[d] = -1
        mask &= ok.view(shape)
    out[~mask] = fill
    return out
