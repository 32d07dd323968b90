"""Array adapters: numpy, CuPy and torch (CPU and CUDA) buffers for MPI, zero-copy.

The communication code sees two kinds of arrays only: numpy arrays (host) and
CuPy arrays (device). ``as_array`` turns whatever the caller holds into one of
them without copying:

- numpy arrays pass through;
- torch CPU tensors become numpy views through DLPack (mpi4py handed a numpy
  view is several times cheaper per call than handed the tensor itself);
- CuPy arrays pass through; torch CUDA tensors become CuPy views through DLPack,
  which also orders the producer's stream before CuPy's current stream, so that
  ``synchronize`` below waits for the work that produced the data.

Nothing here imports torch: tensors are recognised by duck typing.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, TypeAlias

import numpy as np

# An ``as_array`` result: numpy.ndarray (host) or cupy.ndarray (device). CuPy
# ships no type information, so to a type checker this union is as wide as Any;
# the alias names what is meant.
Array: TypeAlias = Any

try:  # CuPy is optional: without it, device arrays are simply not accepted.
    import cupy
except Exception:  # pragma: no cover - depends on the machine
    cupy = None


def _is_torch_tensor(a: object) -> bool:
    return type(a).__module__.startswith("torch") and hasattr(a, "__dlpack__")


def is_device(a: Any) -> bool:
    """True for arrays in GPU memory (CuPy, torch CUDA, anything with
    ``__cuda_array_interface__``)."""
    if isinstance(a, np.ndarray):
        return False
    if _is_torch_tensor(a):
        return bool(a.device.type == "cuda")
    return hasattr(a, "__cuda_array_interface__")


def as_array(a: Any) -> Array:
    """A numpy (host) or CuPy (device) view of ``a`` sharing its memory."""
    if isinstance(a, np.ndarray):
        return a
    if _is_torch_tensor(a):
        a = a.detach()
        if a.device.type == "cpu":
            return np.from_dlpack(a)
        return _cupy().from_dlpack(a)
    if cupy is not None and isinstance(a, cupy.ndarray):
        return a
    if hasattr(a, "__cuda_array_interface__"):
        return _cupy().asarray(a)
    raise TypeError(f"domainpar cannot communicate a {type(a).__module__}.{type(a).__name__}: "
                    "pass a numpy array, a CuPy array or a torch tensor")


def address(arr: Array) -> int:
    """The address of the first element of ``arr`` (an ``as_array`` result)."""
    return int(arr.ctypes.data if isinstance(arr, np.ndarray) else arr.data.ptr)


def namespace(arr: Array) -> ModuleType:
    """numpy or cupy, whichever owns ``arr`` (an ``as_array`` result)."""
    return np if isinstance(arr, np.ndarray) else _cupy()


def synchronize(arr: Array) -> None:
    """Wait until the work producing ``arr`` is done, before MPI touches it.

    Host arrays are always ready. For device arrays, MPI reads memory behind
    the GPU's back, so queued kernels writing ``arr`` must have finished.
    """
    if not isinstance(arr, np.ndarray):
        _cupy().cuda.get_current_stream().synchronize()


def empty(shape: int | tuple[int, ...], dtype: Any, like: Array) -> Array:
    """An uninitialised array of ``shape`` and ``dtype`` where ``like`` lives."""
    return namespace(like).empty(shape, dtype=dtype)


def to_device(host: np.ndarray) -> Array:
    """A copy of the host array ``host`` on this process's current GPU."""
    return _cupy().asarray(host)


def pinned_empty(nbytes: int) -> np.ndarray:
    """A page-locked host byte buffer, for staging device data through MPI."""
    mem = _cupy().cuda.alloc_pinned_memory(max(nbytes, 1))
    return np.frombuffer(mem, dtype=np.uint8, count=nbytes)


def _cupy() -> ModuleType:
    if cupy is None:
        raise TypeError("this array lives on a GPU but CuPy is not installed "
                        "(pip install domainpar[cuda])")
    return cupy  # type: ignore[no-any-return]  # CuPy has no stubs: its module is Any
