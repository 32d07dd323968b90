"""Test-harness settings shared by all tests, and the fixtures that several
test files use (pytest finds them here without an import).

Environment set by tests/run_mpi.py for MPI runs: DOMAINPAR_TEST_NP (the number
of ranks) and DOMAINPAR_TEST_LOG_DIR (where ranks 1..N-1 write their output).
OMP_NUM_THREADS is set by run_mpi.py and the Makefile, not here: it only takes
effect if set before torch is imported.
"""

import os
import shutil
import tempfile
import weakref

import pytest

from domainpar.io import files
from io_cases import COMM, MODES, RANK

UNDER_MPI = "DOMAINPAR_TEST_NP" in os.environ

try:
    from hypothesis import settings
except ImportError:  # hypothesis is a test extra; tests that need it will say so
    settings = None

if settings is not None:
    # Under MPI every rank must draw the same examples in the same order, or
    # the ranks enter different collectives and hang: derandomize, and no
    # example database (ranks would race on it and replay different examples).
    # No deadline in either profile: timings on oversubscribed CI cores are noise.
    settings.register_profile("mpi", derandomize=True, database=None, deadline=None)
    settings.register_profile("serial", deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "mpi" if UNDER_MPI else "serial"))


def pytest_report_header(config):
    if UNDER_MPI:
        n = int(os.environ["DOMAINPAR_TEST_NP"])
        if n == 1:
            return "domainpar: MPI run on 1 rank"
        logs = os.environ.get("DOMAINPAR_TEST_LOG_DIR", "?")
        return f"domainpar: MPI run on {n} ranks; ranks 1..{n - 1} log to {logs}"
    return None


@pytest.fixture(scope="module")
def shared_dir():
    """A directory every rank agrees on (made by rank 0), removed at the end."""
    path = COMM.bcast(tempfile.mkdtemp(prefix="dp-io-") if RANK == 0 else None, root=0)
    yield path
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=MODES)
def mode(request):
    """Each io mode in turn: mpio (when h5py has MPI) and the serial fallback."""
    with files.forced_mode(request.param):
        yield request.param


@pytest.fixture
def conv_tuning(monkeypatch):
    """ops/onednn.py's whole-or-pieces choice for every float32 3-D conv, however
    small (no size floor, pieces one row thin allowed), timed on a fake clock by
    which the way named in ``state["favour"]`` ("pieces", the default, or
    "whole") takes 1 and the other ``state["other"]`` (default 2). Yields
    (state, ran): ``ran`` lists the plan of
    every run (None: whole); ``state["alive"]``, at each run, how many outputs
    of earlier runs were still alive."""
    from domainpar.ops import onednn
    monkeypatch.setattr(onednn, "_TUNE_CELLS", 1)
    monkeypatch.setattr(onednn, "_TUNE_ROWS", 1)
    monkeypatch.setattr(onednn, "_CHOICES", {})
    monkeypatch.setattr(onednn, "_TIMES", {})
    now, ran, state = [0.0], [], {"favour": "pieces", "other": 2.0, "alive": []}
    monkeypatch.setattr(onednn, "_clock", lambda: now[0])
    in_pieces = onednn._in_pieces
    outputs = []

    def spy(*args):
        plan = args[-1]
        ran.append(plan)
        state["alive"].append(sum(o() is not None for o in outputs))  # earlier outputs alive
        favoured = ("whole" if plan is None else "pieces") == state["favour"]
        now[0] += 1.0 if favoured else state["other"]
        out = in_pieces(*args)
        outputs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(onednn, "_in_pieces", spy)
    return state, ran
