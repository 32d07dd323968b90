"""read: this rank's block of an HDF5 dataset, optionally with a halo.

A rank reads only its block (plus ghost cells) by hyperslab selection, straight
into the tensor it returns: its peak memory is its block plus HDF5's and
MPI-IO's buffers, never the dataset. Virtual datasets (what ``write`` makes in
serial mode) are read with serial h5py even where MPI is available: HDF5 1.10
refuses parallel reads of virtual datasets.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from ..comm.decomposition import Decomposition
from ..comm.errors import LayoutError, signature_of
from ..comm.errors import agree as agree_args
from ..comm.grid import ProcessGrid
from ..tensor.domain_tensor import DomainTensor
from . import blocks, files
from .errors import DataError, agree


class HaloBlock(NamedTuple):
    """What ``read`` returns when a halo is asked for.

    ``padded``: a plain tensor, this rank's block with ``width[d] = (lo, hi)``
    ghost cells on each side of dim ``d`` (the layout ``HaloExchange(dec, width)``
    works on): ghosts of interior neighbours hold the neighbours' values (read
    from the file), ghosts across a periodic edge the wrapped values, ghosts
    beyond a non-periodic edge the fill value. A first conv layer with
    ``padding=p`` and a halo of ``p`` on every spatial dim is
    ``F.conv2d(padded, w)`` without padding: the owned block of its output.
    ``block``: the owned cells as a DomainTensor; its local tensor is a view
    into ``padded`` (no copy; not contiguous along the padded dims).
    """
    block: DomainTensor
    padded: torch.Tensor
    width: dict[int, tuple[int, int]]


def selection(shape: Sequence[int], index) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local. ``(base, shape)`` of the part of an array of ``shape`` that ``index``
    (None, an int or a slice with step 1, along dim 0) selects; an int keeps a
    leading dim of size 1 (a batch of one)."""
    shape = tuple(shape)
    if index is None:
        return (0,) * len(shape), shape
    if not shape:
        raise LayoutError("index needs a dataset with at least one dim")
    n = shape[0]
    if isinstance(index, slice):
        start, stop, step = index.indices(n)
        if step != 1:
            raise LayoutError(f"index {index} must have step 1")
        first, count = start, max(0, stop - start)
    elif isinstance(index, int) and not isinstance(index, bool):
        if not -n <= index < n:
            raise LayoutError(f"index {index} is out of range for dim 0 of size {n}")
        first, count = index % n, 1
    else:
        raise LayoutError(f"index must be None, an int or a slice, got {index!r}")
    return (first,) + (0,) * (len(shape) - 1), (count,) + shape[1:]


def fortran(info: files.Info, order: str | None) -> bool:
    """Local. Whether the file holds the array's dims backwards: ``order`` when
    given ('C' or 'F'), else the dataset's ``order`` attribute."""
    if order is None:
        return info.order == "F"
    if order not in ("C", "F"):
        raise LayoutError(f"order must be 'C', 'F' or None, got {order!r}")
    return order == "F"


def logical_shape(info: files.Info, is_fortran: bool) -> tuple[int, ...]:
    """Local. The array's shape as torch sees it: the file's, backwards for 'F'."""
    return info.shape[::-1] if is_fortran else info.shape


def read_plan(dset, dtype: torch.dtype, plan: blocks.Plan, base: Sequence[int],
              is_fortran: bool, fill, collective: bool) -> torch.Tensor:
    """Collective when ``collective``, else Local. The padded block of ``plan``,
    read box by box into one tensor (a Fortran-ordered file: read in file order,
    then permuted and made contiguous, a second copy of the block)."""
    shape = plan.shape[::-1] if is_fortran else plan.shape
    out, array = files.empty(shape, dtype)
    files.transfer(dset, array, blocks.file_boxes(plan, base, is_fortran), collective=collective)
    for region in plan.fill_regions():
        out[region[::-1] if is_fortran else region].fill_(fill)
    if is_fortran:
        out = out.permute(tuple(range(out.ndim))[::-1]).contiguous()
    return out


def result(padded: torch.Tensor, dec: Decomposition, plan: blocks.Plan):
    """Local. A DomainTensor of the block, or a HaloBlock when there are ghosts."""
    if not plan.widths:
        return DomainTensor(padded, dec)
    return HaloBlock(DomainTensor(padded[plan.owned()], dec), padded, dict(plan.widths))


def read(path, dataset: str, grid: ProcessGrid, shard: Mapping[int, int] | None = None, *,
         halo=None, index=None, sizes: Mapping[int, Sequence[int]] | None = None,
         dtype: torch.dtype | None = None, order: str | None = None,
         periodic: Mapping[int, bool] | None = None, fill=0, collective: bool = True):
    """Collective. This rank's block of ``dataset`` in the HDF5 file ``path``, cut
    by ``Decomposition(shape, grid, shard, sizes)``.

    Parameters
    ----------
    path : str or os.PathLike
        The HDF5 file.
    dataset : str
        The dataset's name in it.
    grid, shard
        The layout of what ``index`` selects, as for Decomposition.
    halo : int or mapping, optional
        Ghost cells to read too: an int (that many on both sides of every
        sharded dim) or ``{dim: w or (lo, hi)}``.
    index : int or slice, optional
        An int (one sample, kept as a leading dim of 1) or a slice of dim 0.
    sizes : mapping, optional
        Block sizes, as for Decomposition.
    dtype : torch.dtype, optional
        The dtype expected (a DataError when the file holds another; nothing
        is converted).
    order : {'C', 'F'}, optional
        'F' when the file holds the dims backwards (a Fortran simulation's
        array); None follows the dataset's ``order`` attribute.
    periodic : mapping, optional
        ``{dim: bool}``: whether ghosts wrap, overriding the grid axis's
        periodicity.
    fill : scalar, default 0
        The value of ghosts beyond non-periodic edges.
    collective : bool, default True
        Collective transfers under mpio (else independent); serial h5py reads
        independently anyway.

    Returns
    -------
    DomainTensor or HaloBlock
        The block; a HaloBlock when ``halo`` is given.

    Raises
    ------
    DataError
        On every rank alike, for a missing file or dataset, a file that is not
        HDF5 (truncated, corrupt), a dtype other than ``dtype``.
    LayoutError
        On every rank alike, for a shape that does not fit the decomposition or
        the index.
    """
    comm = grid.comm
    mpio = files.parallel()
    agree_args(comm, None, signature=signature_of(str(path), dataset, index, str(dtype), order,
                                                  halo, periodic, fill, collective, mpio),
               what="read arguments", described=f"{path}:{dataset} index={index} halo={halo} "
                                                f"dtype={dtype} order={order} mpio={mpio}")
    info = files.inspect(comm, str(path), dataset)
    if dtype is not None and dtype != info.dtype:
        raise DataError(f"{path}:{dataset} holds {info.dtype}, not the {dtype} asked for")
    is_fortran = fortran(info, order)
    base, shape = selection(logical_shape(info, is_fortran), index)
    dec = Decomposition(shape, grid, shard, sizes)
    plan = blocks.plan(dec, blocks.widths(halo, dec), blocks.periodic_dims(dec, periodic))
    mpio = mpio and not info.virtual
    padded, problem = None, None
    with files.open_file(str(path), "r", comm, mpio, info.parts) as f:
        try:
            padded = read_plan(f[dataset], info.dtype, plan, base, is_fortran, fill,
                               collective and mpio)
        except (OSError, KeyError) as exc:
            problem = f"reading {path}:{dataset}: {exc}"
    agree(comm, problem)
    assert padded is not None  # else agree raised, on every rank
    return result(padded, dec, plan)
