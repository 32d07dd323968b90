"""The C kernels of domainpar/_native/, loaded with ctypes.

CMakeLists.txt builds them from kernels/ (``make kernels``): the halo pack
kernels (libdomainpar_pack.so, ``comm.packing``) and the sharded group norm's
row passes (libdomainpar_rowwise.so, ``ops.rowwise``). Each module falls back to
numpy or torch where its library is missing, and ``DOMAINPAR_NATIVE=0`` in the
environment at import keeps every library unloaded. ``libraries()`` says what
was found, for ``domainpar info``.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent.parent / "_native"
LIBRARIES = ("libdomainpar_pack.so", "libdomainpar_rowwise.so")


@functools.cache
def load(name: str) -> tuple[ctypes.CDLL | None, str]:
    """Local. The library ``name`` of ``NATIVE_DIR`` (one of ``LIBRARIES``) and
    where it came from, or None and why not. Loaded once; the caller declares
    its functions' argument types."""
    if os.environ.get("DOMAINPAR_NATIVE", "1") == "0":
        return None, "disabled by DOMAINPAR_NATIVE=0"
    path = NATIVE_DIR / name
    if not path.exists():
        return None, f"not built ({path} missing: run `make kernels`)"
    try:
        return ctypes.CDLL(str(path)), str(path)
    except OSError as exc:
        return None, f"failed to load {path}: {exc}"


def libraries() -> str:
    """Local. One line on every library of ``LIBRARIES``: found where, or why not."""
    parts = []
    for name in LIBRARIES:
        lib, where = load(name)
        parts.append(("found: " if lib is not None else "not found: ") + where)
    return "; ".join(parts)
