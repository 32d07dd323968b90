"""Checking that an error is raised on every rank alike (no torch needed)."""
from __future__ import annotations

import re

from mpi4py import MPI


def raises_on_every_rank(error: type[BaseException], match: str, fn, comm=None) -> str:
    """Collective over ``comm`` (default COMM_WORLD). Assert that ``fn()`` raises an
    instance of ``error`` on every rank, of the same type and with the same message
    everywhere, and that the message matches the regular expression ``match``.
    Every rank's outcome is gathered first, so a rank that alone did not raise (or
    raised something else) fails the check on every rank instead of leaving the
    others waiting. Returns the message."""
    comm = MPI.COMM_WORLD if comm is None else comm
    try:
        fn()
        outcome = ("no error", "")
    except Exception as exc:  # noqa: BLE001 (compared below, on every rank)
        kind = type(exc).__name__ if isinstance(exc, error) else f"not {error.__name__}: " \
            f"{type(exc).__name__}"
        outcome = (kind, str(exc))
    outcomes = comm.allgather(outcome)
    kinds = {kind for kind, _ in outcomes}
    assert len(kinds) == 1 and not next(iter(kinds)).startswith(("no error", "not ")), outcomes
    assert len(set(outcomes)) == 1, f"messages differ between ranks: {outcomes}"
    assert re.search(match, outcomes[0][1]), outcomes[0][1]
    return outcomes[0][1]
