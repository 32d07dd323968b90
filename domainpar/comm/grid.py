"""ProcessGrid: the Cartesian communicator and its sub-communicators."""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import cast

from mpi4py import MPI

from . import runtime
from .errors import LayoutError, agree, signature_of


def _normalise_periodic(periodic: bool | Iterable[bool] | None, ndim: int) -> tuple[bool, ...]:
    if isinstance(periodic, bool) or periodic is None:
        return (bool(periodic),) * ndim
    out = tuple(bool(p) for p in periodic)
    if len(out) != ndim:
        raise LayoutError(f"periodic has {len(out)} entries for a {ndim}-D grid")
    return out


class ProcessGrid:
    """Collective. A Cartesian grid of MPI processes (``MPI_Cart_create``).

    Ranks are never reordered, so the grid rank of a process is its rank in
    ``comm``. One process without ``mpiexec`` is a valid grid of size one.

    Parameters
    ----------
    dims : int, sequence of int or None, default None
        The number of processes along each axis; zeros let MPI choose
        (``MPI_Dims_create``), and None makes a 1-D grid of all processes.
    periodic : bool or sequence of bool, default False
        Whether an axis wraps around: one bool for every axis, or one per axis.
    comm : mpi4py.MPI.Comm, optional
        The processes to arrange; ``MPI.COMM_WORLD`` by default.

    Attributes
    ----------
    comm : mpi4py.MPI.Cartcomm
        The Cartesian communicator.
    dims, periodic, coords : tuple
        Processes per axis, which axes wrap, and this process's coordinates.
    rank, size : int
        This process's rank in ``comm`` and the number of processes.

    Raises
    ------
    LayoutError
        On every rank, when ``dims`` do not fit the communicator's size or
        ``periodic`` has the wrong length; MismatchError when ranks pass
        different ones.
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
        # (an intracommunicator: mpi4py's stubs type Split and Dup results as Comm)
        cart = cast(MPI.Intracomm, parent).Create_cart(list(dims), periods=list(periodic),
                                                       reorder=False)
        self._init_from_cart(cart)

    @classmethod
    def from_comm(cls, cart: MPI.Cartcomm) -> ProcessGrid:
        """Collective. Adopt a Cartesian communicator made elsewhere (C, Fortran, mpi4py).

        Parameters
        ----------
        cart : mpi4py.MPI.Comm
            A communicator with a Cartesian topology. A Fortran handle becomes
            one with ``MPI.Comm.f2py(handle)``. It is duplicated, so
            domainpar's messages never mix with the simulation's.

        Returns
        -------
        ProcessGrid
            The grid of ``cart``'s dims, periodicity and ranks.
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
        self._merged: dict[tuple[int, ...], ProcessGrid] = {}
        self._ranks_in: dict[int, tuple[int, ...]] = {}
        # A grid made by ``merged``: its parent, the parent's axes merged into one
        # (row-major), and parent axis -> axis here. The root is the grid the user made.
        self.parent: ProcessGrid | None = None
        self.merged_axes: tuple[int, ...] = ()
        self.axis_from_parent: dict[int, int] = {}
        self.root: ProcessGrid = self

    # -- queries -----------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Local. The number of grid axes."""
        return len(self.dims)

    def coords_of(self, rank: int) -> tuple[int, ...]:
        """Local. The grid coordinates of ``rank``.

        Parameters
        ----------
        rank : int
            A rank of the grid.

        Returns
        -------
        tuple of int
            One coordinate per grid axis.
        """
        if not 0 <= rank < self.size:
            raise LayoutError(f"rank {rank} is not in a grid of {self.size} processes")
        return tuple(self.comm.Get_coords(rank))

    def rank_of(self, coords: Sequence[int]) -> int:
        """Local. The rank at ``coords``.

        Parameters
        ----------
        coords : sequence of int
            One coordinate per grid axis; periodic axes wrap.

        Returns
        -------
        int
            The rank, or ``MPI.PROC_NULL`` for a coordinate off a non-periodic axis.
        """
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
        """Local. The rank at this process's ``coords + offset`` (diagonals too).

        Parameters
        ----------
        offset : sequence of int
            One offset per grid axis.

        Returns
        -------
        int
            The neighbour's rank, or ``MPI.PROC_NULL`` off the grid.
        """
        if len(offset) != self.ndim:
            raise LayoutError(f"offset {tuple(offset)} needs {self.ndim} entries")
        return self.rank_of([c + o for c, o in zip(self.coords, offset)])

    def neighbors(self) -> dict[tuple[int, ...], int]:
        """Local. Every neighbour of this process, diagonals included.

        Returns
        -------
        dict
            ``{offset: rank}`` for the 3**ndim - 1 offsets in {-1, 0, 1}**ndim
            other than zero; off-grid ones are ``MPI.PROC_NULL``.
        """
        return {off: self.neighbor(off)
                for off in itertools.product((-1, 0, 1), repeat=self.ndim) if any(off)}

    def sub(self, axes: Iterable[int]) -> MPI.Cartcomm:
        """Collective on first use for a given ``axes``. A sub-grid's communicator.

        Parameters
        ----------
        axes : iterable of int
            The grid axes the sub-grid keeps.

        Returns
        -------
        mpi4py.MPI.Cartcomm
            The processes that share this process's coordinates on every axis
            not in ``axes`` (``MPI_Cart_sub``), ranked in grid order; cached.
        """
        axes = tuple(sorted({self._axis(a) for a in axes}))
        if axes not in self._subs:
            keep = [a in axes for a in range(self.ndim)]
            self._subs[axes] = self.comm.Sub(keep) if self.ndim else self.comm.Dup()
        return self._subs[axes]

    def axis_comm(self, axis: int) -> MPI.Cartcomm:
        """Collective on first use. The 1-D communicator along ``axis``.

        Parameters
        ----------
        axis : int
            A grid axis.

        Returns
        -------
        mpi4py.MPI.Cartcomm
            ``sub((axis,))``.
        """
        return self.sub((axis,))

    # -- merged grids -------------------------------------------------------------------------
    def merged(self, axes: Sequence[int]) -> ProcessGrid:
        """Collective on first use for a given ``axes``. The grid of the same processes
        in which the axes ``axes`` (two or more, in that order) are one axis: its
        coordinate is the row-major index of the coordinates on ``axes``. The merged
        axis sits where the lowest of ``axes`` was; the other axes keep their order.
        A tensor dim sharded on the merged axis is cut over all of ``axes`` (block
        order: row-major over ``axes``). Cached; ``merged(...).root`` is this grid's
        root, so tensors on either may be repartitioned onto the other."""
        axes = tuple(self._axis(a) for a in axes)
        if len(axes) < 2 or len(set(axes)) != len(axes):
            raise LayoutError(f"merged needs two or more distinct grid axes, got {axes}")
        if axes not in self._merged:
            self._merged[axes] = self._make_merged(axes)
        return self._merged[axes]

    def _make_merged(self, axes: tuple[int, ...]) -> ProcessGrid:
        kept = [a for a in range(self.ndim) if a not in axes]
        pos = sum(1 for a in kept if a < min(axes))
        order = kept[:pos] + [None] + kept[pos:]  # None: the merged axis
        dims = [math.prod(self.dims[a] for a in axes) if a is None else self.dims[a]
                for a in order]
        periodic = [all(self.periodic[a] for a in axes) if a is None else self.periodic[a]
                    for a in order]

        def new_rank(rank: int) -> int:
            c = self.coords_of(rank)
            merged = 0
            for ax in axes:
                merged = merged * self.dims[ax] + c[ax]
            index = 0
            for a, n in zip(order, dims):
                index = index * n + (merged if a is None else c[a])
            return index

        key = new_rank(self.rank)
        same = all(new_rank(r) == r for r in range(self.size))
        # Split of an intracommunicator is one (mpi4py's stub says Comm).
        comm = self.comm if same else cast(MPI.Intracomm, self.comm.Split(0, key))
        cart = comm.Create_cart(dims, periods=periodic, reorder=False)
        if not same:
            comm.Free()
        grid = ProcessGrid.__new__(ProcessGrid)
        grid._init_from_cart(cart)
        grid.parent, grid.merged_axes, grid.root = self, axes, self.root
        grid.axis_from_parent = {a: (pos if a in axes else order.index(a)) for a in range(self.ndim)}
        return grid

    def ranks_in(self, other: ProcessGrid) -> tuple[int, ...]:
        """Local (cached). For each rank of this grid, the rank of the same process in
        ``other``, a grid of the same processes (the same root)."""
        if other is self:
            return tuple(range(self.size))
        if other.root is not self.root:
            raise LayoutError("ranks_in: the grids are not made from one grid (merged)")
        if id(other) not in self._ranks_in:
            mine, theirs = self.comm.Get_group(), other.comm.Get_group()
            self._ranks_in[id(other)] = tuple(
                MPI.Group.Translate_ranks(mine, list(range(self.size)), theirs))
            mine.Free()
            theirs.Free()
        return self._ranks_in[id(other)]

    def axes_text(self, axis: int) -> str:
        """Local. ``grid axis a``, or for a merged axis the root grid's axes it joins."""
        axes = self.root_axes(axis)
        return f"grid axis {axes[0]}" if len(axes) == 1 else f"grid axes {axes}"

    def root_axes(self, axis: int) -> tuple[int, ...]:
        """Local. The root grid's axes that ``axis`` of this grid stands for, in order."""
        axis = self._axis(axis)
        if self.parent is None:
            return (axis,)
        back = {v: a for a, v in self.axis_from_parent.items() if a not in self.merged_axes}
        parent_axes = self.merged_axes if axis not in back else (back[axis],)
        return tuple(r for a in parent_axes for r in self.parent.root_axes(a))

    def _axis(self, axis: int) -> int:
        if not -self.ndim <= axis < self.ndim:
            raise LayoutError(f"grid axis {axis} does not exist in a {self.ndim}-D grid")
        return axis % self.ndim

    def __repr__(self) -> str:
        return (f"ProcessGrid(dims={self.dims}, periodic={self.periodic}, "
                f"rank={self.rank}, coords={self.coords})")
