"""Pack and unpack strided boxes of arrays to and from contiguous buffers.

Host arrays: the C kernels (kernels/pack.c, loaded by ``comm.native``) copy
faces made of short rows 3-10x faster than numpy; numpy keeps single-element
rows, where it is a little faster, and everything when the kernels are not
built.
Device arrays: the CUDA kernels (kernels/pack.cu), compiled at run time by
NVRTC through CuPy; CuPy's own copy if they fail to compile.
``native_library()`` says what was found (``domainpar info`` asks ``comm.native``).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from . import buffers, native

_NATIVE_DIR = native.NATIVE_DIR
_CUDA_SOURCE = Path(__file__).resolve().parent.parent.parent / "kernels" / "pack.cu"
_CUDA_MAX_DIMS = 8  # DP_MAX_DIMS in pack.cu
_ADD_CODES = {np.dtype(np.float32): b"f", np.dtype(np.float64): b"d",
              np.dtype(np.int32): b"i", np.dtype(np.int64): b"l",
              np.dtype(np.complex64): b"f", np.dtype(np.complex128): b"d"}


def _load_native() -> tuple[ctypes.CDLL | None, str]:
    lib, where = native.load("libdomainpar_pack.so")
    if lib is None:
        return None, where
    i64p = ctypes.POINTER(ctypes.c_int64)
    for name, last in (("dp_pack", ctypes.c_void_p), ("dp_unpack", ctypes.c_void_p)):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, i64p, i64p, ctypes.c_int64, last]
        fn.restype = ctypes.c_int
    lib.dp_unpack_add.argtypes = [ctypes.c_void_p, ctypes.c_int, i64p, i64p, ctypes.c_char,
                                  ctypes.c_void_p]
    lib.dp_unpack_add.restype = ctypes.c_int
    return lib, where


_LIB, _LIB_WHERE = _load_native()
# The benchmark flips this to time numpy's copy against the C kernels in one run.
use_native = True


def native_library() -> tuple[bool, str]:
    """(found, where or why not) for the C pack kernels."""
    return _LIB is not None, _LIB_WHERE


def cuda_kernels() -> str:
    """Where the CUDA pack kernels would come from (nothing is compiled here)."""
    fatbin = _NATIVE_DIR / "pack.fatbin"
    if fatbin.exists():
        return f"prebuilt: {fatbin}"
    if _CUDA_SOURCE.exists():
        return f"source for NVRTC: {_CUDA_SOURCE}"
    return "missing (neither pack.fatbin nor kernels/pack.cu found); CuPy's copy is used"


def _merged_layout(view: np.ndarray) -> tuple[list[int], list[int]]:
    """Shape and byte strides of ``view`` with adjacent dims merged wherever the
    outer one steps exactly over the inner one, so rows are as long as possible."""
    shape: list[int] = []
    strides: list[int] = []
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


def _c_args(view: np.ndarray, shape: list[int],
            strides: list[int]) -> tuple[int, int, ctypes.Array[ctypes.c_int64],
                                         ctypes.Array[ctypes.c_int64]]:
    ndim = len(shape)
    return (view.ctypes.data, ndim, (ctypes.c_int64 * ndim)(*shape),
            (ctypes.c_int64 * ndim)(*strides))


def _c_layout(view: buffers.Array) -> tuple[list[int], list[int]] | None:
    """Merged (shape, strides) of ``view`` when the C kernels should copy it,
    else None. They take host arrays whose rows hold several elements; on
    single-element rows numpy's own loop measured 5-15% faster (`domainpar
    bench halo`, C pack against numpy), so numpy keeps those."""
    if not (isinstance(view, np.ndarray) and _LIB is not None and use_native and view.size):
        return None
    shape, strides = _merged_layout(view)
    if strides[-1] != view.itemsize and view.size > 1:
        return None
    return shape, strides


def pack(view: buffers.Array, buf: buffers.Array) -> None:
    """Copy the (possibly strided) array ``view`` into the contiguous ``buf``
    (any dtype, ``view.nbytes`` long)."""
    layout = _c_layout(view)
    if layout is not None:
        assert _LIB is not None  # _c_layout gives a layout only when the kernels loaded
        _LIB.dp_pack(*_c_args(view, *layout), view.itemsize, buf.ctypes.data)
        return
    if not isinstance(view, np.ndarray) and _cuda_copy(view, buf, "pack"):
        return
    xp = buffers.namespace(view)
    xp.copyto(buf.view(view.dtype).reshape(view.shape), view)


def unpack(view: buffers.Array, buf: buffers.Array, add: bool = False) -> None:
    """Copy (or with ``add``, add) the contiguous ``buf`` into the array ``view``."""
    layout = _c_layout(view)
    if layout is not None:
        assert _LIB is not None  # _c_layout gives a layout only when the kernels loaded
        shape, strides = layout
        if not add:
            _LIB.dp_unpack(*_c_args(view, shape, strides), view.itemsize, buf.ctypes.data)
            return
        code = _ADD_CODES.get(view.dtype)
        if code is not None:
            if view.dtype.kind == "c":  # a complex number is two reals side by side
                shape, strides = shape + [2], strides + [view.itemsize // 2]
            _LIB.dp_unpack_add(*_c_args(view, shape, strides), code, buf.ctypes.data)
            return
    elif not isinstance(view, np.ndarray) and _cuda_copy(view, buf,
                                                         "unpack_add" if add else "unpack"):
        return
    src = buf.view(view.dtype).reshape(view.shape)
    if add:
        view += src
    else:
        buffers.namespace(view).copyto(view, src)


# -- device arrays --------------------------------------------------------------------------
_CUDA_ITEM_SIZES = (1, 2, 4, 8, 16)  # element sizes with a dp_pack_<n> / dp_unpack_<n> kernel
_cuda_state: dict[str, Any] = {}


def cuda_kernel_names() -> set[str]:
    """Local. Every kernel name ``_cuda_copy`` may look up in kernels/pack.cu's
    module (the build tests check that the compiled module has each of them)."""
    copies = {f"dp_{what}_{item}" for what in ("pack", "unpack") for item in _CUDA_ITEM_SIZES}
    return copies | {f"dp_unpack_add_{code.decode()}" for code in set(_ADD_CODES.values())}


def _cuda_module() -> Any:
    """kernels/pack.cu, built ahead by CMake (domainpar/_native/pack.fatbin) or
    compiled here by NVRTC, once per process; None if neither works."""
    if "module" not in _cuda_state:
        fatbin = _NATIVE_DIR / "pack.fatbin"
        try:
            import cupy
            if fatbin.exists():
                _cuda_state["module"] = cupy.RawModule(path=str(fatbin))
                _cuda_state["why"] = f"loaded {fatbin}"
            else:
                _cuda_state["module"] = cupy.RawModule(code=_CUDA_SOURCE.read_text())
                _cuda_state["why"] = f"compiled {_CUDA_SOURCE} with NVRTC"
        except Exception as exc:  # no CuPy, no NVRTC, or no source: CuPy's copy serves
            _cuda_state["module"] = None
            _cuda_state["why"] = f"CUDA kernels unavailable ({type(exc).__name__}: {exc})"
    return _cuda_state["module"]


def _cuda_copy(view: buffers.Array, buf: buffers.Array, what: str) -> bool:
    """Run a kernels/pack.cu kernel for a CuPy ``view``; False when none fits."""
    module = _cuda_module()
    if module is None or view.size == 0:
        return False
    shape, strides = _merged_layout(view)
    item = view.itemsize
    if what == "unpack_add":
        code = _ADD_CODES.get(view.dtype)
        if code is None:
            return False
        if view.dtype.kind == "c":
            shape, strides = shape + [2], strides + [item // 2]
            item //= 2
        name = f"dp_unpack_add_{code.decode()}"
    elif item in _CUDA_ITEM_SIZES:
        name = f"dp_{what}_{item}"
    else:
        return False
    if len(shape) > _CUDA_MAX_DIMS:
        return False
    import cupy
    layout = np.zeros(1 + 2 * _CUDA_MAX_DIMS, np.int64)
    layout[0] = len(shape)
    layout[1:1 + len(shape)] = shape
    layout[1 + _CUDA_MAX_DIMS:1 + _CUDA_MAX_DIMS + len(shape)] = strides
    n = int(np.prod(shape))
    threads = 256
    blocks = min((n + threads - 1) // threads, 65535)
    module.get_function(name)((blocks,), (threads,),
                              (view.data.ptr, buf.data.ptr, cupy.asarray(layout), np.int64(n)))
    return True
