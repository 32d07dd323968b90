"""Local. Arrays over a simulation's memory, without copying.

A simulation hands over an address, a dtype and the extents of its padded array
(owned cells plus ghosts) in its own index order, C (last index fastest) or
Fortran (first index fastest). ``storage_view`` makes a C-ordered numpy (host)
or CuPy (device) array over those bytes, in *storage* order, i.e. with the
extents reversed for Fortran. ``logical_view`` turns it back into the
simulation's index order: for Fortran that is the transpose, a view with
Fortran strides, so ``a[i, j]`` in Python is ``a(i+1, j+1)`` in Fortran and
nothing is copied.

Why numpy over ctypes and not a memoryview made in C: the address arrives as a
plain integer on either path, and ``np.ctypeslib.as_array`` gives an array
whose buffer is the simulation's own, which ``torch.from_numpy`` keeps as is.
CuPy's ``UnownedMemory`` is the device counterpart (untested here: no GPU on the
machines this was written on).
"""
from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

# DP_FLOAT32, DP_FLOAT64
DTYPES: dict[int, np.dtype[Any]] = {1: np.dtype(np.float32), 2: np.dtype(np.float64)}
ORDER_C, ORDER_F = 0, 1
HOST, DEVICE = 0, 1


def storage_view(address: int, dtype: np.dtype, extents: tuple[int, ...], order: int,
                 location: int = HOST):
    """The padded array at ``address`` as a C-ordered array in storage order."""
    storage = tuple(reversed(extents)) if order == ORDER_F else tuple(extents)
    count = math.prod(storage)
    if count == 0:  # nothing to alias (a rank with an empty block)
        if location == DEVICE:
            import cupy
            return cupy.empty(storage, dtype=dtype)
        return np.empty(storage, dtype=dtype)
    if location == DEVICE:
        return _device_view(address, dtype, storage, count)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    # a ctypes array is a buffer; numpy's stubs name only some buffer types
    return np.frombuffer(raw, dtype=dtype, count=count).reshape(storage)  # type: ignore[call-overload]


def logical_view(storage, order: int):
    """``storage`` (from ``storage_view``) indexed in the simulation's order."""
    return storage.transpose() if order == ORDER_F else storage


def _device_view(address: int, dtype: np.dtype, storage: tuple[int, ...], count: int):
    """A CuPy array over device memory the simulation owns (``owner=None``: CuPy
    never frees it). Untested here: written for CUDA builds of the simulation."""
    import cupy
    nbytes = count * dtype.itemsize
    memory = cupy.cuda.UnownedMemory(address, nbytes, None)
    return cupy.ndarray(storage, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))
