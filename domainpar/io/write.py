"""write: a DomainTensor into one HDF5 dataset, each rank writing its block.

Under mpio: one chunked dataset, written collectively (with ``compression``
where HDF5 >= 1.10.2 allows filters in parallel; collective transfers are what
it needs). Serial fallback: each rank writes its block to its own part file
``<path>.rank<r>.h5`` (same dataset name), and rank 0 makes the dataset in
``path`` a virtual dataset stitching the parts into the global array; ``read``
reads it like any other (the part files must stay beside ``path``; they are
found relative to it). Ranks that hold a replica of a block (grid axes that
no dim is sharded along) leave the writing to the one at coordinate 0.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import h5py
import torch

from ..comm.errors import agree as agree_args
from ..comm.errors import signature_of
from ..tensor.domain_tensor import DomainTensor
from . import files, guard
from .errors import DataError, agree

CHUNK_BYTES = 4 << 20  # chunks up to 4 MiB: HDF5 reads and filters whole chunks


def part_path(path: str, rank: int) -> str:
    """Local. The serial fallback's part file of ``rank`` for the main file ``path``."""
    return f"{path}.rank{rank}.h5"


def chunk_shape(shape: Sequence[int], block: Sequence[int], itemsize: int):
    """Local. Chunks as large as a block (so blocks rarely share chunks), cut down
    to at most CHUNK_BYTES by halving the outermost dims first: one sample of an
    (N, C, *spatial) dataset per chunk before the spatial extent shrinks, so a
    sample's block is whole chunks, each a contiguous run in the file. None
    (contiguous) for an empty array."""
    if not shape or 0 in shape:
        return None
    chunk = [max(1, min(b, n)) for b, n in zip(block, shape)]
    for d in range(len(chunk)):
        while math.prod(chunk) * itemsize > CHUNK_BYTES and chunk[d] > 1:
            chunk[d] = (chunk[d] + 1) // 2
    return tuple(chunk)


def _filter_options(compression, compression_opts, mpio: bool) -> dict:
    if compression is None:
        return {}
    if mpio and h5py.version.hdf5_version_tuple < (1, 10, 2):
        raise DataError(f"compression under parallel HDF5 needs HDF5 >= 1.10.2, this is "
                        f"{h5py.version.hdf5_version}: pass compression=None or use the "
                        f"serial fallback ({files.ENV}=serial)")
    return {"compression": compression, "compression_opts": compression_opts}


def _writes(x: DomainTensor) -> bool:
    """Whether this rank writes its block: replicas leave it to coordinate 0."""
    dec = x._dec
    return all(dec.grid.coords[a] == 0 for a in dec.replicated_axes)


def _file_block(x: DomainTensor, is_fortran: bool) -> torch.Tensor:
    """The block as it lies in the file: contiguous, dims reversed for Fortran order."""
    block = x._local.detach().cpu()
    if is_fortran:
        block = block.permute(tuple(range(block.ndim))[::-1])
    return block.contiguous()


def _existing_problem(path, dataset, found: files.Info | None, x: DomainTensor,
                      is_fortran: bool, overwrite: bool) -> str | None:
    if found is None:
        return None
    where = f"{path}:{dataset}"
    if not overwrite:
        return f"{where} exists; pass overwrite=True to replace it"
    want = x._dec.global_shape[::-1] if is_fortran else x._dec.global_shape
    if found.dtype != x.dtype:
        return f"{where} holds {found.dtype}; cannot overwrite it with a {x.dtype} tensor"
    if found.shape != tuple(want) or (found.order == "F") != is_fortran:
        return (f"{where} has shape {found.shape} (order {found.order}); cannot overwrite it "
                f"with a tensor of shape {tuple(want)} (order {'F' if is_fortran else 'C'})")
    return None


def write(path, dataset: str, x: DomainTensor, *, overwrite: bool = False,
          compression=None, compression_opts=None, chunks=None, order: str = "C",
          attrs: Mapping | None = None) -> None:
    """Collective. Write the global array of ``x`` into ``dataset`` of the HDF5 file
    ``path`` (created if missing, else added to), each rank writing its block.

    Parameters
    ----------
    path : str or os.PathLike
        The HDF5 file.
    dataset : str
        The dataset's name in it.
    x : DomainTensor
        The global array to write.
    overwrite : bool, default False
        Replace an existing dataset of the same shape and dtype (under mpio a
        regular dataset is written in place, keeping its chunking and filters);
        without it, or with another shape or dtype, an existing dataset is a
        DataError on every rank.
    compression, compression_opts : optional
        h5py's filter options.
    chunks : tuple of int, optional
        A chunk shape, in the file's dim order (default: about a block, at most
        4 MiB; in serial mode cut to each part).
    order : {'C', 'F'}, default 'C'
        'F' stores the dims backwards with the attribute ``order='F'``, as a
        Fortran code would; ``read`` turns it back.
    attrs : mapping, optional
        Attributes for the dataset (values h5py can store, equal on every rank).
    """
    if not isinstance(x, DomainTensor):
        raise DataError(f"io.write needs a DomainTensor, got {type(x).__name__}")
    comm, path = x._dec.grid.comm, str(path)
    mpio = files.parallel()
    agree_args(comm, None, signature=signature_of(path, dataset, overwrite, compression,
                                                  compression_opts, chunks, order, mpio,
                                                  sorted((attrs or {}).items())),
               what="write arguments", described=f"{path}:{dataset} order={order} mpio={mpio}")
    if order not in ("C", "F"):
        raise DataError(f"order must be 'C' or 'F', got {order!r}")
    is_fortran = order == "F"
    np_dtype, dtype_attrs = files.stored_dtype(x.dtype)
    filters = _filter_options(compression, compression_opts, mpio)
    guard.visible(comm, path, "a")  # every rank sees the file (or its directory) alike
    exists, found = files.inspect_target(comm, path, dataset)
    agree(comm, _existing_problem(path, dataset, found, x, is_fortran, overwrite))
    all_attrs = {**dtype_attrs, **({files.ORDER_ATTR: "F"} if is_fortran else {}), **(attrs or {})}
    if mpio:
        _write_mpio(path, dataset, x, is_fortran, np_dtype, found, filters, chunks, all_attrs)
    else:
        _write_serial(path, dataset, x, is_fortran, np_dtype, exists, filters, chunks, all_attrs)


