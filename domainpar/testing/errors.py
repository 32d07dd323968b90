"""Checking that an error is raised on every rank alike (no torch needed)."""
from __future__ import annotations

import re
from collections.abc import Sequence

from mpi4py import MPI


def raises_on_every_rank(error, match: str | Sequence[str], fn, comm=None, *,
                         exact: bool = False) -> str:
    """Collective over ``comm`` (default COMM_WORLD). Assert that ``fn()`` raises
    the same error, with the same message, on every rank.

    Every rank's outcome is gathered first, so a rank that alone did not raise (or
    raised something else) fails the check on every rank instead of leaving the
    others waiting.

    Parameters
    ----------
    error : type or tuple of types
        The exception expected (an instance of it, or exactly it with ``exact``).
    match : str or sequence of str
        A regular expression the message must match, or strings that must each
        occur in it verbatim.
    fn : callable
        Called with no arguments on every rank.
    comm : mpi4py.MPI.Comm, optional
        The ranks; COMM_WORLD by default.
    exact : bool, default False
        Require exactly the type ``error`` (not a subclass).

    Returns
    -------
    str
        The message.

    Raises
    ------
    AssertionError
        On every rank, when any rank did not raise as expected.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    outcomes = comm.allgather(_outcome(error, fn, exact))
    kinds = {kind for kind, _ in outcomes}
    assert len(kinds) == 1 and not next(iter(kinds)).startswith(("no error", "not ")), outcomes
    assert len(set(outcomes)) == 1, f"messages differ between ranks: {outcomes}"
    message = outcomes[0][1]
    if isinstance(match, str):
        assert re.search(match, message), f"{match!r} does not match {message!r}"
    else:
        missing = [w for w in match if w not in message]
        assert not missing, f"{missing} not in {message!r}"
    return message


def _outcome(error, fn, exact: bool) -> tuple[str, str]:
    """Local. (the kind of what ``fn()`` raised, its message)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (compared on every rank by the caller)
        ok = type(exc) in _types(error) if exact else isinstance(exc, error)
        name = type(exc).__name__
        return (name if ok else f"not {_names(error)}: {name}"), str(exc)
    return "no error", ""


def _types(error) -> tuple:
    return error if isinstance(error, tuple) else (error,)


def _names(error) -> str:
    return " or ".join(t.__name__ for t in _types(error))


def check_on_every_rank(ok: bool, what="", comm=None) -> None:
    """Collective over ``comm`` (default COMM_WORLD). Assert ``ok`` on every rank:
    a check that failed on any rank fails on every rank, so no rank goes on alone
    into the next collective.

    Parameters
    ----------
    ok : bool
        This rank's verdict.
    what : str, default ''
        What this rank reports when its check failed.
    comm : mpi4py.MPI.Comm, optional
        The ranks; COMM_WORLD by default.

    Raises
    ------
    AssertionError
        On every rank, naming the ranks where the check failed and their ``what``.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    stories = comm.allgather(None if ok else f"rank {comm.Get_rank()}: {what}")
    assert not any(stories), [s for s in stories if s]
