"""Cases that only larger grids have (issue 20, item 1), for the 8- and 16-rank
stages (``make test`` mpi-n8, ``make test-large``); below 8 ranks they skip.

The rest of those stages' selection is the existing MPI suite, whose layouts
take their grid dims from the world size (2x2x2 halos, rings of 8 blocks, ...);
here what nothing else covers: DomainParallel training on a batch x domain x
domain grid (batch over one axis, two spatial dims over two more); halo fill
and accumulate on the explicit grids 2x2x2 (8 ranks), 2x2x4 and 4x4x1 (16)
with periodic and uneven axes and widths reaching two hops, checked value by
value; FFTs over three sharded dims of a 3-D grid; repartitions of a 3-D
grid's layouts onto dims cut over several axes; and a checkpoint and an HDF5
field written by all ranks on a 3-D grid, then read and training continued by
a job of 3 ranks (a sub-communicator), as a restart on fewer ranks would.
"""
import copy
import math

import numpy as np
import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.comm import collectives
from domainpar.testing import adjoint_error, assert_matches_single_process, check_on_every_rank, shard_like
from domainpar.testing.layouts import block_sizes
from io_cases import fresh
from layouts import global_array, reference_fill
from tensor_cases import RANK, SIZE, global_tensor
from test_domain_parallel import ChannelMLP, assert_same_parameters, train
from test_io_checkpoint import _data, _model, _same_state, _state
from test_io_checkpoint import _train as train_steps

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(SIZE < 8, reason="needs 8 ranks (a batch x 2x2 grid)")]

SHAPE = (4, 3, 9, 7)  # (B, C, H, W): B over grid axis 0, H and W over axes 1 and 2


def batch_2x2_grid(kind):
    """A 3-D grid (2x2x2 at 8 ranks, 4x2x2 at 16): batch dim 0 over axis 0,
    spatial dims 2 and 3 over axes 1 and 2, blocks ``kind``."""
    dims = MPI.Compute_dims(SIZE, 3)
    grid = dp.ProcessGrid(dims)
    shard = {0: 0, 2: 1, 3: 2}
    sizes = {d: s for d, a in shard.items()
             if (s := block_sizes(SHAPE[d], dims[a], kind)) is not None}
    return grid, shard, sizes or None


