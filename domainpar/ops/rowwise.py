"""Row passes on the CPU in C (kernels/rowwise.c): the sharded norms'.

Local. A contiguous float32 or float64 CPU tensor is a stack of rows (its trailing
dims); each function here runs one C loop over them:

- ``moments``: each row's mean and M2 = sum (x - mean)^2, in two reads (torch's
  ops: the mean, a difference and a square written out, then their sum);
- ``dots``: each row's sum g and sum g * x, in one read of g and x;
- ``affine``: out = x * a + c (+ g * b) with one (a, c, b) per row, in one pass.

Sums are accumulated in double (kernels/rowwise.c): as exact as torch's cascaded
sums or more. ``usable`` says where they apply: the library loaded (``comm.native``;
not under ``DOMAINPAR_NATIVE=0``), ``use_native`` set, CPU tensors of one
float type, contiguous, and torch on one thread (the loops run on one; with
more, torch's ops run in parallel). Elsewhere the callers run torch's ops, which
``tests/test_rowwise.py`` compares against these.
"""
from __future__ import annotations

import ctypes
import time

import torch

from ..comm import native

_SUFFIX = {torch.float32: "f", torch.float64: "d"}


def _load():
    lib, _ = native.load("libdomainpar_rowwise.so")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for s in _SUFFIX.values():
        getattr(lib, f"dp_row_moments_{s}").argtypes = [p, i64, i64, p, p]
        getattr(lib, f"dp_row_dots_{s}").argtypes = [p, p, i64, i64, p, p]
        getattr(lib, f"dp_row_affine_{s}").argtypes = [p, p, p, i64, i64, p, p, p]
    return lib


_LIB = _load()
# Benchmarks and tests flip this to run torch's ops instead.
use_native = True


def set_native(on: bool) -> None:
    """Local. Run the C loops where they apply (True) or torch's ops everywhere."""
    global use_native
    use_native = on


def usable(*tensors: torch.Tensor) -> bool:
    """Local. Whether the C loops take these tensors (module docstring)."""
    if _LIB is None or not use_native or torch.get_num_threads() != 1:
        return False
    dtype = tensors[0].dtype
    return dtype in _SUFFIX and all(t.dtype == dtype and t.device.type == "cpu"
                                    and t.is_contiguous() for t in tensors)


_SECONDS = [0.0]  # time inside the C loops so far


def seconds() -> float:
    """Local. The time this process has spent inside the C loops: local work
    that no torch call shows, for benchmarks that split a step into parts
    (``bench step`` counts it as compute, not as domainpar's Python)."""
    return _SECONDS[0]


def _run(kind: str, dtype: torch.dtype, *args) -> None:
    start = time.perf_counter()
    getattr(_LIB, f"dp_row_{kind}_{_SUFFIX[dtype]}")(*args)
    _SECONDS[0] += time.perf_counter() - start


def _length(x: torch.Tensor, rows: int) -> int:
    return x.numel() // rows if rows else 0


def moments(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local. (mean, M2) of each of the ``rows`` rows of ``x`` (``usable``), as
    float64 tensors of one value per row (zeros for rows of no elements)."""
    n = _length(x, rows)
    mean = torch.empty(rows, dtype=torch.float64)
    m2 = torch.empty(rows, dtype=torch.float64)
    _run("moments", x.dtype, x.data_ptr(), rows, n, mean.data_ptr(), m2.data_ptr())
    return mean, m2


def dots(g: torch.Tensor, x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local. (sum g, sum g * x) of each of the ``rows`` rows of ``g`` and ``x``
    (``usable``, one shape), as float64 tensors of one value per row."""
    n = _length(x, rows)
    sum_g = torch.empty(rows, dtype=torch.float64)
    sum_gx = torch.empty(rows, dtype=torch.float64)
    _run("dots", x.dtype, g.data_ptr(), x.data_ptr(), rows, n, sum_g.data_ptr(),
         sum_gx.data_ptr())
    return sum_g, sum_gx


def affine(x: torch.Tensor, a: torch.Tensor, c: torch.Tensor, out: torch.Tensor,
           g: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
    """Local. ``out`` = x * a + c (+ g * b) row by row: ``a``, ``c`` and ``b`` hold
    one value per row of ``x`` (any shape of that many elements; cast to x's type
    here), ``out`` and ``g`` are shaped like ``x``; all ``usable``. ``out`` may be
    ``x`` or ``g``. Returns ``out``."""
    rows = a.numel()
    n = _length(x, rows)
    a, c = (t.to(x.dtype).contiguous() for t in (a, c))
    b = None if b is None else b.to(x.dtype).contiguous()
    _run("affine", x.dtype, x.data_ptr(), None if g is None else g.data_ptr(), out.data_ptr(),
         rows, n, a.data_ptr(), c.data_ptr(), None if b is None else b.data_ptr())
    return out
