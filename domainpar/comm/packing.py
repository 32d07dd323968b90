"""Pack and unpack strided boxes of arrays to and from contiguous buffers.

The native C kernels (kernels/pack.c, built by CMakeLists.txt into
domainpar/_native/) copy strided halo faces several times faster than numpy;
without them numpy's own copy is used. Device (CuPy) arrays use CuPy's copy
kernels. ``native_library()`` says which was found, for ``domainpar info``.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from . import buffers

_NATIVE_DIR = Path(__file__).resolve().parent.parent / "_native"
_ADD_CODES = {np.dtype(np.float32): b"f", np.dtype(np.float64): b"d",
              np.dtype(np.int32): b"i", np.dtype(np.int64): b"l",
              np.dtype(np.complex64): b"f", np.dtype(np.complex128): b"d"}


def _load_native():
    if os.environ.get("DOMAINPAR_NATIVE", "1") == "0":
        return None, "disabled by DOMAINPAR_NATIVE=0"
    path = _NATIVE_DIR / "libdomainpar_pack.so"
    if not path.exists():
        return None, f"not built ({path} missing: run `make kernels`)"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"failed to load {path}: {exc}"
    i64p = ctypes.POINTER(ctypes.c_int64)
    for name, last in (("dp_pack", ctypes.c_void_p), ("dp_unpack", ctypes.c_void_p)):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, i64p, i64p, ctypes.c_int64, last]
        fn.restype = ctypes.c_int
    lib.dp_unpack_add.argtypes = [ctypes.c_void_p, ctypes.c_int, i64p, i64p, ctypes.c_char,
                                  ctypes.c_void_p]
    lib.dp_unpack_add.restype = ctypes.c_int
    return lib, str(path)


_LIB, _LIB_WHERE = _load_native()


def native_library() -> tuple[bool, str]:
    """(found, where or why not) for the C pack kernels."""
    return _LIB is not None, _LIB_WHERE


def _merged_layout(view: np.ndarray) -> tuple[list[int], list[int]]:
    """Shape and byte strides of ``view`` with adjacent dims merged wherever the
    outer one steps exactly over the inner one, so rows are as long as possible."""
    shape, strides = [], []
    for n, s in zip(view.shape, view.strides):
        if n == 1:
            continue
        if shape and strides[-1] == n * s:
            shape[-1] *= n
            strides[-1] = s
        else:
            shape.append(n)
            strides.append(s)
    return shape or [1], strides or [view.itemsize]


def _c_args(view: np.ndarray, shape, strides):
    ndim = len(shape)
    return (view.ctypes.data, ndim, (ctypes.c_int64 * ndim)(*shape),
            (ctypes.c_int64 * ndim)(*strides))


def pack(view, buf) -> None:
    """Copy the (possibly strided) array ``view`` into the contiguous ``buf``
    (any dtype, ``view.nbytes`` long)."""
    if isinstance(view, np.ndarray) and _LIB is not None and view.size:
        shape, strides = _merged_layout(view)
        _LIB.dp_pack(*_c_args(view, shape, strides), view.itemsize, buf.ctypes.data)
        return
    xp = buffers.namespace(view)
    xp.copyto(buf.view(view.dtype).reshape(view.shape), view)


def unpack(view, buf, add: bool = False) -> None:
    """Copy (or with ``add``, add) the contiguous ``buf`` into the array ``view``."""
    if isinstance(view, np.ndarray) and _LIB is not None and view.size:
        shape, strides = _merged_layout(view)
        if not add:
            _LIB.dp_unpack(*_c_args(view, shape, strides), view.itemsize, buf.ctypes.data)
            return
        code = _ADD_CODES.get(view.dtype)
        if code is not None:
            if view.dtype.kind == "c":  # a complex number is two reals side by side
                shape, strides = shape + [2], strides + [view.itemsize // 2]
            _LIB.dp_unpack_add(*_c_args(view, shape, strides), code, buf.ctypes.data)
            return
    src = buf.view(view.dtype).reshape(view.shape)
    if add:
        view += src
    else:
        buffers.namespace(view).copyto(view, src)
