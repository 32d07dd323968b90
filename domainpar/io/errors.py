"""DataError, and how io raises it: the same error on every rank.

A file problem is often seen by one rank only (rank 0 inspects the file; a rank
fails to write its part), so every check ends in ``agree`` or ``bcast_outcome``:
every rank learns every problem and raises the same DataError, naming the
ranks concerned.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
from mpi4py import MPI

from ..comm.errors import DomainparError

T = TypeVar("T")


class DataError(DomainparError, OSError):
    """A file or dataset that cannot be read or written as asked: missing,
    not HDF5 (truncated, corrupt), the wrong dtype, an incomplete checkpoint."""


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def agree(comm: MPI.Comm, problem: str | None) -> None:
    """Collective. Raise the same DataError on every rank if any rank has a problem
    (one allreduce of one integer when none has); identical messages are told once."""
    flag = np.array([problem is not None], dtype=np.int32)
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    if not flag[0]:
        return
    told: dict[str, list[int]] = {}
    for rank, story in enumerate(comm.allgather(problem)):
        if story is not None:
            told.setdefault(story, []).append(rank)
    if len(told) == 1 and len(next(iter(told.values()))) == comm.Get_size():
        raise DataError(next(iter(told)))
    raise DataError("; ".join(f"{_ranks(r)}: {p}" for p, r in told.items()))


def bcast_outcome(comm: MPI.Comm, fn: Callable[[], T], root: int = 0) -> T:
    """Collective. ``fn()`` run on ``root`` only; its value on every rank, or its
    error raised on every rank as a DataError (one broadcast)."""
    outcome: tuple[T, None] | tuple[None, str] | None = None
    if comm.Get_rank() == root:
        try:
            outcome = (fn(), None)
        except DataError as exc:
            outcome = (None, str(exc))
        except Exception as exc:  # noqa: BLE001 -- whatever fails on root, the others must hear
            outcome = (None, f"{type(exc).__name__}: {exc}")
    shared: tuple[T, None] | tuple[None, str] | None = \
        comm.bcast(outcome, root=root) if comm.Get_size() > 1 else outcome
    assert shared is not None  # set on root, and on one process this rank is root
    if shared[1] is not None:
        raise DataError(shared[1])
    return shared[0]
