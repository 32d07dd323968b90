"""HDF5 files for io: which driver, how dtypes are stored, the rank-0 inspection
that every read and write starts with, and hyperslab transfers.

The driver: ``mpio`` (collective opens, collective or independent transfers)
when h5py is built with MPI, serial h5py otherwise. ``DOMAINPAR_IO=serial`` (or
``set_mode('serial')``, ``forced_mode('serial')``) forces the serial fallback
on an MPI build; ``DOMAINPAR_IO=mpio`` insists on MPI.

Stored dtypes: float16/32/64, signed and unsigned integers, bool and
complex64/128 as themselves (complex as h5py's compound of ``r`` and ``i``).
HDF5 has no bfloat16: a bfloat16 tensor is stored as its raw 16-bit patterns in
a ``uint16`` dataset with the attribute ``domainpar_dtype='bfloat16'``, and read
back bit for bit as bfloat16 (other tools see the integers).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence

import h5py
import numpy as np
import torch
from h5py import h5fd, h5p, h5s
from mpi4py import MPI

from . import guard
from .errors import DataError, agree, bcast_outcome

ENV = "DOMAINPAR_IO"
MODES = ("auto", "mpio", "serial")
DTYPE_ATTR = "domainpar_dtype"
ORDER_ATTR = "order"

_mode: str | None = None  # set_mode's choice; None: the environment's

# Open MPI 4.1.0-4.1.4: OMPIO's read data sieving returns wrong values for some
# collective reads whose selections overlap across ranks (ghost cells do), e.g.
# rows [0,4), [2,7), [5,9) of a chunked dataset on 3 ranks; open-mpi/ompi#10546,
# fixed in 4.1.5. Turning it off (it also allocates up to 64 MiB per read) is
# the documented workaround. Open MPI reads the variable when MPI-IO first
# opens a file, so setting it here, before any file is opened, is in time; a
# value the user set wins.
if MPI.Get_library_version().startswith("Open MPI v4.1."):
    try:
        _patch = int(MPI.Get_library_version().split(",")[0].split(".")[2])
    except (IndexError, ValueError):
        _patch = 0
    if _patch < 5:
        os.environ.setdefault("OMPI_MCA_fbtl_posix_read_datasieving", "0")


def has_mpi() -> bool:
    """Local. Whether this h5py is built against parallel HDF5."""
    return bool(h5py.get_config().mpi)


def set_mode(mode: str | None) -> None:
    """Local (call it alike on every rank). ``'auto'`` (mpio when h5py has MPI),
    ``'mpio'``, ``'serial'``, or None to follow ``DOMAINPAR_IO`` again."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"io mode must be one of {MODES} or None, got {mode!r}")
    global _mode
    _mode = mode


@contextlib.contextmanager
def forced_mode(mode: str):
    """Local. ``set_mode(mode)`` inside the block, the previous choice after it."""
    global _mode
    before = _mode
    set_mode(mode)
    try:
        yield
    finally:
        _mode = before


def parallel() -> bool:
    """Local. True when io uses ``driver='mpio'`` now, False for the serial fallback."""
    mode = _mode or os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise DataError(f"{ENV}={mode!r}: use one of {', '.join(MODES)}")
    if mode == "mpio" and not has_mpi():
        raise DataError(f"io mode 'mpio' asked for ({ENV} or set_mode), but this h5py is "
                        f"built without MPI")
    return mode != "serial" and has_mpi()


# -- dtypes ---------------------------------------------------------------------------------
_STORED = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
           torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
           torch.int64: np.int64, torch.uint8: np.uint8, torch.uint16: np.uint16,
           torch.uint32: np.uint32, torch.uint64: np.uint64, torch.bool: np.bool_,
           torch.complex64: np.complex64, torch.complex128: np.complex128}
_LOADED = {np.dtype(v): k for k, v in _STORED.items()}


def stored_dtype(dtype: torch.dtype) -> tuple[np.dtype, dict]:
    """Local. The numpy dtype a torch dtype is stored as, and the attributes that
    say how to read it back."""
    if dtype == torch.bfloat16:
        return np.dtype(np.uint16), {DTYPE_ATTR: "bfloat16"}
    if dtype not in _STORED:
        raise DataError(f"io cannot store {dtype} tensors (supported: bfloat16, "
                        f"{', '.join(str(d) for d in _STORED)})")
    return np.dtype(_STORED[dtype]), {}


def loaded_dtype(dtype: np.dtype, attrs) -> torch.dtype:
    """Local. The torch dtype of a dataset of numpy ``dtype`` with ``attrs``."""
    if attrs.get(DTYPE_ATTR) == "bfloat16" and dtype == np.uint16:
        return torch.bfloat16
    if dtype not in _LOADED:
        raise DataError(f"io cannot read datasets of dtype {dtype} into torch")
    return _LOADED[dtype]


