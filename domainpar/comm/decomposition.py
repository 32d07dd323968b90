"""Decomposition: a global shape cut into per-rank blocks over a ProcessGrid.

Pure index math: every rank knows every rank's block without a message. The
constructor's only communication is one small allreduce that checks that every
rank passed the same arguments (skipped with ``check=False`` by code that derives
a decomposition the same way on every rank).
"""
from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Mapping, Sequence

from .errors import LayoutError, agree, signature_of
from .grid import ProcessGrid


def balanced_sizes(n: int, parts: int) -> tuple[int, ...]:
    """``n`` cut into ``parts`` blocks; the first ``n % parts`` get one more."""
    q, r = divmod(n, parts)
    return tuple(q + (c < r) for c in range(parts))


def aligned_sizes(n: int, parts: int, unit: int) -> tuple[int, ...]:
    """``n`` cut into ``parts`` blocks balanced in whole units of ``unit`` (the
    first get one unit more); the ``n % unit`` rows left over go to the last block."""
    sizes = [unit * b for b in balanced_sizes(n // unit, parts)]
    sizes[-1] += n % unit
    return tuple(sizes)


class Decomposition:
    """Collective (a consistency check; see ``check``). How a global array shape is
    cut over a ProcessGrid.

    Parameters
    ----------
    global_shape : sequence of int
        The shape of the whole array.
    grid : ProcessGrid
        The processes it is cut over.
    shard : mapping, optional
        ``{tensor_dim: grid_axis}``: the dims cut and the grid axes that cut
        them (see Notes). No dim sharded by default.
    sizes : mapping, optional
        ``{dim: [n_0, n_1, ...]}``: a sharded dim's block sizes, one per
        coordinate along its grid axis; uneven and zero sizes are allowed.
    check : bool, default True
        Agree on the arguments across the grid (a collective); False for
        callers that derive the same arguments on every rank by construction.
    align : mapping, optional
        ``{dim: k}``: balance the dim's blocks in whole units of ``k`` rows.

    Raises
    ------
    LayoutError
        On every rank, when a shard map, sizes or shape do not fit the grid;
        MismatchError when ranks pass different ones.

    Notes
    -----
    ``shard={tensor_dim: grid_axis}`` cuts a tensor dim along a grid axis; grid
    axes that no dim names replicate the data. Blocks are balanced by default
    (the first ``n % p`` coordinates get one more) or given per dim with
    ``sizes={dim: [n_0, n_1, ...]}``, one per coordinate along the axis; they
    may be uneven and may be zero. ``align={dim: k}`` balances a dim's default
    blocks in whole units of ``k`` rows instead (``aligned_sizes``: 32 rows, k=4,
    3 processes: 12/12/8), so that a later ``view`` splitting the dim into
    (n // k, k), a window partition, needs no repartition. Negative dims count
    from the end.

    ``shard={dim: (a, b)}`` cuts one dim over several grid axes: its blocks follow
    the row-major order of the coordinates on ``(a, b)`` (``sizes`` then gives
    one per process of those axes together). Axes of one process shard nothing.
    The decomposition then lives on ``grid.merged((a, b))`` (``self.grid``), where
    the dim is cut along one axis, so every rule written for one axis applies;
    ``self.grid.root`` is the grid passed in.
    """

    def __init__(self, global_shape: Sequence[int], grid: ProcessGrid,
                 shard: Mapping[int, int] | None = None,
                 sizes: Mapping[int, Sequence[int]] | None = None, *, check: bool = True,
                 align: Mapping[int, int] | None = None):
        self.grid = grid
        # (dim, grid axes) of a dim cut over several grid axes, or ()
        self._multi: tuple[int, tuple[int, ...]] | tuple[()] = ()
        problem = None
        try:
            self.global_shape = tuple(int(n) for n in global_shape)
            if any(n < 0 for n in self.global_shape):
                raise LayoutError(f"global shape {self.global_shape} has a negative size")
            self.shard = self._normalise_shard(shard or {})
            self._sizes = self._normalise_sizes(sizes or {}, align or {})
        except (LayoutError, TypeError, ValueError) as exc:
            problem = (f"Decomposition({global_shape!r}, shard={shard}, sizes={sizes}"
                       + (f", align={align}" if align else "") + f"): {exc}")
            self.global_shape, self.shard, self._sizes, self._multi = (), {}, {}, ()
        if check:
            agree(grid.comm, problem,
                  signature=signature_of(self.global_shape, self.shard, self._sizes, self._multi),
                  what="Decomposition global shapes, shard maps or sizes",
                  described=f"global_shape={self.global_shape} shard={self.shard} "
                            f"multi-axis={self._multi} sizes={self._sizes}")
        elif problem:
            raise LayoutError(problem)
        if self._multi:  # collective on first use: after the agreement, on every rank
            merged = grid.merged(self._multi[1])
            self.shard = {d: merged.axis_from_parent[a] for d, a in self.shard.items()}
            self.grid = merged
        self._offsets = {d: tuple(itertools.accumulate(s, initial=0)) for d, s in self._sizes.items()}
        # This rank's block shape and slices and the hash, computed on first use
        # (a Decomposition does not change once made).
        self._here: tuple[tuple[int, ...], tuple[slice, ...]] | None = None
        self._hash: int | None = None

    def _normalise_shard(self, shard: Mapping[int, int | Sequence[int]]) -> dict[int, int]:
        """``{dim: grid axis}``; a dim given a tuple of axes is recorded in
        ``self._multi`` and mapped to the first of them until the grid is merged.
        Axes of one process shard nothing, so ``(0, 1)`` on a 3x1 grid is ``0``."""
        ndim, gdim = len(self.global_shape), self.grid.ndim
        out: dict[int, int] = {}
        used: set[int] = set()
        for dim, axes in shard.items():
            dim = int(dim)
            if not -ndim <= dim < ndim:
                raise LayoutError(f"shard names tensor dim {dim}, but the tensor has {ndim} dims")
            dim %= ndim
            if dim in out:
                raise LayoutError(f"shard names tensor dim {dim} twice")
            axes = self._grid_axes(dim, axes, gdim)
            if used & set(axes):
                raise LayoutError(f"shard maps two tensor dims to grid axis "
                                  f"{sorted(used & set(axes))[0]}")
            used |= set(axes)
            wide = tuple(a for a in axes if self.grid.dims[a] > 1)
            if len(wide) > 1:
                if self._multi:
                    raise LayoutError(f"dims {self._multi[0]} and {dim} are both cut over "
                                      f"several grid axes; only one dim may be")
                self._multi = (dim, wide)
            out[dim] = (wide or axes)[0]
        return dict(sorted(out.items()))

    @staticmethod
    def _grid_axes(dim: int, axes: int | Sequence[int], gdim: int) -> tuple[int, ...]:
        """``axes`` (one grid axis or a sequence of them) as non-negative axes."""
        given = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
        if not given:
            raise LayoutError(f"shard maps dim {dim} to no grid axis")
        out = []
        for axis in given:
            if isinstance(axis, bool) or int(axis) != axis:
                raise LayoutError(f"shard maps dim {dim} to {axis!r}, not a grid axis")
            if not -gdim <= int(axis) < gdim:
                raise LayoutError(f"shard maps dim {dim} to grid axis {axis}, "
                                  f"but the grid has {gdim} axes")
            out.append(int(axis) % gdim)
        if len(set(out)) != len(out):
            raise LayoutError(f"shard maps dim {dim} to grid axes {tuple(out)}, one twice")
        return tuple(out)

    def _sharded_dim(self, dim: int, what: str) -> int:
        ndim = len(self.global_shape)
        dim = int(dim)
        if not -ndim <= dim < ndim or dim % ndim not in self.shard:
            raise LayoutError(f"{what} given for dim {dim}, which is not sharded")
        return dim % ndim

    def _normalise_sizes(self, sizes: Mapping[int, Sequence[int]],
                         align: Mapping[int, int]) -> dict[int, tuple[int, ...]]:
        given = {self._sharded_dim(d, "sizes"): tuple(int(n) for n in s)
                 for d, s in sizes.items()}
        units = {}
        for d, k in align.items():
            dim = self._sharded_dim(d, "align")
            if dim in given:
                raise LayoutError(f"dim {dim} has both sizes and align; give one")
            if isinstance(k, bool) or int(k) != k or k < 1:
                raise LayoutError(f"align for dim {dim} must be a positive integer, got {k!r}")
            units[dim] = int(k)
        out = {}
        for dim, axis in self.shard.items():
            parts, n = self._parts(dim, axis), self.global_shape[dim]
            s = given[dim] if dim in given else aligned_sizes(n, parts, units.get(dim, 1))
            if len(s) != parts:
                axes = self._multi[1] if self._multi and self._multi[0] == dim else None
                where = f"grid axes {axes} have" if axes else f"grid axis {axis} has"
                raise LayoutError(f"sizes for dim {dim} have {len(s)} entries, but {where} "
                                  f"{parts} processes")
            if any(b < 0 for b in s) or sum(s) != n:
                raise LayoutError(f"sizes {list(s)} for dim {dim} must be >= 0 and sum "
                                  f"to its global size {n}")
            out[dim] = s
        return out

    def _parts(self, dim: int, axis: int) -> int:
        """How many blocks ``dim`` is cut into (the product over a multi-axis dim's axes)."""
        axes = self._multi[1] if self._multi and self._multi[0] == dim else (axis,)
        return math.prod(self.grid.dims[a] for a in axes)

    # -- queries (local) -----------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Local. The number of tensor dims."""
        return len(self.global_shape)

    def _dim(self, dim: int) -> int:
        """``dim`` as a non-negative tensor dim; an error when there is no such dim."""
        if not -self.ndim <= dim < self.ndim:
            raise LayoutError(f"tensor dim {dim} does not exist in a {self.ndim}-D decomposition")
        return dim % self.ndim

    def axis_of(self, dim: int) -> int | None:
        """Local. The grid axis that cuts ``dim``.

        Parameters
        ----------
        dim : int
            A tensor dim (negative counts from the end).

        Returns
        -------
        int or None
            The grid axis, or None when ``dim`` is not sharded.
        """
        return self.shard.get(self._dim(dim))

    @property
    def replicated_axes(self) -> tuple[int, ...]:
        """Grid axes that no tensor dim is cut along."""
        return tuple(a for a in range(self.grid.ndim) if a not in self.shard.values())

    def block_sizes(self, dim: int) -> tuple[int, ...]:
        """Local. Block sizes along ``dim``.

        Parameters
        ----------
        dim : int
            A tensor dim (negative counts from the end).

        Returns
        -------
        tuple of int
            One size per coordinate of its grid axis (one entry, the global
            size, for a dim that is not sharded).
        """
        dim = self._dim(dim)
        return self._sizes.get(dim, (self.global_shape[dim],))

    def block_offsets(self, dim: int) -> tuple[int, ...]:
        """Local. Block start offsets along ``dim``.

        Parameters
        ----------
        dim : int
            A tensor dim (negative counts from the end).

        Returns
        -------
        tuple of int
            One offset per block, plus the global size as a last entry.
        """
        dim = self._dim(dim)
        return self._offsets.get(dim, (0, self.global_shape[dim]))

    def _coords(self, rank: int | None) -> tuple[int, ...]:
        return self.grid.coords if rank is None else self.grid.coords_of(rank)

    def local_shape(self, rank: int | None = None) -> tuple[int, ...]:
        """Local. The block shape of ``rank``.

        Parameters
        ----------
        rank : int, optional
            A rank of the grid; this rank by default.

        Returns
        -------
        tuple of int
            The block's shape.
        """
        if rank is None:
            return self._mine()[0]
        return self._shape_of(self._coords(rank))

    def _shape_of(self, coords: Sequence[int]) -> tuple[int, ...]:
        return tuple(self._sizes[d][coords[self.shard[d]]] if d in self.shard else n
                     for d, n in enumerate(self.global_shape))

    def _mine(self) -> tuple[tuple[int, ...], tuple[slice, ...]]:
        """This rank's block shape and slices, computed once."""
        if self._here is None:
            shape, start = self._shape_of(self.grid.coords), self.offsets()
            self._here = shape, tuple(slice(o, o + n) for o, n in zip(start, shape))
        return self._here

    def offsets(self, rank: int | None = None) -> tuple[int, ...]:
        """Local. Where ``rank``'s block starts.

        Parameters
        ----------
        rank : int, optional
            A rank of the grid; this rank by default.

        Returns
        -------
        tuple of int
            The global index of the block's first element.
        """
        coords = self._coords(rank)
        return tuple(self._offsets[d][coords[self.shard[d]]] if d in self.shard else 0
                     for d in range(self.ndim))

    def local_slices(self, rank: int | None = None) -> tuple[slice, ...]:
        """Local. The part of the global array that ``rank``'s block holds.

        Parameters
        ----------
        rank : int, optional
            A rank of the grid; this rank by default.

        Returns
        -------
        tuple of slice
            One slice per dim.
        """
        if rank is None:
            return self._mine()[1]
        return tuple(slice(o, o + n) for o, n in zip(self.offsets(rank), self.local_shape(rank)))

    def owner_coord(self, dim: int, index: int) -> int:
        """The coordinate along ``dim``'s grid axis of the block holding ``index``."""
        dim = self._dim(dim)
        n = self.global_shape[dim]
        if not 0 <= index < n:
            raise LayoutError(f"index {index} is outside dim {dim} of size {n}")
        if dim not in self.shard:
            return 0
        # The last block starting at or before index: zero-size blocks share their
        # start with the next block, so they are skipped.
        return bisect.bisect_right(self._offsets[dim], index, hi=len(self._sizes[dim])) - 1

    def owner(self, index: Sequence[int], rank: int | None = None) -> int:
        """Local. The rank whose block holds a global index.

        Parameters
        ----------
        index : sequence of int
            A global index, one entry per dim.
        rank : int, optional
            The owner is sought among the ranks that share this rank's
            coordinates on the replicated grid axes; this rank by default.

        Returns
        -------
        int
            The owner's rank.
        """
        if len(index) != self.ndim:
            raise LayoutError(f"index {tuple(index)} needs {self.ndim} entries")
        coords = list(self._coords(rank))
        for dim, i in enumerate(index):
            c = self.owner_coord(dim, int(i))
            if dim in self.shard:
                coords[self.shard[dim]] = c
        return self.grid.comm.Get_cart_rank(coords)

    def same_blocks(self, other: Decomposition) -> bool:
        """Local. Whether every rank of the grid holds the same cells under both
        layouts (a dim cut over a grid axis of one process is whole, as is one
        not cut): then moving a block from one to the other moves nothing.

        Parameters
        ----------
        other : Decomposition
            Another layout of the same global shape.

        Returns
        -------
        bool
            True where both are on the same grid and every rank's slices agree.
        """
        if self == other:
            return True
        return (self.grid is other.grid and self.global_shape == other.global_shape
                and _same_blocks(self, other))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (isinstance(other, Decomposition) and self.grid is other.grid
                and self.global_shape == other.global_shape and self.shard == other.shard
                and self._sizes == other._sizes)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((id(self.grid), self.global_shape, tuple(self.shard.items()),
                               tuple(self._sizes.items())))
        return self._hash

    def __repr__(self) -> str:
        sizes = {d: list(s) for d, s in self._sizes.items()}
        return (f"Decomposition(global_shape={self.global_shape}, grid dims={self.grid.dims}, "
                f"shard={self.shard}, sizes={sizes})")


@functools.lru_cache(maxsize=4096)
def _same_blocks(a: Decomposition, b: Decomposition) -> bool:
    return all(a.local_slices(r) == b.local_slices(r) for r in range(a.grid.size))
