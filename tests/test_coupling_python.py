"""domainpar.coupling, the Python side of libdomainpar, driven from Python with
numpy arrays standing in for a simulation's memory (addresses as integers, as
the C library passes them). On every rank count: fields are views (no copy) in
C and Fortran order with uneven ghosts and components; halo_fill equals a
reference built from the global array; outputs land in the owned cells only;
online training equals plain torch on the gathered field; a problem found on
one rank becomes the same error code and message on every rank.
"""
import os
import tempfile

import numpy as np
import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.comm import balanced_sizes
from domainpar.coupling import api, errors, memory
from domainpar.coupling.field import Field

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
SIZE, RANK = COMM.Get_size(), COMM.Get_rank()
GLOBAL = (7, 5)          # uneven blocks on 2, 3 and 4 ranks
LO, HI = (1, 2), (2, 1)  # ghost widths per dim, different per side
SURROGATE = os.path.join(os.path.dirname(__file__), "..", "examples", "coupling",
                         "heat_surrogate.py") + ":make_surrogate"


def grid_of(periodic):
    return dp.ProcessGrid(MPI.Compute_dims(SIZE, 2), periodic=periodic)


def global_field(components):
    """The global field (C, X, Y) with values naming their cell."""
    c, x, y = np.meshgrid(np.arange(components), np.arange(GLOBAL[0]), np.arange(GLOBAL[1]),
                          indexing="ij")
    return (1000.0 * c + 10.0 * x + y).astype(np.float64)


def block_of(grid):
    """This rank's (offsets, sizes) along x and y: domainpar's balanced blocks."""
    out = []
    for axis, n in enumerate(GLOBAL):
        sizes = balanced_sizes(n, grid.dims[axis])
        c = grid.coords[axis]
        out.append((sum(sizes[:c]), sizes[c]))
    return out


def padded_array(grid, order, components, fill=np.nan):
    """The simulation's array: owned cells from the global field, ghosts ``fill``.
    Returns (array in the simulation's index order, its description)."""
    (x0, nx), (y0, ny) = block_of(grid)
    g = global_field(components)[:, x0:x0 + nx, y0:y0 + ny]
    if order == "F":  # u(x, y, c), component dim last: the default axes
        owned, axes = np.moveaxis(g, 0, -1), None
        lo, hi, shape = LO + (0,), HI + (0,), (nx, ny, components)
    else:  # u[c][x][y], component dim first
        owned, axes = g, (-1, 0, 1)
        lo, hi, shape = (0,) + LO, (0,) + HI, (components, nx, ny)
    if components == 1:  # no component dim at all
        owned = owned[..., 0] if order == "F" else owned[0]
        lo, hi = LO, HI
        shape, axes = (nx, ny), None
    extents = tuple(b + n + h for b, n, h in zip(lo, shape, hi))
    a = np.full(extents, fill, order=order)
    a[tuple(slice(b, b + n) for b, n in zip(lo, shape))] = owned
    return a, dict(shape=shape, ghost_lo=lo, ghost_hi=hi, axes=axes)


def make_field(grid, a, desc, order):
    return Field.create(grid, a.ctypes.data, 2, memory.ORDER_F if order == "F" else
                        memory.ORDER_C, desc["shape"], desc["ghost_lo"], desc["ghost_hi"],
                        desc["axes"])


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("components", [1, 2])
def test_field_is_a_view_of_the_simulation_memory(order, components):
    grid = grid_of(periodic=True)
    a, desc = padded_array(grid, order, components)
    field = make_field(grid, a, desc, order)
    t = field.tensor
    assert tuple(t.shape) == (1, components) + GLOBAL
    torch.testing.assert_close(t.full_tensor()[0], torch.from_numpy(global_field(components)),
                               rtol=0, atol=0)
    local = t.to_local()
    if local.numel():
        assert a.ctypes.data <= local.data_ptr() < a.ctypes.data + a.nbytes, \
            "the block is not in the simulation's memory"
        # A write through the simulation's array is what the model reads next.
        a[tuple(desc["ghost_lo"])] = -7.0  # the first owned cell, component 0
        assert float(local[0, 0, 0, 0]) == -7.0


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("periodic", [True, False])
def test_halo_fill_matches_the_global_array(order, periodic):
    grid = grid_of(periodic)
    a, desc = padded_array(grid, order, 1)
    make_field(grid, a, desc, order).halo_fill()
    (x0, nx), (y0, ny) = block_of(grid)
    g = global_field(1)[0]
    want = np.full_like(a, np.nan)
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            x, y = x0 + i - LO[0], y0 + j - LO[1]
            if periodic:
                want[i, j] = g[x % GLOBAL[0], y % GLOBAL[1]]
            elif 0 <= x < GLOBAL[0] and 0 <= y < GLOBAL[1]:
                want[i, j] = g[x, y]  # ghosts outside a non-periodic domain stay as they were
    np.testing.assert_array_equal(a, want)


