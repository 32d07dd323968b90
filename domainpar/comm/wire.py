"""What MPI touches for an array: the array itself, or a host copy of a device
array where MPI is not CUDA-aware (``runtime.stages_device_buffers``), and the
copy of a received result back to where the caller's array lives. Shared by the
collectives and the pairwise exchanges; halo exchanges stage their own buffers
(``halo``)."""
from __future__ import annotations

import numpy as np

from . import buffers, runtime
from .buffers import Array


def to_wire(arr: Array) -> Array:
    """Local. What MPI may touch for ``arr``: itself, or a host copy when ``arr``
    is on a GPU and MPI is not CUDA-aware. Waits for the producing stream first."""
    buffers.synchronize(arr)
    if buffers.is_device(arr) and runtime.stages_device_buffers():
        return arr.get()
    return arr


def from_wire(wire: Array, like: Array) -> Array:
    """Local. ``wire`` moved back to where ``like`` lives."""
    if buffers.is_device(like) and isinstance(wire, np.ndarray):
        return buffers.namespace(like).asarray(wire)
    return wire


def copy_back(wire: Array, arr: Array) -> None:
    """Local. Copy a result received in ``wire`` into the caller's ``arr`` and wait
    for the copy: on a GPU it runs on CuPy's stream, and the caller may go on on
    another one (a torch side stream) that nothing orders after it."""
    buffers.namespace(arr).copyto(arr, from_wire(wire, arr).reshape(arr.shape))
    buffers.synchronize(arr)