def empty(shape, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """Local. An uninitialised CPU tensor and the numpy view to read into. numpy
    allocates it: for large arrays numpy asks for transparent huge pages, which
    makes the first touch of a fresh block several times cheaper than torch.empty's
    4 KiB page faults (a read loop allocates a fresh block per sample)."""
    array = np.empty(shape, dtype=stored_dtype(dtype)[0])
    tensor = torch.from_numpy(array)
    return (tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor), array


def as_array(t: torch.Tensor) -> np.ndarray:
    """Local. A numpy view of the contiguous CPU tensor ``t`` in its stored dtype."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    return t.numpy()


# -- inspection -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Info:
    """What rank 0 found: the dataset's file shape, torch dtype, storage order,
    whether it is virtual (the serial fallback's), and its chunking and filter."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    order: str
    virtual: bool
    chunks: tuple[int, ...] | None
    compression: str | None
    parts: tuple[str, ...] = ()  # a virtual dataset's part files


def _names(group) -> str:
    names = sorted(group.keys())
    return ", ".join(names[:10]) + (", ..." if len(names) > 10 else "") if names else "nothing"


def _open_serial(path: str) -> h5py.File:
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise DataError(f"{path} is not a file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"{path} is not a readable HDF5 file (truncated or corrupt?): "
                        f"{exc}") from None


def _info(path: str, name: str, must_exist: bool) -> Info | None:
    with _open_serial(path) as f:
        if name not in f:
            if not must_exist:
                return None
            raise DataError(f"{path} has no dataset {name!r} (it holds: {_names(f)})")
        parts = guard.check_dataset(path, f, name)
        dset = f[name]
        order = dset.attrs.get(ORDER_ATTR, "C")
        order = order.decode() if isinstance(order, bytes) else str(order)
        if order not in ("C", "F"):
            raise DataError(f"{path}: dataset {name!r} has order={order!r}; expected 'C' or 'F'")
        try:
            dtype = loaded_dtype(dset.dtype, dset.attrs)
        except DataError as exc:
            raise DataError(f"{path}: dataset {name!r}: {exc}") from None
        return Info(tuple(dset.shape), dtype, order, bool(dset.is_virtual),
                    dset.chunks, dset.compression, tuple(parts))


def inspect(comm: MPI.Comm, path: str, name: str) -> Info:
    """Collective. Rank 0 opens ``path`` serially and looks at dataset ``name``;
    every rank gets its Info, or the same DataError (no such file, not HDF5 or
    truncated, no such dataset, a dtype torch cannot hold, a missing part, data
    kept outside the file: see ``guard``)."""
    info = bcast_outcome(comm, lambda: _info(str(path), name, True))
    assert info is not None  # required: a missing dataset is a DataError
    return info


def inspect_target(comm: MPI.Comm, path: str, name: str) -> tuple[bool, Info | None]:
    """Collective. For a write: whether ``path`` exists, and the Info of dataset
    ``name`` in it (None when it has none); a file that is there but unreadable
    raises the same DataError on every rank."""
    def look():
        if not os.path.exists(path):
            return False, None
        return True, _info(path, name, False)
    return bcast_outcome(comm, look)


# -- opening and transfers ------------------------------------------------------------------
def open_file(path: str, how: str, comm: MPI.Comm, mpio: bool,
              parts: Sequence[str] = ()) -> h5py.File:
    """Collective. ``h5py.File(path, how)`` on every rank, with the mpio driver on
    ``comm`` or serial h5py; a DataError on every rank if any rank cannot open it,
    or sees the file (or its ``parts``) where another does not (``guard.visible``,
    before the open: a collective open of a file some ranks lack never returns)."""
    guard.visible(comm, path, how, parts)
    handle, problem = None, None
    try:
        handle = (h5py.File(path, how, driver="mpio", comm=comm) if mpio
                  else h5py.File(path, how))
    except OSError as exc:
        problem = f"cannot open {path} ({how!r}): {exc}"
    agree(comm, problem)
    return handle


def _dxpl(collective: bool) -> h5p.PropDXID:
    dxpl = h5p.create(h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5fd.MPIO_COLLECTIVE if collective else h5fd.MPIO_INDEPENDENT)
    return dxpl


Box = tuple[Sequence[int], Sequence[int], Sequence[int]]  # file start, memory start, count


def transfer(dset: h5py.Dataset, array: np.ndarray, boxes: Sequence[Box | None], *,
             write: bool = False, collective: bool = False) -> None:
    """Collective when ``collective`` (every rank passes as many boxes), else Local.

    Reads (or writes) each box between the file and ``array`` (C-contiguous, the
    file's dtype) straight into (out of) its place, one H5Dread (H5Dwrite) per
    box. A box of None or with a zero count is an empty selection: with
    collective transfers the rank still takes part in that call.
    """
    dxpl = _dxpl(True) if collective else None
    mshape = array.shape if array.ndim else (1,)
    for box in boxes:
        empty = box is None or 0 in tuple(box[2])
        if empty and not collective:
            continue
        fspace, mspace = dset.id.get_space(), h5s.create_simple(mshape)
        if empty:
            fspace.select_none()
            mspace.select_none()
        else:
            assert box is not None  # not empty
            fstart, mstart, count = (tuple(int(v) for v in b) for b in box)
            fspace.select_hyperslab(fstart, count)
            mspace.select_hyperslab(mstart, count)
        if write:
            dset.id.write(mspace, fspace, array, dxpl=dxpl)
        else:
            dset.id.read(mspace, fspace, array, dxpl=dxpl)
