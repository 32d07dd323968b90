"""Row passes on the CPU in C (kernels/rowwise.c): the sharded norms'.

Local. A contiguous float32 or float64 CPU tensor is a stack of rows (its trailing
dims); each function here runs one C loop over them:

- ``moments``: each row's mean and M2 = sum (x - mean)^2, in two reads (torch's
  ops: the mean, a difference and a square written out, then their sum);
- ``dots``: each row's sum g and sum g * x, in one read of g and x;
- ``affine``: out = x * a + c (+ g * b) with one (a, c, b) per row, in one pass;

and the group norm's arithmetic on the few numbers per (sample, group) between
those passes, in double (``group_coefs``, ``group_grad_sums``,
``group_grad_coefs``: ``affine.GroupNormRows``).

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
        getattr(lib, f"dp_group_coefs_{s}").argtypes = [i64, p, p, i64, i64, i64,
                                                         ctypes.c_double] + [p] * 6
        getattr(lib, f"dp_group_grad_sums_{s}").argtypes = [i64, i64, i64] + [p] * 5
        getattr(lib, f"dp_group_grad_coefs_{s}").argtypes = [i64, i64, i64, p, p, p, p,
                                                              ctypes.c_double] + [p] * 7
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


def _run(kind: str, dtype: torch.dtype, *args, kind_prefix: str = "row") -> None:
    start = time.perf_counter()
    getattr(_LIB, f"dp_{kind_prefix}_{kind}_{_SUFFIX[dtype]}")(*args)
    _SECONDS[0] += time.perf_counter() - start


def _ptr(t: torch.Tensor | None):
    """A tensor's address for C, or None (NULL)."""
    return None if t is None else t.data_ptr()


def _length(x: torch.Tensor, rows: int) -> int:
    return x.numel() // rows if rows else 0


def moments(x: torch.Tensor, rows: int, mean: torch.Tensor | None = None,
            m2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Local. (mean, M2) of each of the ``rows`` rows of ``x`` (``usable``), as
    float64 tensors of one value per row (zeros for rows of no elements), written
    into ``mean`` and ``m2`` where given (contiguous float64, ``rows`` values)."""
    n = _length(x, rows)
    mean = torch.empty(rows, dtype=torch.float64) if mean is None else mean
    m2 = torch.empty(rows, dtype=torch.float64) if m2 is None else m2
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
    _run("affine", x.dtype, x.data_ptr(), _ptr(g), out.data_ptr(), rows, n, a.data_ptr(),
         c.data_ptr(), _ptr(b))
    return out


def group_coefs(stats: torch.Tensor, counts: torch.Tensor, groups: int, per: int, eps: float,
                w: torch.Tensor | None, b: torch.Tensor | None, dtype: torch.dtype):
    """Local. From ``stats`` (members x 2 x ng float64: each member's rows of
    means and M2 per (sample, group), ng of them) and ``counts`` (float64 cells
    of one group per member; 0 leaves a member out), each group's (mean,
    invstd) over all members (float64, ng each) and each (sample, channel) row's
    forward coefficients (a, c) in ``dtype``: y = x * a + c. ``w`` and ``b``
    (groups * per values of ``dtype``, contiguous) may be None."""
    ng = stats.shape[-1]
    mean = torch.empty(ng, dtype=torch.float64)
    invstd = torch.empty(ng, dtype=torch.float64)
    a = torch.empty(ng * per, dtype=dtype)
    c = torch.empty(ng * per, dtype=dtype)
    _run("coefs", dtype, stats.shape[0], stats.data_ptr(), counts.data_ptr(), ng, groups, per,
         eps, _ptr(w), _ptr(b), mean.data_ptr(), invstd.data_ptr(), a.data_ptr(), c.data_ptr(),
         kind_prefix="group")
    return mean, invstd, a, c


def group_grad_sums(sg: torch.Tensor, sgx: torch.Tensor, mean: torch.Tensor, groups: int,
                    per: int, w: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Local. Per (sample, group), A = sum w g and B = sum w g (x - mean) over this
    block (float64, 2 x ng) from its rows' ``dots`` (``sg``, ``sgx``)."""
    ng = mean.numel()
    ab = torch.empty(2, ng, dtype=torch.float64)
    _run("grad_sums", dtype, ng, groups, per, sg.data_ptr(), sgx.data_ptr(), mean.data_ptr(),
         _ptr(w), ab.data_ptr(), kind_prefix="group")
    return ab


def group_grad_coefs(ab: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, groups: int,
                     per: int, w: torch.Tensor | None, count: float, sg: torch.Tensor,
                     sgx: torch.Tensor, dtype: torch.dtype):
    """Local. From ``ab`` summed over the members (``group_grad_sums``), each row's
    input-gradient coefficients (a, c, b) in ``dtype``, dx = x * a + c + g * b,
    and this block's weight and bias gradients (float64, groups * per each)."""
    ng = mean.numel()
    a, c, b = (torch.empty(ng * per, dtype=dtype) for _ in range(3))
    gw = torch.zeros(groups * per, dtype=torch.float64)
    gb = torch.zeros(groups * per, dtype=torch.float64)
    _run("grad_coefs", dtype, ng, groups, per, ab.data_ptr(), mean.data_ptr(), invstd.data_ptr(),
         _ptr(w), float(count), sg.data_ptr(), sgx.data_ptr(), a.data_ptr(), c.data_ptr(),
         b.data_ptr(), gw.data_ptr(), gb.data_ptr(), kind_prefix="group")
    return a, c, b, gw, gb