def _create(group, name, shape, np_dtype, block_shape, chunks, filters, attrs):
    if chunks is None:
        chunks = chunk_shape(shape, block_shape, np_dtype.itemsize)
    if chunks is None:
        filters = {}
    dset = group.create_dataset(name, shape=tuple(shape), dtype=np_dtype, chunks=chunks,
                                **filters)
    for key, value in attrs.items():
        dset.attrs[key] = value
    return dset


def _write_mpio(path, dataset, x, is_fortran, np_dtype, found, filters, chunks, attrs):
    comm, dec = x._dec.grid.comm, x._dec
    rev = (lambda t: tuple(t)[::-1]) if is_fortran else tuple
    shape = rev(dec.global_shape)
    problem = None
    f = files.open_file(path, "a", comm, True)
    try:
        # Every rank makes the same metadata calls (HDF5 requires it under mpio).
        if found is not None and found.virtual:
            del f[dataset]  # parallel writes into a virtual dataset are not possible
            found = None
        if found is None:
            max_block = [max(dec.block_sizes(d)) for d in range(dec.ndim)]
            dset = _create(f, dataset, shape, np_dtype, rev(max_block), chunks, filters, attrs)
        else:
            dset = f[dataset]
            for key, value in attrs.items():
                dset.attrs[key] = value
        block = _file_block(x, is_fortran)
        box = None
        if _writes(x) and block.numel():
            box = (rev(dec.offsets()), (0,) * dec.ndim, tuple(block.shape))
        # Collective: filtered parallel writes need it, and it lets MPI-IO aggregate.
        files.transfer(dset, files.as_array(block), [box], write=True, collective=True)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        problem = f"writing {path}:{dataset}: {exc}"
    finally:
        f.close()
    agree(comm, problem)


def _pieces(dec, rev) -> list[tuple[int, tuple, tuple]]:
    """``(rank, shape, offsets)`` of each written part, in file dim order."""
    pieces = []
    for r in range(dec.grid.comm.Get_size()):
        shape, coords = dec.local_shape(r), dec.grid.coords_of(r)
        if 0 in shape or any(coords[a] for a in dec.replicated_axes):
            continue
        pieces.append((r, rev(shape), rev(dec.offsets(r))))
    return pieces


def _write_serial(path, dataset, x, is_fortran, np_dtype, exists, filters, chunks, attrs):
    comm, dec = x._dec.grid.comm, x._dec
    rev = (lambda t: tuple(t)[::-1]) if is_fortran else tuple
    block = _file_block(x, is_fortran)
    mine = _writes(x) and block.numel() > 0
    problem = None
    if mine:
        try:
            with h5py.File(part_path(path, comm.Get_rank()), "a") as part:
                if dataset in part:
                    del part[dataset]
                # A chunk shape given for the whole array, cut to this part.
                part_chunks = chunks if chunks is None else tuple(
                    min(c, n) for c, n in zip(chunks, block.shape))
                dset = _create(part, dataset, block.shape, np_dtype, block.shape, part_chunks,
                               filters, {})
                files.transfer(dset, files.as_array(block),
                               [((0,) * block.ndim, (0,) * block.ndim, tuple(block.shape))],
                               write=True)
        except (OSError, ValueError, TypeError) as exc:
            problem = f"writing the part file {part_path(path, comm.Get_rank())}: {exc}"
    agree(comm, problem)
    # Where every rank's piece lies, known to all without a message.
    pieces = _pieces(dec, rev)
    if comm.Get_rank() == 0:  # a part written where rank 0 cannot see it: not shared
        lost = [part_path(path, r) for r, _, _ in pieces if not os.path.isfile(part_path(path, r))]
        if lost:
            problem = (f"{path}: rank 0 cannot see the part files {', '.join(lost)} that the "
                       f"other ranks wrote (is the directory on a filesystem not every rank "
                       f"shares?)")
    agree(comm, problem)
    if comm.Get_rank() == 0:
        try:
            layout = h5py.VirtualLayout(shape=rev(dec.global_shape), dtype=np_dtype)
            for r, shape, offsets in pieces:
                source = h5py.VirtualSource(os.path.basename(part_path(path, r)), dataset,
                                            shape=shape, dtype=np_dtype)
                layout[tuple(slice(o, o + n) for o, n in zip(offsets, shape))] = source
            with h5py.File(path, "a" if exists else "w") as f:
                if dataset in f:
                    del f[dataset]
                dset = f.create_virtual_dataset(dataset, layout)
                for key, value in attrs.items():
                    dset.attrs[key] = value
        except (OSError, ValueError, TypeError) as exc:
            problem = f"writing the virtual dataset {path}:{dataset}: {exc}"
    agree(comm, problem)
