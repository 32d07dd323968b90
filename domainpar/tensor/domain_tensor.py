"""DomainTensor: a torch.Tensor that is one rank's block of a global tensor.

A DomainTensor reports the global shape, dtype and device; its data is the
block in ``_local`` (a plain tensor), laid out by ``_dec`` (a Decomposition
that every rank holds identically). Torch calls on it are routed by
``dispatch.handle`` (see that module for why at the ``__torch_function__``
level) to domain-parallel rules that work on the blocks.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from ..comm.errors import LayoutError, agree, signature_of
from ..comm.grid import ProcessGrid
from . import dispatch, layout


class DomainTensor(torch.Tensor):
    """A global tensor cut into blocks over a ProcessGrid (see ``from_local``,
    ``domainpar.scatter``); the oracle for every op on it is plain PyTorch on the
    global tensor in one process.

    Internal constructor: ``DomainTensor(local, decomposition)`` wraps a block
    whose shape is the decomposition's local shape, without communicating.
    """

    _local: torch.Tensor
    _dec: Decomposition

    @staticmethod
    def __new__(cls, local: torch.Tensor, decomposition: Decomposition):
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
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return dispatch.handle(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise dispatch.UnsupportedOpError(
            f"{func} reached a DomainTensor below the Python API (at aten level), where it "
            f"holds no data; this is a domainpar bug or an op called through a path that "
            f"bypasses __torch_function__")

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_local(cls, block: torch.Tensor, grid: ProcessGrid, shard: Mapping[int, int],
                   sizes: Mapping[int, Sequence[int]] | None = None) -> "DomainTensor":
        """Collective. Wrap the block each rank already holds; no data moves and
        gradients flow to ``block``.

        Without ``sizes`` the block sizes along the sharded dims are learned by
        one allgather of the block shapes. Blocks whose dtypes or non-sharded dims
        differ between ranks raise the same LayoutError on every rank.
        """
        problem = None
        if isinstance(block, DomainTensor) or not isinstance(block, torch.Tensor):
            problem = (f"from_local needs this rank's block as a plain torch.Tensor, got a "
                       f"{type(block).__name__}")
            shape, dtype = None, None
        else:
            shape, dtype = tuple(block.shape), str(block.dtype)
        if sizes is None:
            stories = grid.comm.allgather((problem, shape, dtype))
            sizes, problem = _sizes_from_shapes(stories, grid, shard)
            agree(grid.comm, problem, what="from_local")
            # The global shape: any block's, with each sharded dim the sum of its sizes.
            global_shape = list(stories[0][1])
            for d, s in sizes.items():
                global_shape[d] = sum(s)
            dec = Decomposition(global_shape, grid, shard, sizes, check=False)
            return cls(block, dec)
        if problem is None:
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
        return self._dec.grid

    def to_local(self) -> torch.Tensor:
        """Local. This rank's block (differentiable: it is the block itself)."""
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """Collective. The whole tensor, replicated on every rank (an allgatherv;
        differentiable: backward keeps each rank's block of the gradient)."""
        if not self._dec.shard:
            return self._local
        return ag.allgather(self._local, self._dec)

    def redistribute(self, shard: Mapping[int, int],
                     sizes: Mapping[int, Sequence[int]] | None = None) -> "DomainTensor":
        """Collective. The same global tensor laid out by ``shard`` and ``sizes`` on
        the same grid (an alltoallv; differentiable)."""
        dst = Decomposition(self._dec.global_shape, self._dec.grid, shard, sizes)
        return DomainTensor(ag.repartition(self._local, self._dec, dst), dst)

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105
        return (f"DomainTensor(global_shape={tuple(self._dec.global_shape)}, "
                f"dtype={self.dtype}, device={self.device}, "
                f"{layout.sharded_dims_text(self._dec)}, local=\n{self._local!r})")


def _sizes_from_shapes(stories, grid: ProcessGrid, shard: Mapping[int, int]):
    """Block sizes per sharded dim from every rank's (problem, shape, dtype), or a
    problem that every rank finds alike (all ranks hold the same stories)."""
    problems = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(stories) if p]
    if problems:
        return None, "; ".join(problems)
    shapes = [s for _, s, _ in stories]
    dtypes = {d for _, _, d in stories}
    if len(dtypes) > 1:
        return None, ("from_local: block dtypes differ between ranks ("
                      + "; ".join(f"rank {r}: {d}" for r, (_, _, d) in enumerate(stories)) + ")")
    ndims = {len(s) for s in shapes}
    if len(ndims) > 1:
        return None, ("from_local: blocks have different numbers of dims ("
                      + "; ".join(f"rank {r}: {s}" for r, s in enumerate(shapes)) + ")")
    ndim = ndims.pop()
    try:
        dims = {int(d) % ndim if -ndim <= int(d) < ndim else None: int(a) % grid.ndim
                for d, a in shard.items()}
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        return None, f"from_local: bad shard {shard}: {exc}"
    if None in dims:
        return None, f"from_local: shard {dict(shard)} names a dim a {ndim}-D block does not have"
    for d in range(ndim):
        if d not in dims and len({s[d] for s in shapes}) > 1:
            return None, (f"from_local: dim {d} is not sharded but its size differs between "
                          "ranks (" + "; ".join(f"rank {r}: {s[d]}" for r, s in enumerate(shapes))
                          + ")")
    sizes = {}
    for d, axis in dims.items():
        per_coord: dict[int, set] = {}
        for r, s in enumerate(shapes):
            per_coord.setdefault(grid.coords_of(r)[axis], set()).add(s[d])
        if any(len(v) > 1 for v in per_coord.values()):
            return None, (f"from_local: ranks at the same coordinate of grid axis {axis} hold "
                          f"blocks of different sizes along sharded dim {d}")
        sizes[d] = [per_coord[c].pop() for c in range(grid.dims[axis])]
    return sizes, None


def scatter(t: torch.Tensor | None, grid: ProcessGrid, shard: Mapping[int, int], src: int = 0,
            requires_grad: bool = False) -> DomainTensor:
    """Collective. ``t`` (needed on ``src`` only) cut into blocks over ``grid``.

    With ``requires_grad`` the result is a leaf whose ``.grad`` collects the
    blocks' gradients. When ``t`` itself requires grad on ``src``, the result
    stays connected to it instead and ``t.grad`` gets the gathered gradient.
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
    dec = Decomposition(shape, grid, shard)
    if grid.rank == src:
        source = t
    else:
        device = torch.device(device_type, torch.cuda.current_device()) \
            if device_type == "cuda" else torch.device(device_type)
        source = torch.empty(0, dtype=dtype, device=device, requires_grad=src_requires)
    if src_requires:
        local = ag.scatter(source, dec, src)
    else:
        with torch.no_grad():
            local = ag.scatter(source, dec, src)
        if requires_grad:
            local.requires_grad_(True)
    return DomainTensor(local, dec)
