"""Error codes of the C/Fortran API, and the one way a coupling call fails: on
every rank alike, with the same code and message.

The codes are the ``DP_ERR_*`` values of kernels/coupling/domainpar.h and the
Fortran module (tests/test_coupling_python.py checks that the three agree).
A simulation cannot catch a Python exception, and one rank returning an error
while its peers go on into the next collective would hang the job, so every
call ends in ``agree``: one small allreduce when all went well; otherwise every
rank learns every rank's story and all return the same code and message.

Where the others cannot be told (a rank failed while its peers wait in the
model's own communication), the failing rank waits DOMAINPAR_FAULT_TIMEOUT
seconds (default 60) for them, then prints its error and aborts the job
(``wait_or_abort``): a clean end instead of a hang.
"""
from __future__ import annotations

import sys
import traceback

import numpy as np
from mpi4py import MPI

from ..comm.errors import DomainparError, completes_within, fault_timeout, signature_of

OK = 0
ARGUMENT = 1   # a bad argument: null pointer, unknown dtype/order/handle, arguments differing between ranks
SHAPE = 2      # shapes that do not fit: the grid, the blocks across ranks, the model's output
IMPORT = 3     # the model's entry point does not import or does not name a callable
MODEL = 4      # the model (factory, forward, loss, backward, optimizer) raised
IO = 5         # a checkpoint could not be written or read
STATE = 6      # a call out of order: before init, after finalize
PYTHON = 7     # the embedded interpreter could not start, or an internal error

NAMES = {OK: "DP_OK", ARGUMENT: "DP_ERR_ARGUMENT", SHAPE: "DP_ERR_SHAPE",
         IMPORT: "DP_ERR_IMPORT", MODEL: "DP_ERR_MODEL", IO: "DP_ERR_IO",
         STATE: "DP_ERR_STATE", PYTHON: "DP_ERR_PYTHON"}


class CouplingError(DomainparError):
    """A failed coupling call, carrying its ``DP_ERR_*`` code."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def describe(exc: BaseException) -> str:
    """``Type: message (at file:line in function)``, naming the innermost frame:
    a simulation developer reads this in a log, without a Python traceback."""
    text = f"{type(exc).__name__}: {exc}"
    # Frozen importlib frames say nothing to a reader; name the innermost real file.
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<")]
    if frames:
        f = frames[-1]
        text += f" (at {f.filename}:{f.lineno} in {f.name})"
    return text


def wait_or_abort(request: MPI.Request, comm: MPI.Comm, problem: tuple[int, str]) -> None:
    """Local. Wait for ``request`` (this rank's share of an agreement) for at most
    ``fault_timeout()`` seconds; past it, the peers are taken to be blocked in
    communication this rank will never join (a model that raised here before
    its first message, say), where no rank can be told: print the problem and
    abort the job, the one clean end left."""
    limit = fault_timeout()
    if not completes_within(request, limit):
        sys.stderr.write(
            f"domainpar: rank {comm.Get_rank()}: {problem[1]}\ndomainpar: the other ranks "
            f"did not reach the same point within {limit:g} s (DOMAINPAR_FAULT_TIMEOUT): "
            f"they are blocked in communication this rank cannot join, so they cannot be "
            f"told; aborting the job\n")
        sys.stderr.flush()
        comm.Abort(problem[0] or 1)


def agree(comm: MPI.Comm | None, problem: tuple[int, str] | None, *, signature: int = 0,
          described: str = "", timeout: bool = True) -> None:
    """Collective over ``comm`` (local when None). Raise the same CouplingError on
    every rank if any rank has a ``problem`` (code, message), or if the
    ``signature`` (``signature_of``) of what must be equal differs between ranks
    (ARGUMENT, each rank's ``described`` named).

    The code is that of the lowest failing rank; the message names the failing
    ranks, or says "every rank" once when all failed alike. The flag travels by a
    nonblocking allreduce (every agreement matches every other, whichever call
    a rank is in); a rank with a problem waits for the others at most
    ``fault_timeout()`` seconds, then aborts the job (``wait_or_abort``) unless
    ``timeout`` is False.
    """
    alone = comm is None or comm.Get_size() == 1
    if alone and problem is None:
        return
    if comm is not None and not alone:
        flags = np.array([problem is not None, signature, -signature], dtype=np.int64)
        request = comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
        if problem is not None and timeout:
            wait_or_abort(request, comm, problem)
        request.Wait()
        if not flags[0] and flags[1] == -flags[2]:
            return
    # One process words it like many: "every rank: ...", so messages read alike.
    stories = [(problem, described)] if alone or comm is None \
        else comm.allgather((problem, described))
    failing = [(r, p) for r, (p, _) in enumerate(stories) if p is not None]
    if not failing:
        listed = "; ".join(f"rank {r}: {d}" for r, (_, d) in enumerate(stories))
        raise CouplingError(ARGUMENT, f"arguments differ between ranks ({listed})")
    code = failing[0][1][0]
    if len(failing) == len(stories) and len({p for _, p in failing}) == 1:
        raise CouplingError(code, f"every rank: {failing[0][1][1]}")
    raise CouplingError(code, "; ".join(f"rank {r}: {msg}" for r, (_, msg) in failing))


def agree_equal(comm: MPI.Comm, values, what: str) -> None:
    """Collective. ARGUMENT on every rank if ``values`` differ between ranks."""
    try:
        agree(comm, None, signature=signature_of(values), described=repr(values))
    except CouplingError as exc:
        raise CouplingError(ARGUMENT, f"{what} {exc}") from None


class Stage:
    """Runs local steps that may fail and remembers the first failure, so that a
    call can check all ranks together (``Stage.agree``) before its next collective.
    ``default`` is the code for any other exception of the step (a LayoutError
    from domainpar while wrapping a field is a SHAPE problem, the same error
    from inside a model a MODEL one)."""

    def __init__(self, comm: MPI.Comm | None):
        self.comm = comm
        self.problem: tuple[int, str] | None = None

    def run(self, default: int, fn, *args, **kwargs):
        """Local. ``fn(*args, **kwargs)``, unless an earlier step failed; a failure is
        remembered (its code, or ``default`` for an exception that is not a
        CouplingError) and gives None."""
        if self.problem is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except CouplingError as exc:
            self.problem = (exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001 - any failure becomes an error code
            # An error saying only "another rank failed" (DomainParallel's
            # PeerForwardError) is no story of this rank: that rank tells its own.
            if not getattr(exc, "elsewhere", False):
                self.problem = (default, describe(exc))
        return None

    def fail(self, code: int, message: str) -> None:
        """Local. Remember a failure with ``code`` and ``message`` (the first one wins)."""
        if self.problem is None:
            self.problem = (code, message)

    def agree(self) -> None:
        """Collective. Raise on every rank if any rank's steps failed."""
        problem, self.problem = self.problem, None
        agree(self.comm, problem)