def test_write_fills_owned_cells_from_any_layout():
    grid = grid_of(periodic=True)
    src, desc = padded_array(grid, "C", 1)
    out, _ = padded_array(grid, "F", 1, fill=-1.0)
    out[...] = -1.0
    field_out = make_field(grid, out, desc, "F")
    y = make_field(grid, src, desc, "C").tensor
    # The same global tensor, laid out otherwise (everything on grid coordinate 0):
    other = y.redistribute(y.decomposition.shard,
                           {d: [GLOBAL[d - 2]] + [0] * (grid.dims[a] - 1)
                            for d, a in y.decomposition.shard.items()})
    field_out.write(other * 2)
    (x0, nx), (y0, ny) = block_of(grid)
    owned = (slice(LO[0], LO[0] + nx), slice(LO[1], LO[1] + ny))
    np.testing.assert_array_equal(out[owned], 2 * global_field(1)[0, x0:x0 + nx, y0:y0 + ny])
    ghosts = np.ones(out.shape, bool)
    ghosts[owned] = False
    assert (out[ghosts] == -1.0).all(), "a ghost cell was written"


@pytest.fixture(scope="module")
def session():
    """One api session for this module (dp_init runs once per process)."""
    cart = COMM.Create_cart(MPI.Compute_dims(SIZE, 2), periods=[True, True])
    code, message, _ = api.init(cart.py2f(), None, None)
    assert code == 0, message
    return cart


def _field(a, shape, ghosts=(1, 1)):
    code, message, handle = api.field_create(a.ctypes.data, 2, 0, shape, ghosts, ghosts, None,
                                             None, 0, None)
    assert code == 0, message
    return handle


