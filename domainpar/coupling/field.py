"""Field: a simulation's local array seen as a DomainTensor, without copying.

A simulation describes its array in its own terms: address, dtype, storage
order, the owned (interior) extents in its index order, ghost widths per side,
which grid axis cuts each dim (one dim per grid axis; at most one further dim
holds components), and optionally where its block starts in the global field.

The model sees ``(1, C, s_0, ..., s_{g-1})``: a batch of one, the components as
channels (one channel without a component dim) and the spatial dims ordered by
grid axis, so a C and a Fortran simulation with the same decomposition hand
the model the same global tensor whatever their index order. That tensor is a
torch view (permute + slicing) of the simulation's memory: ghosts are cut away
by slicing, Fortran order is a transpose; nothing is copied. Writing a model
output into a field copies into the same view, so the ghosts stay untouched.

``halo_fill`` runs domainpar's HaloExchange on the whole padded array in
storage order (C-ordered, so the exchange sees contiguous faces where memory
has them); the ghosts then hold what the simulation's own exchange would give.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .. import ops  # noqa: F401  (registers the op rules DomainTensors run on)
from ..comm.decomposition import Decomposition
from ..comm.grid import ProcessGrid
from ..comm.halo import HaloExchange
from . import errors, memory
from .errors import ARGUMENT, SHAPE, CouplingError, Stage


class Field:
    """Collective to create (``Field.create``). One described array of the simulation."""

    # Set by ``create`` (and the steps it runs), not by __init__.
    grid: ProcessGrid
    dtype: np.dtype[Any]
    _halo: HaloExchange | None

    @classmethod
    def create(cls, grid: ProcessGrid, address: int, dtype: int, order: int,
               shape, ghost_lo=None, ghost_hi=None, axes=None, offsets=None,
               location: int = memory.HOST, local_problem: str | None = None) -> Field:
        """Collective. Check the description on every rank, then wrap the memory.

        Raises CouplingError on every rank alike: ARGUMENT for a null pointer,
        unknown codes or descriptions that differ between ranks, SHAPE for
        extents that do not fit (negative, blocks inconsistent across ranks,
        ``offsets`` other than where the grid puts this block).
        """
        stage = Stage(grid.comm)
        self = cls.__new__(cls)
        self.grid = grid
        stage.run(ARGUMENT, self._describe, address, dtype, order, shape, ghost_lo, ghost_hi,
                  axes, location, local_problem)
        stage.agree()
        # What must be equal on every rank: a C rank and a Fortran rank, or two
        # ranks with different ghost widths, cannot describe one field.
        same = (self.dtype.str, self.order, self.location, len(self.shape), self.lo, self.hi,
                self.axes)
        errors.agree_equal(grid.comm, same,
                           "field descriptions (dtype, order, location, rank, ghosts, axes)")
        stage.run(SHAPE, self._wrap, address)
        stage.agree()
        stage.run(SHAPE, self._check_offsets, offsets)
        stage.agree()
        self._halo = None
        return self

    # -- creation steps (local unless said otherwise) ------------------------------------
    def _describe(self, address, dtype, order, shape, ghost_lo, ghost_hi, axes, location,
                  local_problem):
        if local_problem:
            raise CouplingError(ARGUMENT, local_problem)
        if dtype not in memory.DTYPES:
            raise CouplingError(ARGUMENT, f"dtype code {dtype}: use DP_FLOAT32 (1) or "
                                          f"DP_FLOAT64 (2)")
        if order not in (memory.ORDER_C, memory.ORDER_F):
            raise CouplingError(ARGUMENT, f"order code {order}: use DP_ORDER_C (0) or "
                                          f"DP_ORDER_F (1)")
        if location not in (memory.HOST, memory.DEVICE):
            raise CouplingError(ARGUMENT, f"location code {location}: use DP_HOST (0) or "
                                          f"DP_DEVICE (1)")
        self.dtype, self.order, self.location = memory.DTYPES[dtype], order, location
        self.shape = tuple(int(n) for n in shape)
        ndim, gdim = len(self.shape), self.grid.ndim
        self.lo = tuple(int(w) for w in ghost_lo) if ghost_lo is not None else (0,) * ndim
        self.hi = tuple(int(w) for w in ghost_hi) if ghost_hi is not None else (0,) * ndim
        self.axes = (tuple(int(a) for a in axes) if axes is not None
                     else tuple(range(gdim)) + (-1,) * (ndim - gdim))
        if not gdim <= ndim <= gdim + 1:
            raise CouplingError(SHAPE, f"a field on a {gdim}-D grid has {gdim} dims (one per "
                                       f"grid axis) or {gdim + 1} (plus components); got "
                                       f"{ndim}: shape {self.shape}")
        for what, v in (("ghost_lo", self.lo), ("ghost_hi", self.hi), ("axes", self.axes)):
            if len(v) != ndim:
                raise CouplingError(ARGUMENT, f"{what} {v} has {len(v)} entries for a "
                                              f"{ndim}-D field")
        if any(n < 0 for n in self.shape):
            raise CouplingError(SHAPE, f"owned extents {self.shape} have a negative entry "
                                       f"(ghost widths lo={self.lo} hi={self.hi} larger than "
                                       f"the array?)")
        if any(w < 0 for w in self.lo + self.hi):
            raise CouplingError(SHAPE, f"ghost widths lo={self.lo} hi={self.hi} must not be "
                                       f"negative")
        if sorted(a for a in self.axes if a >= 0) != list(range(gdim)) or \
                any(a < -1 for a in self.axes):
            raise CouplingError(ARGUMENT, f"axes {self.axes}: each of the grid's {gdim} axes "
                                          f"must cut exactly one dim; -1 marks the component dim")
        self.extents = tuple(lo + n + h for lo, n, h in zip(self.lo, self.shape, self.hi))
        if not address and math.prod(self.extents) > 0:
            raise CouplingError(ARGUMENT, f"null pointer for the data of a field of "
                                          f"{math.prod(self.extents)} elements (extents "
                                          f"{self.extents} with ghosts)")

    def _check_extents(self):
        """Collective (one allgather). Blocks that no grid layout allows, named in the
        simulation's terms (domainpar's own check would name the model tensor's dims)."""
        stories = self.grid.comm.allgather((self.grid.coords, self.shape))
        for d, a in enumerate(self.axes):
            by_coord: dict[int, dict[int, int]] = {}
            for r, (coords, shape) in enumerate(stories):
                by_coord.setdefault(coords[a] if a >= 0 else 0, {})[r] = shape[d]
            for c, extents in by_coord.items():
                if len(set(extents.values())) > 1:
                    where = (f"at coordinate {c} of grid axis {a}" if a >= 0
                             else "(the component dim)")
                    listed = ", ".join(f"rank {r}: {n}" for r, n in extents.items())
                    raise CouplingError(SHAPE, f"field dim {d} has different owned extents on "
                                               f"ranks {where}, where they must be equal "
                                               f"({listed})")

    def _wrap(self, address):
        """Collective (the block sizes are learned by one allgather)."""
        from ..tensor import DomainTensor  # torch layers load on first use
        self._check_extents()
        self.storage = memory.storage_view(address, self.dtype, self.extents, self.order,
                                           self.location)
        whole = (torch.from_numpy(self.storage) if isinstance(self.storage, np.ndarray)
                 else torch.from_dlpack(self.storage))
        logical = whole.permute(*reversed(range(whole.ndim))) if self.order else whole
        owned = logical[tuple(slice(lo, lo + n) for lo, n in zip(self.lo, self.shape))]
        # Channels first, then the spatial dims in grid-axis order: a view.
        spatial = sorted((a, d) for d, a in enumerate(self.axes) if a >= 0)
        components = [d for d, a in enumerate(self.axes) if a < 0]
        block = owned.permute(*components, *(d for _, d in spatial))
        block = block.unsqueeze(0) if components else block.unsqueeze(0).unsqueeze(0)
        shard = {2 + a: a for a, _ in spatial}
        self.domain = DomainTensor.from_local(block, self.grid, shard)

    def _check_offsets(self, offsets):
        if offsets is None:
            return
        dec = self.domain.decomposition
        expected = tuple(dec.offsets()[2 + a] if a >= 0 else 0 for a in self.axes)
        given = tuple(int(o) for o in offsets)
        if given != expected:
            raise CouplingError(SHAPE, f"global offsets {given} given, but the grid (coords "
                                       f"{self.grid.coords}, block sizes of every rank) puts "
                                       f"this block at {expected}: the simulation's "
                                       f"decomposition and the grid disagree")

    # -- use ---------------------------------------------------------------------------
    @property
    def tensor(self):
        """Local. The field as a DomainTensor over the simulation's memory (no copy)."""
        return self.domain

    def write(self, y) -> None:
        """Collective when ``y`` needs relaying out. Copy the DomainTensor ``y`` into
        the field's owned cells (ghosts untouched). SHAPE if the global shapes differ."""
        from ..tensor import DomainTensor
        if not isinstance(y, DomainTensor):
            raise CouplingError(errors.MODEL, f"the model returned a {type(y).__name__}, "
                                              f"not a DomainTensor")
        mine = self.domain.decomposition
        if tuple(y.shape) != mine.global_shape:
            raise CouplingError(SHAPE, f"the model's output has global shape {tuple(y.shape)}, "
                                       f"the output field {mine.global_shape} "
                                       f"(batch, components, spatial dims by grid axis)")
        ydec = y.decomposition
        if ydec.grid is not mine.grid or ydec.shard != mine.shard or any(
                ydec.block_sizes(d) != mine.block_sizes(d) for d in mine.shard):
            # Another layout of the same global tensor: relaying it out is a copy
            # the write cannot avoid anyway.
            y = y.redistribute(mine.shard, {d: mine.block_sizes(d) for d in mine.shard})
        with torch.no_grad():
            self.domain.to_local().copy_(y.to_local())

    def halo_fill(self) -> None:
        """Neighbour-wise collective. Fill the ghost cells from their owners
        (periodic grid axes wrap; ghosts outside a non-periodic domain are kept)."""
        if self._halo is None:
            self._halo = HaloExchange(self._storage_decomposition(), self._storage_widths(),
                                      check=False)
        self._halo.fill(self.storage, check=False)

    def _storage_dim(self, d: int) -> int:
        return len(self.shape) - 1 - d if self.order == memory.ORDER_F else d

    def _storage_decomposition(self) -> Decomposition:
        dec = self.domain.decomposition
        ndim = len(self.shape)
        gshape, shard, sizes = [0] * ndim, {}, {}
        for d, a in enumerate(self.axes):
            s = self._storage_dim(d)
            if a < 0:
                gshape[s] = self.shape[d]
            else:
                gshape[s], shard[s], sizes[s] = dec.global_shape[2 + a], a, dec.block_sizes(2 + a)
        return Decomposition(gshape, self.grid, shard, sizes, check=False)

    def _storage_widths(self) -> dict[int, tuple[int, int]]:
        return {self._storage_dim(d): (self.lo[d], self.hi[d]) for d in range(len(self.shape))}

