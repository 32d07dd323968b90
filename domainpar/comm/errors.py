"""Errors, and the one way domainpar raises them: on every rank alike.

A rank that raises alone leaves its peers blocked in the next collective, so
every check whose outcome may differ between ranks goes through ``agree``:
one small allreduce tells all ranks whether any rank found a problem, and only
then (the rare path) are the messages gathered so that every rank raises the
same error naming the ranks concerned.
"""
from __future__ import annotations

import os
import time
import zlib

import numpy as np
from mpi4py import MPI

from .clock import blocking


class DomainparError(Exception):
    """Base class of every error domainpar raises on purpose."""


class LayoutError(DomainparError, ValueError):
    """A grid, decomposition, halo width or array shape that does not fit."""


class MismatchError(LayoutError):
    """Arguments that must be equal on every rank differ between ranks."""


def signature_of(*values: object) -> int:
    """A stable 31-bit digest of ``values`` for comparing arguments across ranks."""
    return zlib.crc32(repr(values).encode()) & 0x7FFFFFFF


@blocking
def agree(comm: MPI.Comm, problem: str | None, *, signature: int = 0,
          what: str = "arguments", described: object = "") -> None:
    """Collective. Raise the same error on every rank if any rank found a problem.

    ``problem`` is this rank's complaint (None when all is well); ``signature``
    is a digest (``signature_of``) of the values that must be equal on every rank,
    ``described`` their human-readable form (anything ``str`` can show), used
    only in the error message.
    Costs one allreduce of three integers when all is well.
    """
    flags = np.array([problem is not None, signature, -signature], dtype=np.int64)
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    mismatch = flags[1] != -flags[2]
    if not flags[0] and not mismatch:
        return
    # The rare path: every rank learns every rank's story.
    stories = comm.allgather((problem, described))
    problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(stories) if p is not None]
    if problems:
        raise LayoutError("; ".join(problems))
    values = "; ".join(f"rank {r}: {d}" for r, (_, d) in enumerate(stories))
    raise MismatchError(f"{what} differ between ranks ({values})")


def fault_timeout() -> float:
    """Local. Seconds a rank that failed waits for peers that may never come, being
    blocked in communication it will not join (``DOMAINPAR_FAULT_TIMEOUT``,
    default 60; 0 waits forever)."""
    try:
        return float(os.environ.get("DOMAINPAR_FAULT_TIMEOUT", "60"))
    except ValueError:
        return 60.0


@blocking
def completes_within(request: MPI.Request, limit: float) -> bool:
    """Local. Whether the nonblocking ``request`` completed within ``limit``
    seconds (0: waits as long as it takes, in MPI's blocking wait: a poll with
    sleeps would add up to a sleep's length, a scheduler's time slice on a busy
    machine, to every wait)."""
    if limit <= 0:
        request.Wait()
        return True
    start = time.monotonic()
    while not request.Test():
        if limit > 0 and time.monotonic() - start > limit:
            return False
        time.sleep(0.001)
    return True
