"""Dot-product adjoint tests: <F x, y> == <x, F* y> over all ranks.

For a distributed linear operator F and its claimed adjoint F*, the two global
inner products agree to rounding for random x and y exactly when F* is F's
adjoint; a missing or doubled message shows up as an O(1) difference.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI


def global_dot(a, b, comm: MPI.Comm) -> float:
    """Collective. sum over ranks of <a, b> (real part; arrays of equal shape)."""
    local = np.vdot(np.asarray(a).ravel(), np.asarray(b).ravel()).real
    return comm.allreduce(float(local), op=MPI.SUM)


def adjoint_error(fx, y, x, fty, comm: MPI.Comm) -> float:
    """Collective. |<F x, y> - <x, F* y>| relative to the size of the terms."""
    lhs, rhs = global_dot(fx, y, comm), global_dot(x, fty, comm)
    scale = max(abs(lhs), abs(rhs), global_dot(abs(np.asarray(fx)), abs(np.asarray(y)), comm))
    return abs(lhs - rhs) / max(scale, np.finfo(float).tiny)