@pytest.mark.parametrize("kind", ["even", "uneven", "zero"])
def test_domain_parallel_training_on_a_batch_by_2x2_grid(kind):
    torch.manual_seed(0)
    model = ChannelMLP().double()
    x = global_tensor(SHAPE, seed=1)
    target = global_tensor((SHAPE[0], 2) + SHAPE[2:], seed=2)
    reference = train(copy.deepcopy(model), x, target)
    grid, shard, sizes = batch_2x2_grid(kind)
    wrapped = dp.DomainParallel(copy.deepcopy(model), grid, bucket_cap_mb=0.0001)
    train(wrapped, shard_like(x, grid, shard, sizes), shard_like(target, grid, shard, sizes))
    assert_same_parameters(wrapped, reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("overlap", [True, False], ids=["nonblocking", "blocking"])
def test_domain_parallel_gradients_on_a_batch_by_2x2_grid(overlap):
    torch.manual_seed(1)
    grid, shard, sizes = batch_2x2_grid("uneven")
    assert_matches_single_process(
        ChannelMLP().double(), global_tensor(SHAPE, seed=3), grid, shard, sizes=sizes,
        wrap=lambda m: dp.DomainParallel(m, grid, bucket_cap_mb=1e-5, overlap=overlap))


# -- halo exchange on explicit 3-D grids ----------------------------------------------------
HALO_SHAPE = (2, 13, 9, 11)        # dims 1, 2, 3 over grid axes 0, 1, 2
HALO_WIDTH = {1: (3, 1), 2: (2, 2), 3: (1, 4)}
EXPLICIT_GRIDS = [(2, 2, 2), (2, 2, 4), (4, 4, 1)]


def explicit_halo(dims, periodic):
    """A HaloExchange on grid ``dims`` with uneven blocks along every axis, some
    narrower than the widths (their ghosts reach two ranks away)."""
    grid = dp.ProcessGrid(dims, periodic=periodic)
    shard = {1: 0, 2: 1, 3: 2}
    sizes = {d: block_sizes(HALO_SHAPE[d], dims[a], "uneven", seed=3)
             for d, a in shard.items() if dims[a] > 1}
    dec = dp.Decomposition(HALO_SHAPE, grid, shard, sizes=sizes)
    return dp.HaloExchange(dec, HALO_WIDTH), sizes


@pytest.mark.parametrize("periodic", [(True, False, True), (False, True, False)],
                         ids=["periodic-0-2", "periodic-1"])
@pytest.mark.parametrize("dims", EXPLICIT_GRIDS, ids=lambda d: "x".join(map(str, d)))
def test_halo_on_explicit_3d_grids(dims, periodic):
    if math.prod(dims) != SIZE:
        pytest.skip(f"needs {math.prod(dims)} ranks")
    halo, sizes = explicit_halo(dims, periodic)
    # The layout must reach two hops somewhere, or this test would not test it.
    assert any(max(HALO_WIDTH[d]) > min(s) for d, s in sizes.items())
    glob = global_array(HALO_SHAPE, seed=5)
    a = np.random.default_rng(RANK).standard_normal(halo.padded_shape)
    a[halo.owned] = glob[halo.decomposition.local_slices()]
    expected = reference_fill(glob, halo, a)
    halo.fill(a)
    np.testing.assert_array_equal(a, expected)
    rng = np.random.default_rng(100 + RANK)
    x, y = rng.standard_normal((2,) + halo.padded_shape)
    fx, aty = halo.fill(x.copy()), halo.accumulate(y.copy())
    assert adjoint_error(fx, y, x, aty, MPI.COMM_WORLD) < 1e-13


# -- FFT over a 3-D grid ---------------------------------------------------------------------
@pytest.mark.parametrize("name,kind", [("fftn", "uneven"), ("rfftn", "even")])
def test_fft_over_three_sharded_dims_of_a_3d_grid(name, kind):
    dims = MPI.Compute_dims(SIZE, 3)
    grid = dp.ProcessGrid(dims)
    shape = (4, 2, 8, 6, 10)
    shard = {2: 0, 3: 1, 4: 2}
    sizes = {d: s for d, a in shard.items()
             if (s := block_sizes(shape[d], dims[a], kind, seed=1)) is not None}
    fn = getattr(torch.fft, name)
    x = global_tensor(shape, seed=4)
    assert_matches_single_process(lambda t: torch.view_as_real(fn(t, dim=(2, 3, 4))), x, grid,
                                  shard, sizes=sizes or None)


# -- repartition on a 3-D grid ---------------------------------------------------------------
@pytest.mark.parametrize("dst_shard", [{2: (0, 1, 2)}, {3: (2, 0), 4: 1}, {0: 1, 4: (0, 2)}],
                         ids=["all-axes-on-one-dim", "two-axes-on-one-dim", "batch-and-two"])
def test_repartition_between_layouts_of_a_3d_grid(dst_shard):
    dims = MPI.Compute_dims(SIZE, 3)
    grid = dp.ProcessGrid(dims)
    shape = (4, 3, 17, 6, 10)
    shard = {2: 0, 3: 1, 4: 2}
    sizes = {d: s for d, a in shard.items()
             if (s := block_sizes(shape[d], dims[a], "zero", seed=2)) is not None}
    src = dp.Decomposition(shape, grid, shard, sizes=sizes or None)
    dst = dp.Decomposition(shape, grid, dst_shard)
    glob = global_array(shape, seed=6)
    moved = collectives.repartition(np.ascontiguousarray(glob[src.local_slices()]), src, dst)
    np.testing.assert_array_equal(moved, glob[dst.local_slices()])
    rng = np.random.default_rng(7 + RANK)
    x = rng.standard_normal(src.local_shape())
    y = rng.standard_normal(dst.local_shape())
    fx = collectives.repartition(x, src, dst)
    aty = collectives.repartition(y, dst, src)
    assert adjoint_error(fx, y, x, aty, MPI.COMM_WORLD) < 1e-13


# -- HDF5 and checkpoints: written on a 3-D grid, restarted on 3 ranks -----------------------
def test_checkpoint_and_field_from_a_3d_grid_restart_on_3_ranks(shared_dir, mode):
    world = MPI.COMM_WORLD
    grid = dp.ProcessGrid(MPI.Compute_dims(SIZE, 3))
    gx, gt = _data()                                   # (1, 2, 10, 9)
    shard = {0: 0, 2: 1, 3: 2}
    sizes = {2: block_sizes(10, grid.dims[1], "uneven", seed=4)} if grid.dims[1] > 1 else None
    x, t = shard_like(gx, grid, shard, sizes), shard_like(gt, grid, shard, sizes)
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, opt, x, t, 2)
    path, field = fresh(shared_dir, "restart3"), fresh(shared_dir, "field3")
    dp.io.save_checkpoint(path, model, opt, tensors={"x": x, "t": t}, extra={"step": 2})
    dp.io.write(field, "x", x)
    train_steps(model, opt, x, t, 3)
    uninterrupted = _state(model, opt)
    # The restart: ranks 0-2 as a 3-rank job cutting dim 3 (the rest wait).
    sub = world.Split(0 if RANK < 3 else MPI.UNDEFINED, RANK)
    problems = []
    if sub != MPI.COMM_NULL:
        sub_grid = dp.ProcessGrid((sub.Get_size(),), comm=sub)
        restarted = _model(100)
        opt2 = torch.optim.Adam(restarted.parameters(), lr=1e-2)
        ck = dp.io.load_checkpoint(path, restarted, opt2, grid=sub_grid, shard={3: 0})
        read = dp.io.read(field, "x", sub_grid, {3: 0})
        if not torch.equal(ck.tensors["x"].full_tensor(), gx) or ck.extra != {"step": 2}:
            problems.append("loaded x or extra")
        if not torch.equal(read.full_tensor(), gx):
            problems.append("read field")
        train_steps(restarted, opt2, ck.tensors["x"], ck.tensors["t"], 3)
        problems += _same_state(_state(restarted, opt2), uninterrupted)
        sub.Free()
    check_on_every_rank(not problems, problems)
