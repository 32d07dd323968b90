"""The functions behind libdomainpar's C calls, one per ``dp_*`` function.

Collective over the simulation's grid, like the C calls: every rank calls each
function in the same order. Arguments are plain Python values (integers for
addresses, communicators and handles; tuples; strings), so the C side only
converts them. Each function returns ``(code, message, value)`` and never
raises: the code and message are the same on every rank (``errors.agree``),
and ``value`` is the call's result (a handle, a loss) or None.

Handles are small positive integers (0 is never one, so a Fortran integer left
at zero is recognised as "no handle").
"""
from __future__ import annotations

import functools
import gc

import numpy as np

# The simulation owns MPI (it calls MPI_Init and MPI_Finalize): libdomainpar
# sets mpi4py.rc.initialize and rc.finalize to False before it imports this
# module. Not here: imported into a plain Python process (the tests), mpi4py
# must go on initialising MPI as usual.
from mpi4py import MPI

from ..comm.errors import completes_within, fault_timeout, signature_of
from ..comm.grid import ProcessGrid
from . import errors
from .errors import ARGUMENT, PYTHON, STATE, CouplingError, Stage
from .field import Field
from .model import Model


class _Session:
    def __init__(self, grid: ProcessGrid):
        self.grid = grid
        self.fields: dict[int, Field] = {}
        self.models: dict[int, Model] = {}
        self.next_handle = 1
        self.broken: str | None = None  # set when a peer finalized: calls fail locally

    def add(self, table: dict, obj) -> int:
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        table[handle] = obj
        return handle


_session: _Session | None = None
_finalized = False


def _entry(name: str):
    """Turn a function that raises into one that returns (code, message, value)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args):
            try:
                return errors.OK, "", fn(*args)
            except CouplingError as exc:  # already the same on every rank
                return exc.code, f"{name}: {exc}", None
            except Exception as exc:  # noqa: BLE001 - a bug here must not kill the simulation
                return PYTHON, f"{name}: internal error (on this rank only): {errors.describe(exc)}", None
        return call
    return wrap


def _current() -> _Session:
    """Local (the state is the same on every rank when all call alike)."""
    if _session is None:
        raise CouplingError(STATE, "domainpar is finalized; it cannot start again in this process"
                            if _finalized else "call dp_init first")
    if _session.broken:
        raise CouplingError(STATE, _session.broken)
    return _session


def _begin(name: str, *agreed) -> _Session:
    """Collective (one nonblocking allreduce). The session, once every rank is
    known to be in the same call ``dp_<name>`` with the same ``agreed`` arguments
    (handles): ranks in different calls get the same STATE error, ranks naming
    different handles the same ARGUMENT error, instead of a hang or a silent mix."""
    session = _current()
    _agree_call(session, name, agreed)
    return session


def _agree_call(session: _Session, name: str, agreed: tuple, deadline: bool = False) -> None:
    comm = session.grid.comm
    if comm.Get_size() == 1:
        return
    signature = signature_of(name, agreed)
    flags = np.array([signature, -signature], dtype=np.int64)
    request = comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    if deadline and not completes_within(request, fault_timeout()):
        raise CouplingError(STATE, f"not every rank called dp_{name} within "
                                   f"{fault_timeout():g} s (DOMAINPAR_FAULT_TIMEOUT): "
                                   f"dp_{name} is collective")
    request.Wait()
    if flags[0] == -flags[1]:
        return
    calls = comm.allgather(f"dp_{name}({', '.join(str(a) for a in agreed)})")
    listed = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
    if len({c.split("(")[0] for c in calls}) == 1:
        raise CouplingError(ARGUMENT, f"arguments differ between ranks ({listed})")
    message = (f"ranks are in different calls ({listed}); every rank must make the same dp_* "
               f"calls in the same order")
    if any(c.startswith("dp_finalize(") for c in calls) and name != "finalize":
        # The finalizing ranks are gone: every later call here fails at once.
        session.broken = f"domainpar was finalized on another rank ({listed})"
    raise CouplingError(STATE, message)


def _find(session: _Session, model: int | None = None, fields=()) -> list:
    """Collective. The model and fields these handles name; ARGUMENT on every rank
    if any rank does not know one."""
    stage = Stage(session.grid.comm)
    wanted = ([(session.models, model, "model")] if model is not None else []) + \
        [(session.fields, f, "field") for f in fields]
    found = []
    for table, handle, what in wanted:
        found.append(table.get(handle))
        if found[-1] is None:
            stage.fail(ARGUMENT, f"no {what} with handle {handle} (live {what}s: "
                                 f"{sorted(table) or 'none'})")
    stage.agree()
    return found


@_entry("dp_init")
def init(comm_f: int, dims, periods):
    """Collective over the communicator. Adopt the simulation's grid: its
    communicator's own Cartesian topology (``dims`` None), or a Cartesian
    communicator made here with ``dims`` and ``periods`` and no reordering (so
    coordinates are those MPI_Cart_create gives the simulation with the same
    arguments). Either way domainpar works on a duplicate of it."""
    global _session
    if _session is not None or _finalized:
        raise CouplingError(STATE, "domainpar is already initialised" if _session else
                            "domainpar is finalized; it cannot start again in this process")
    comm = MPI.Comm.f2py(comm_f)
    stage = Stage(comm)
    if comm == MPI.COMM_NULL:
        raise CouplingError(ARGUMENT, "the communicator is MPI_COMM_NULL")
    if dims is None:
        grid = stage.run(ARGUMENT, ProcessGrid.from_comm, comm)
    else:
        grid = stage.run(ARGUMENT, ProcessGrid, tuple(dims),
                         tuple(bool(p) for p in periods) if periods is not None else False,
                         comm)
    stage.agree()
    _session = _Session(grid)
    return None


@_entry("dp_field_create")
def field_create(address, dtype, order, shape, ghost_lo, ghost_hi, axes, offsets, location,
                 local_problem):
    """Collective. Describe an array of the simulation; returns the field's handle."""
    session = _begin("field_create")
    field = Field.create(session.grid, address, dtype, order, shape, ghost_lo, ghost_hi, axes,
                         offsets, location, local_problem)
    return session.add(session.fields, field)


