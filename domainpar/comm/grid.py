"""ProcessGrid: the Cartesian communicator and its sub-communicators."""
from __future__ import annotations

import itertools
import math
from typing import Iterable, Sequence

from mpi4py import MPI

from . import runtime
from .errors import LayoutError, agree, signature_of


def _normalise_periodic(periodic, ndim: int) -> tuple[bool, ...]:
    if isinstance(periodic, bool) or periodic is None:
        return (bool(periodic),) * ndim
    periodic = tuple(bool(p) for p in periodic)
    if len(periodic) != ndim:
        raise LayoutError(f"periodic has {len(periodic)} entries for a {ndim}-D grid")
    return periodic


class ProcessGrid:
    """Collective. A Cartesian grid of MPI processes (``MPI_Cart_create``).

    ``dims`` gives the number of processes along each axis; ``None`` or zeros
    let MPI choose (``MPI_Dims_create``); ``dims=None`` makes a 1-D grid of all
    processes. ``periodic`` (one bool or one per axis) makes an axis wrap.
    ``comm`` defaults to ``MPI.COMM_WORLD``. Ranks are never reordered, so the
    grid rank of a process is its rank in ``comm``.

    One process without ``mpiexec`` is a valid grid of size one.
    """

    def __init__(self, dims: Sequence[int] | int | None = None,
                 periodic: bool | Sequence[bool] = False,
                 comm: MPI.Comm | None = None):
        parent = MPI.COMM_WORLD if comm is None else comm
        size = parent.Get_size()
        if dims is None:
            dims = (0,)
        elif isinstance(dims, int):
            dims = (dims,)
        problem = None
        try:
            dims = tuple(int(d) for d in dims)
            periodic = _normalise_periodic(periodic, len(dims))
            if any(d < 0 for d in dims):
                raise LayoutError(f"grid dims {dims} must not be negative")
            fixed = math.prod(d for d in dims if d > 0)
            if 0 in dims:
                if size % fixed:
                    raise LayoutError(
                        f"grid dims {dims}: the fixed dims hold {fixed} processes, "
                        f"which does not divide the communicator size {size}")
                dims = tuple(MPI.Compute_dims(size, list(dims)))
            elif fixed != size:
                raise LayoutError(
                    f"grid dims {dims} hold {fixed} processes but the communicator "
                    f"has {size}")
        except (LayoutError, TypeError, ValueError) as exc:
            problem, periodic = str(exc), ()
        agree(parent, problem, signature=signature_of(dims, periodic),
              what="ProcessGrid dims and periodic", described=f"dims={dims} periodic={periodic}")
        cart = parent.Create_cart(list(dims), periods=list(periodic), reorder=False)
        self._init_from_cart(cart)

    @classmethod
    def from_comm(cls, cart: MPI.Cartcomm) -> "ProcessGrid":
        """Collective. Adopt a Cartesian communicator made elsewhere (C, Fortran, mpi4py).

        A Fortran handle becomes a communicator with ``MPI.Comm.f2py(handle)``.
        The communicator is duplicated, so domainpar's messages never mix with the
        simulation's.
        """
        if not isinstance(cart, MPI.Cartcomm):
            topo = cart.Get_topology() if cart != MPI.COMM_NULL else None
            if topo != MPI.CART:
                raise LayoutError("ProcessGrid.from_comm needs a Cartesian communicator "
                                  "(MPI_Cart_create); got one without a Cartesian topology")
            cart = MPI.Cartcomm.f2py(cart.py2f())
        self = cls.__new__(cls)
        self._init_from_cart(cart.Dup())
        return self

    def _init_from_cart(self, cart: MPI.Cartcomm) -> None:
        runtime.install_abort_hook_under_mpi()  # MPI may have started after our import
        self.comm: MPI.Cartcomm = cart
        self.dims: tuple[int, ...] = tuple(cart.dims)
        self.periodic: tuple[bool, ...] = tuple(bool(p) for p in cart.periods)
        self.rank: int = cart.Get_rank()
        self.size: int = cart.Get_size()
        self.coords: tuple[int, ...] = tuple(cart.Get_coords(self.rank))
        self._subs: dict[tuple[int, ...], MPI.Cartcomm] = {}

    # -- queries -----------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.dims)

    def coords_of(self, rank: int) -> tuple[int, ...]:
        """Local. The grid coordinates of ``rank``."""
        if not 0 <= rank < self.size:
            raise LayoutError(f"rank {rank} is not in a grid of {self.size} processes")
        return tuple(self.comm.Get_coords(rank))

    def rank_of(self, coords: Sequence[int]) -> int:
        """Local. The rank at ``coords``; periodic axes wrap, and a coordinate off a
        non-periodic axis gives ``MPI.PROC_NULL``."""
        if len(coords) != self.ndim:
            raise LayoutError(f"coordinates {tuple(coords)} need {self.ndim} entries")
        wrapped = []
        for axis, (c, n) in enumerate(zip(coords, self.dims)):
            if self.periodic[axis]:
                c %= n
            elif not 0 <= c < n:
                return MPI.PROC_NULL
            wrapped.append(c)
        return self.comm.Get_cart_rank(wrapped)

    def neighbor(self, offset: Sequence[int]) -> int:
        """Local. The rank at ``coords + offset`` (diagonals too), or ``MPI.PROC_NULL``."""
        if len(offset) != self.ndim:
            raise LayoutError(f"offset {tuple(offset)} needs {self.ndim} entries")
        return self.rank_of([c + o for c, o in zip(self.coords, offset)])

    def neighbors(self) -> dict[tuple[int, ...], int]:
        """Local. Every neighbour: ``{offset: rank}`` for the 3**ndim - 1 offsets in
        {-1, 0, 1}**ndim other than zero; off-grid ones are ``MPI.PROC_NULL``."""
        return {off: self.neighbor(off)
                for off in itertools.product((-1, 0, 1), repeat=self.ndim) if any(off)}

    def sub(self, axes: Iterable[int]) -> MPI.Cartcomm:
        """Collective on first use for a given ``axes``. The communicator of the
        processes that share this process's coordinates on every axis not in
        ``axes`` (``MPI_Cart_sub``); ranks in it follow the grid order."""
        axes = tuple(sorted({self._axis(a) for a in axes}))
        if axes not in self._subs:
            keep = [a in axes for a in range(self.ndim)]
            self._subs[axes] = self.comm.Sub(keep) if self.ndim else self.comm.Dup()
        return self._subs[axes]

    def axis_comm(self, axis: int) -> MPI.Cartcomm:
        """Collective on first use. The 1-D communicator along ``axis``."""
        return self.sub((axis,))

    def _axis(self, axis: int) -> int:
        if not -self.ndim <= axis < self.ndim:
            raise LayoutError(f"grid axis {axis} does not exist in a {self.ndim}-D grid")
        return axis % self.ndim

    def __repr__(self) -> str:
        return (f"ProcessGrid(dims={self.dims}, periodic={self.periodic}, "
                f"rank={self.rank}, coords={self.coords})")
