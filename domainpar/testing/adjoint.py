"""Dot-product adjoint tests: <F x, y> == <x, F* y> over all ranks.

For a distributed linear operator F and its claimed adjoint F*, the two global
inner products agree to rounding for random x and y exactly when F* is F's
adjoint; a missing or doubled message shows up as an O(1) difference.

This is the one implementation: ``oracle.adjoint_test`` (torch, DomainTensors)
turns its tensors into numpy arrays and its spaces into communicators and calls
``adjoint_error``.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

_SAME = object()


def global_dot(a, b, comm: MPI.Comm | None) -> float:
    """Collective over ``comm`` (Local when None: a value every rank holds alike,
    counted once). Sum over ranks of <a, b> (real part; arrays of equal size)."""
    local = float(np.vdot(np.asarray(a).ravel(), np.asarray(b).ravel()).real)
    return local if comm is None else comm.allreduce(local, op=MPI.SUM)


def adjoint_error(fx, y, x, fty, comm: MPI.Comm | None, x_comm=_SAME) -> float:
    """Collective. |<F x, y> - <x, F* y>| relative to the size of the terms.
    ``comm`` sums the inner products of the output space (F x, y), ``x_comm`` those
    of the input space (x, F* y; default ``comm``); None: replicated, counted once."""
    return adjoint_terms(fx, y, x, fty, comm, x_comm)[2]


def adjoint_terms(fx, y, x, fty, comm: MPI.Comm | None, x_comm=_SAME) -> tuple:
    """Collective. (<F x, y>, <x, F* y>, their relative difference): ``adjoint_error``
    with the two inner products it compares, for a failure message."""
    x_comm = comm if x_comm is _SAME else x_comm
    lhs, rhs = global_dot(fx, y, comm), global_dot(x, fty, x_comm)
    scale = max(abs(lhs), abs(rhs), global_dot(abs(np.asarray(fx)), abs(np.asarray(y)), comm))
    return lhs, rhs, abs(lhs - rhs) / max(scale, np.finfo(float).tiny)
