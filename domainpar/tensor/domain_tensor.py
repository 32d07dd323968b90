"""DomainTensor: a torch.Tensor that is one rank's block of a global tensor.

A DomainTensor reports the global shape, dtype and device; its data is the
block in ``_local`` (a plain tensor), laid out by ``_dec`` (a Decomposition
that every rank holds identically). Torch calls on it are routed by
``dispatch.handle`` (see that module for why at the ``__torch_function__``
level) to domain-parallel rules that work on the blocks.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from ..comm.errors import LayoutError, MismatchError, agree, signature_of
from ..comm.grid import ProcessGrid
from . import dispatch, layout

if TYPE_CHECKING:
    from .aliasing import AliasGroup

# What each rank tells the others in from_local without sizes: (problem,
# block shape, dtype, shard map or why it does not fit, (grid dims, periodic)).
_Story: TypeAlias = tuple[str | None, tuple[int, ...] | None, str | None,
                          dict[int, int] | str | None, tuple[tuple[int, ...], tuple[bool, ...]]]


class DomainTensor(torch.Tensor):
    """Local (the constructor; see ``from_local`` and ``domainpar.scatter`` for
    the collective ones). A global tensor cut into blocks over a ProcessGrid; the
    oracle for every op on it is plain PyTorch on the global tensor in one process.

    Parameters
    ----------
    local : torch.Tensor
        This rank's block, of the decomposition's local shape.
    decomposition : Decomposition
        The layout: global shape, grid, sharded dims and block sizes.
    """

    _local: torch.Tensor
    _dec: Decomposition
    _alias_group: AliasGroup  # set on first use (aliasing.group_of)

    @staticmethod
    def __new__(cls, local: torch.Tensor, decomposition: Decomposition) -> DomainTensor:
        # A factory buffer of ``dp.sharded_factories`` (nn/factories.py) given as a
        # block is a plain use: the block is its plain tensor, which holds the data.
        stand_in = getattr(local, "_stand_in_for", None) if isinstance(local, DomainTensor) \
            else None
        if stand_in is not None:
            local = stand_in()
        if tuple(local.shape) != decomposition.local_shape():
            raise LayoutError(f"internal: a block of shape {tuple(local.shape)} does not fit "
                              f"{decomposition} (local shape {decomposition.local_shape()})")
        self = torch.Tensor._make_wrapper_subclass(
            cls, decomposition.global_shape, dtype=local.dtype, device=local.device,
            requires_grad=False)
        self._local = local
        self._dec = decomposition
        return self

    @classmethod
    def __torch_function__(cls, func: dispatch.Func, types: object, args: dispatch.Args = (),
                           kwargs: dispatch.Kwargs | None = None) -> Any:
        # Under torch.compile a graph break: see compiling.py.
        return dispatch.handle(func, types, args, kwargs)

    # torch declares this hook as a plain function attribute; subclasses define
    # it as a classmethod, as torch's documentation says.
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
            cls, func: object, types: object, args: dispatch.Args = (),
            kwargs: dispatch.Kwargs | None = None) -> Any:
        raise dispatch.UnsupportedOpError(
            f"{func} reached a DomainTensor below the Python API (at aten level), where it "
            f"holds no data; this is a domainpar bug or an op called through a path that "
            f"bypasses __torch_function__")

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_local(cls, block: torch.Tensor, grid: ProcessGrid, shard: Mapping[int, int],
                   sizes: Mapping[int, Sequence[int]] | None = None) -> DomainTensor:
        """Collective. Wrap the block each rank already holds; no data moves and
        gradients flow to ``block``.

        Parameters
        ----------
        block : torch.Tensor
            This rank's block (a plain tensor).
        grid : ProcessGrid
            The processes the global tensor is cut over.
        shard : mapping
            ``{tensor_dim: grid_axis}``.
        sizes : mapping, optional
            ``{dim: [n_0, n_1, ...]}``, the block sizes along each sharded dim.
            Without it they are learned by one allgather of the block shapes,
            which also compares every rank's shard map, grid, dtype, number of
            dims and non-sharded sizes (with ``sizes``, the Decomposition check
            compares them).

        Returns
        -------
        DomainTensor
            The global tensor; its shape is the global shape.

        Raises
        ------
        MismatchError
            On every rank, when the ranks' blocks or arguments disagree.
        """
        problem = None
        if isinstance(block, DomainTensor) or not isinstance(block, torch.Tensor):
            problem = (f"from_local needs this rank's block as a plain torch.Tensor, got a "
                       f"{type(block).__name__}")
            shape, dtype = None, None
        else:
            shape, dtype = tuple(block.shape), str(block.dtype)
        if sizes is None:
            story = (problem, shape, dtype, _normalised_shard(shard, shape, grid),
                     (grid.dims, grid.periodic))
            sizes, error = _sizes_from_stories(grid.comm.allgather(story), grid)
            if error is not None:  # every rank holds the same stories: all raise alike
                raise error
            shard_map = story[3]
            # else error was set
            assert sizes is not None and shape is not None and isinstance(shard_map, dict)
            global_shape = list(shape)
            for d, blocks in sizes.items():  # each sharded dim: the sum of its block sizes
                global_shape[d] = sum(blocks)
            dec = Decomposition(global_shape, grid, shard_map, sizes, check=False)
            return cls(block, dec)
        if problem is None and shape is not None:  # (shape is None only with a problem)
            global_shape = list(shape)
            try:
                for d, s in sizes.items():
                    global_shape[int(d)] = sum(int(n) for n in s)
            except (IndexError, TypeError, ValueError) as exc:
                problem = f"from_local: sizes {sizes} do not fit a block of shape {shape}: {exc}"
        agree(grid.comm, problem, signature=signature_of(dtype), what="from_local block dtypes",
              described=dtype)
        dec = Decomposition(global_shape, grid, shard, sizes)
        agree(grid.comm, None if tuple(block.shape) == dec.local_shape() else
              f"from_local: block shape {tuple(block.shape)} does not match the local shape "
              f"{dec.local_shape()} that sizes={sizes} give this rank")
        return cls(block, dec)

    # -- queries and conversions -------------------------------------------------------------
    @property
    def decomposition(self) -> Decomposition:
        """The layout: global shape, grid, sharded dims and block sizes."""
        return self._dec

    @property
    def grid(self) -> ProcessGrid:
        """Local. The process grid the tensor is sharded over."""
        return self._dec.grid

    def to_local(self) -> torch.Tensor:
        """Local. This rank's block.

        Returns
        -------
        torch.Tensor
            The block itself (differentiable).
        """
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """Collective. The whole tensor, replicated on every rank (an allgatherv).

        Returns
        -------
        torch.Tensor
            The global tensor on every rank; differentiable (backward keeps each
            rank's block of the gradient).
        """
        if not self._dec.shard:
            return self._local
        return ag.allgather(self._local, self._dec)

    def redistribute(self, shard: Mapping[int, int],
                     sizes: Mapping[int, Sequence[int]] | None = None) -> DomainTensor:
        """Collective. The same global tensor laid out anew on the same grid (an
        alltoallv; differentiable).

        Parameters
        ----------
        shard : mapping
            ``{tensor_dim: grid_axis}``, or ``{dim: (a, b)}`` to cut a dim over
            several axes. Grid axes are those of the grid the user made
            (``grid.root``), also when an op left the tensor on a merged grid.
        sizes : mapping, optional
            Block sizes, as for Decomposition; balanced by default.

        Returns
        -------
        DomainTensor
            The new layout.
        """
        dst = Decomposition(self._dec.global_shape, self._dec.grid.root, shard, sizes)
        return DomainTensor(ag.repartition(self._local, self._dec, dst), dst)

    # mypy 2.4 reads torch 2.13's own __repr__(self, *, tensor_contents=None) as
    # incompatible with this, the same signature.
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # noqa: D105
        return (f"DomainTensor(global_shape={tuple(self._dec.global_shape)}, "
                f"dtype={self.dtype}, device={self.device}, "
                f"{layout.sharded_dims_text(self._dec)}, local=\n{self._local!r})")


def _normalised_shard(shard: Mapping[int, int], shape: tuple[int, ...] | None,
                      grid: ProcessGrid) -> dict[int, int] | str | None:
    """``shard`` as ``{dim: axis}`` with non-negative keys and axes, or the
    reason it does not fit a block of ``shape`` on ``grid`` (a string)."""
    if shape is None:
        return None
    try:
        if any(isinstance(a, (tuple, list)) for a in dict(shard).values()):
            return (f"bad shard {shard!r}: from_local takes one grid axis per dim; cut a dim "
                    f"over several axes with scatter or redistribute(shard={{dim: (a, b)}})")
        return Decomposition(shape, grid, shard, check=False).shard
    except (LayoutError, TypeError, ValueError, AttributeError) as exc:
        return f"bad shard {shard!r}: {exc}"


def _differ(stories: Sequence[Sequence[object]], i: int, what: str) -> MismatchError | None:
    """A MismatchError naming every rank's value when item ``i`` of the stories differs."""
    if len({repr(s[i]) for s in stories}) == 1:
        return None
    return MismatchError(f"from_local: {what} differ between ranks ("
                         + "; ".join(f"rank {r}: {s[i]}" for r, s in enumerate(stories)) + ")")


def _sizes_from_stories(stories: Sequence[_Story], grid: ProcessGrid
                        ) -> tuple[dict[int, list[int]] | None, LayoutError | None]:
    """Block sizes per sharded dim from every rank's (problem, shape, dtype,
    shard, grid), or the error that every rank raises alike (all ranks hold the
    same stories)."""
    problems = [f"rank {r}: {s[0]}" for r, s in enumerate(stories) if s[0]]
    if problems:
        return None, LayoutError("; ".join(problems))
    # every shape is there: a rank without one has a problem, reported above
    shapes = [s[1] for s in stories if s[1] is not None]
    error = (_differ(stories, 2, "block dtypes")
             or _differ([(None, len(s)) for s in shapes], 1, "numbers of block dims")
             or _differ(stories, 3, "shard maps (as {tensor dim: grid axis})")
             or _differ(stories, 4, "grids (dims, periodic)"))
    if error is not None:
        return None, error
    dims = stories[0][3]
    if isinstance(dims, str):
        return None, LayoutError(f"from_local: {dims}")
    assert dims is not None  # None only without a shape: a problem, reported above
    for d in range(len(shapes[0])):
        if d not in dims and len({s[d] for s in shapes}) > 1:
            return None, MismatchError(
                f"from_local: dim {d} is not sharded but its size differs between ranks ("
                + "; ".join(f"rank {r}: {s[d]}" for r, s in enumerate(shapes)) + ")")
    sizes: dict[int, list[int]] = {}
    for d, axis in dims.items():
        per_coord: dict[int, set[int]] = {}
        for r, s in enumerate(shapes):
            per_coord.setdefault(grid.coords_of(r)[axis], set()).add(s[d])
        if any(len(v) > 1 for v in per_coord.values()):
            return None, LayoutError(
                f"from_local: ranks at the same coordinate of grid axis {axis} hold blocks of "
                f"different sizes along sharded dim {d}")
        sizes[d] = [per_coord[c].pop() for c in range(grid.dims[axis])]
    return sizes, None


def scatter(t: torch.Tensor | None, grid: ProcessGrid, shard: Mapping[int, int], src: int = 0,
            requires_grad: bool = False, align: Mapping[int, int] | None = None
            ) -> DomainTensor:
    """Collective. A whole tensor held by one rank, cut into balanced blocks over
    ``grid``.

    Parameters
    ----------
    t : torch.Tensor or None
        The whole tensor, needed on ``src`` only. When it requires grad there,
        the result stays connected to it and ``t.grad`` gets the gathered gradient.
    grid : ProcessGrid
        The processes to cut it over.
    shard : mapping
        ``{tensor_dim: grid_axis}``.
    src : int, default 0
        The rank that holds ``t``.
    requires_grad : bool, default False
        Make the result a leaf whose ``.grad`` collects the blocks' gradients.
    align : mapping, optional
        ``{dim: k}``: balance in whole units of ``k`` rows (see Decomposition),
        so that Swin's window partition ``x.view(..., D // k, k, ...)`` is a view
        of each block rather than a repartition.

    Returns
    -------
    DomainTensor
        The blocks, one per rank.
    """
    problem = None
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < grid.size:
        problem = f"scatter: src {src!r} is not a rank of the grid's {grid.size} processes"
    agree(grid.comm, problem, signature=signature_of(src), what="scatter sources",
          described=f"src={src!r}")
    meta = None
    if grid.rank == src:
        if not isinstance(t, torch.Tensor) or isinstance(t, DomainTensor):
            problem = f"scatter: the source rank needs a plain torch.Tensor, got {type(t).__name__}"
        elif requires_grad and not (t.is_floating_point() or t.is_complex()):
            problem = (f"scatter: requires_grad=True needs floating point or complex data, "
                       f"got {t.dtype}")
        else:
            meta = (tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
    problem, meta = grid.comm.bcast((problem, meta), root=src)
    if problem:  # every rank got the same story from src: all raise alike
        raise LayoutError(problem)
    shape, dtype, device_type, src_requires = meta
    dec = Decomposition(shape, grid, shard, align=align)
    if grid.rank == src:
        assert t is not None  # checked above: src holds a tensor, or every rank raised
        source = t
    else:
        device = torch.device(device_type, torch.cuda.current_device()) \
            if device_type == "cuda" else torch.device(device_type)
        source = torch.empty(0, dtype=dtype, device=device, requires_grad=src_requires)
    root = grid.ranks_in(dec.grid)[src]  # src in the numbering of dec's (maybe merged) grid
    if src_requires:
        local = ag.scatter(source, dec, root)
    else:
        with torch.no_grad():
            local = ag.scatter(source, dec, root)
        if requires_grad:
            local.requires_grad_(True)
    return DomainTensor(local, dec)
