"""Error codes of the C/Fortran API, and the one way a coupling call fails: on
every rank alike, with the same code and message.

The codes are the ``DP_ERR_*`` values of kernels/coupling/domainpar.h and the
Fortran module (tests/test_coupling_python.py checks that the three agree).
A simulation cannot catch a Python exception, and one rank returning an error
while its peers go on into the next collective would hang the job, so every
call ends in ``agree``: one small allreduce when all went well; otherwise every
rank learns every rank's story and all return the same code and message.
"""
from __future__ import annotations

import traceback

import numpy as np
from mpi4py import MPI

from ..comm.errors import DomainparError

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


def agree(comm: MPI.Comm | None, problem: tuple[int, str] | None) -> None:
    """Collective over ``comm`` (local when None). Raise the same CouplingError on
    every rank if any rank has a ``problem`` (code, message).

    The code is that of the lowest failing rank; the message names the failing
    ranks, or says "every rank" once when all failed alike.
    """
    alone = comm is None or comm.Get_size() == 1
    if alone and problem is None:
        return
    if not alone:
        flag = np.array([problem is not None], dtype=np.int32)
        comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
        if not flag[0]:
            return
    # One process words it like many: "every rank: ...", so messages read alike.
    stories = [problem] if alone else comm.allgather(problem)
    failing = [(r, p) for r, p in enumerate(stories) if p is not None]
    code = failing[0][1][0]
    if len(failing) == len(stories) and len({p for _, p in failing}) == 1:
        raise CouplingError(code, f"every rank: {failing[0][1][1]}")
    raise CouplingError(code, "; ".join(f"rank {r}: {msg}" for r, (_, msg) in failing))


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
        if self.problem is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except CouplingError as exc:
            self.problem = (exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001 - any failure becomes an error code
            self.problem = (default, describe(exc))
        return None

    def fail(self, code: int, message: str) -> None:
        if self.problem is None:
            self.problem = (code, message)

    def agree(self) -> None:
        """Collective. Raise on every rank if any rank's steps failed."""
        problem, self.problem = self.problem, None
        agree(self.comm, problem)