@_entry("dp_field_free")
def field_free(handle):
    """Collective (agrees on the handle). Forget a field; the memory stays the simulation's."""
    session = _begin("field_free", handle)
    _find(session, fields=(handle,))
    del session.fields[handle]


@_entry("dp_halo_fill")
def halo_fill(handle):
    """Collective. Fill the field's ghost cells from their owners."""
    session = _begin("halo_fill", handle)
    (field,) = _find(session, fields=(handle,))
    stage = Stage(session.grid.comm)
    stage.run(errors.SHAPE, field.halo_fill)
    stage.agree()


@_entry("dp_model_load")
def model_load(entry, kwargs_json, options_json, local_problem=None):
    """Collective. Load a model from an entry point; returns its handle."""
    session = _begin("model_load")
    stage = Stage(session.grid.comm)
    if local_problem:
        stage.fail(ARGUMENT, local_problem)
    stage.agree()
    model = Model.load(session.grid, entry, kwargs_json, options_json)
    return session.add(session.models, model)


@_entry("dp_model_free")
def model_free(handle):
    """Collective (agrees on the handle). Drop a model and its optimizer."""
    session = _begin("model_free", handle)
    _find(session, model=handle)
    del session.models[handle]


@_entry("dp_infer")
def infer(model, field_in, field_out):
    """Collective. field_out <- model(field_in)."""
    session = _begin("infer", model, field_in, field_out)
    m, fin, fout = _find(session, model, (field_in, field_out))
    m.infer(fin.tensor, fout)


@_entry("dp_train_step")
def train_step(model, field_in, field_target):
    """Collective. One optimizer step; returns the loss (the same on every rank)."""
    session = _begin("train_step", model, field_in, field_target)
    m, fin, ftarget = _find(session, model, (field_in, field_target))
    return m.train_step(fin.tensor, ftarget.tensor)


@_entry("dp_model_save")
def model_save(model, path):
    """Collective. Rank 0 writes the checkpoint."""
    session = _begin("model_save", model)
    (m,) = _find(session, model)
    m.save(path)


@_entry("dp_model_restore")
def model_restore(model, path):
    """Collective. Every rank loads the checkpoint rank 0 reads."""
    session = _begin("model_restore", model)
    (m,) = _find(session, model)
    m.load_checkpoint(path)


@_entry("dp_finalize")
def finalize():
    """Collective. Drop every field and model while MPI is still up (the
    simulation finalizes MPI afterwards), so that halo plans free their MPI
    requests and datatypes now. The grid's communicators are left to
    MPI_Finalize: domainpar's plan caches may still name them.

    Agreed with a deadline (DOMAINPAR_FAULT_TIMEOUT): ranks that are in another
    call meanwhile get the same error and fail every later call at once; ranks
    that never call are waited for that long. This rank is finalized either way."""
    global _session, _finalized
    if _session is None:
        _current()  # the usual STATE error
    session = _session
    assert session is not None  # else _current() raised
    try:
        if not session.broken:
            _agree_call(session, "finalize", (), deadline=True)
    finally:
        session.fields.clear()
        session.models.clear()
        _session, _finalized = None, True
        gc.collect()