def load_surrogate_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("heat_surrogate_ref", SURROGATE.split(":")[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_and_compare(session, entry, kwargs, options, reference):
    """Three train steps through the api, then inference: the same losses and
    output as ``reference`` (a plain module, the model's twin) trained with the
    same Adam in one process on the gathered fields, fp64."""
    grid = dp.ProcessGrid.from_comm(session)
    (x0, nx), (y0, ny) = block_of(grid)
    rng = np.random.default_rng(5)
    gu, gt = rng.standard_normal(GLOBAL), rng.standard_normal(GLOBAL)
    u = np.zeros((nx + 2, ny + 2))
    t = np.zeros((nx + 2, ny + 2))
    p = np.zeros((nx, ny))
    u[1:-1, 1:-1], t[1:-1, 1:-1] = gu[x0:x0 + nx, y0:y0 + ny], gt[x0:x0 + nx, y0:y0 + ny]
    fu, ft = _field(u, (nx, ny)), _field(t, (nx, ny))
    fp = _field(p, (nx, ny), ghosts=(0, 0))
    code, message, model = api.model_load(entry, kwargs, options)
    assert code == 0, message
    losses = []
    for _ in range(3):
        code, message, loss = api.train_step(model, fu, ft)
        assert code == 0, message
        losses.append(loss)
    code, message, _ = api.infer(model, fu, fp)
    assert code == 0, message

    opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    x, target = torch.from_numpy(gu)[None, None], torch.from_numpy(gt)[None, None]
    for want in losses:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(reference(x), target)
        loss.backward()
        opt.step()
        assert abs(loss.item() - want) <= 1e-10 * abs(want), (loss.item(), want)
    with torch.no_grad():
        out = reference(x)[0, 0].numpy()
    np.testing.assert_allclose(p, out[x0:x0 + nx, y0:y0 + ny], rtol=0, atol=1e-10)
    for h in (fu, ft, fp):
        assert api.field_free(h)[0] == 0
    assert api.model_free(model)[0] == 0


OPTIONS = '{"optimizer": {"name": "adam", "lr": 0.05}, "dtype": "float64"}'


def test_online_training_equals_one_process(session):
    torch.manual_seed(0)  # the library seeds the same before calling the factory
    reference = load_surrogate_module().make_surrogate(channels=3).double()
    train_and_compare(session, SURROGATE, '{"channels": 3}', OPTIONS, reference)


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")  # TorchScript's, not ours
def test_torchscript_model_runs_block_by_block(session):
    """A traced surrogate (3x3 circular convs: receptive radius 1) loaded from a
    file runs per block with a halo of 1 and trains like one process."""
    torch.manual_seed(3)
    traced = torch.jit.trace(load_surrogate_module().make_surrogate(channels=3),
                             torch.zeros(1, 1, 6, 6))
    directory = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None, root=0)
    path = os.path.join(directory, "surrogate.pt")
    if RANK == 0:
        traced.save(path)
    COMM.Barrier()
    reference = torch.jit.load(path).double()
    train_and_compare(session, path, None, OPTIONS[:-1] + ', "halo": 1}', reference)
    for options, code, words in (
            (OPTIONS, errors.ARGUMENT, 'needs the option "halo"'),
            ('{"halo": 1}', None, None)):
        got, message, model = api.model_load(path, None, options)
        if code is None:
            assert got == 0, message
            api.model_free(model)
        else:
            assert got == code and words in message, message
    got, message, _ = api.model_load(os.path.join(directory, "missing.pt"), None, '{"halo": 1}')
    assert got == errors.IMPORT and "does not load" in message, message


def test_one_rank_problem_is_every_rank_error(session):
    grid = dp.ProcessGrid.from_comm(session)
    (_, nx), (_, ny) = block_of(grid)
    u = np.zeros((nx + 2, ny + 2))
    culprit = SIZE - 1
    code, message, handle = api.field_create(0 if RANK == culprit else u.ctypes.data, 2, 0,
                                             (nx, ny), (1, 1), (1, 1), None, None, 0, None)
    stories = COMM.allgather((code, message, handle))
    assert all(s == stories[0] for s in stories), stories
    assert code == errors.ARGUMENT and handle is None
    who = "every rank" if SIZE == 1 else f"rank {culprit}"
    assert f"{who}: null pointer" in message, message
    fu = _field(u, (nx, ny))
    code, message, model = api.model_load(SURROGATE, f'{{"raise_on_ranks": [{culprit}]}}',
                                          '{"dtype": "float64", "optimizer": "sgd"}')
    assert code == 0, message
    for call in (lambda: api.infer(model, fu, fu), lambda: api.train_step(model, fu, fu)):
        code, message, _ = call()
        stories = COMM.allgather((code, message))
        assert all(s == stories[0] for s in stories), stories
        assert code == errors.MODEL and f"{who}: RuntimeError" in message, message
    # Afterwards the session still works.
    assert api.halo_fill(fu)[0] == 0
    api.model_free(model)
    api.field_free(fu)


def test_checkpoint_round_trip(session):
    code, message, model = api.model_load(SURROGATE, '{"channels": 2}',
                                          '{"optimizer": "adam", "dtype": "float64"}')
    assert code == 0, message
    directory = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None, root=0)
    path = os.path.join(directory, "model.pt")
    assert api.model_save(model, path)[0] == 0
    inner = api._session.models[model].inner
    saved = [p.detach().clone() for p in inner.parameters()]
    with torch.no_grad():
        for p in inner.parameters():
            p.add_(1.0 + RANK)  # different on every rank: restore must make them equal again
    code, message, _ = api.model_restore(model, path)
    assert code == 0, message
    for p, q in zip(inner.parameters(), saved):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    code, message, _ = api.model_restore(model, os.path.join(directory, "missing.pt"))
    who = "every rank" if SIZE == 1 else "rank 0"  # only rank 0 reads checkpoints
    assert code == errors.IO and f"{who}: FileNotFoundError" in message, message
    api.model_free(model)
