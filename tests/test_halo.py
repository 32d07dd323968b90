"""HaloExchange against the global array, and fill/accumulate adjointness,
on random layouts: 1- to 4-D grids, uneven and zero-size blocks, periodic
axes, asymmetric widths, widths wider than neighbours' blocks."""
import numpy as np
import pytest
from mpi4py import MPI

import domainpar as dp
from domainpar.comm import halo as halo_module
from domainpar.testing import adjoint_error
from layouts import global_array, random_layout, reference_fill

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD
CASES = [(grid_ndim, seed) for grid_ndim in (1, 2, 3, 4) for seed in range(25)]


@pytest.fixture(params=["datatype", "pack", "tuning"])
def wire_mode(request, monkeypatch):
    """Run a test with strided boxes sent as MPI datatypes, as packed buffers,
    and switching between the two as a plan does while it tunes itself."""
    monkeypatch.setattr(halo_module, "FORCED_WAY",
                        None if request.param == "tuning" else request.param)
    monkeypatch.setattr(halo_module, "TUNING_CALLS", 1)
    monkeypatch.setattr(halo_module, "RETUNE_EVERY", 2)
    return request.param


def padded_with_block(halo, glob, rng_seed, dtype):
    """A padded array: the owned cells from ``glob``, random garbage in the ghosts."""
    dec = halo.decomposition
    rng = np.random.default_rng(rng_seed + 1000 * COMM.Get_rank())
    a = rng.standard_normal(halo.padded_shape).astype(dtype)
    a[halo.owned] = glob[dec.local_slices()]
    return a


@pytest.mark.parametrize("grid_ndim,seed", CASES)
def test_fill_equals_slicing_the_global_array(grid_ndim, seed, wire_mode):
    _, dec, width = random_layout(seed, COMM, grid_ndim)
    halo = dp.HaloExchange(dec, width)
    glob = global_array(dec.global_shape, seed)
    a = padded_with_block(halo, glob, seed, np.float64)
    expected = reference_fill(glob, halo, a)
    halo.fill(a)
    np.testing.assert_array_equal(a, expected, err_msg=f"{dec} width={width}")


@pytest.mark.parametrize("grid_ndim,seed", CASES)
def test_accumulate_is_the_adjoint_of_fill(grid_ndim, seed, wire_mode):
    _, dec, width = random_layout(seed, COMM, grid_ndim)
    halo = dp.HaloExchange(dec, width)
    rng = np.random.default_rng(seed + 7919 * COMM.Get_rank())
    x = rng.standard_normal(halo.padded_shape)
    y = rng.standard_normal(halo.padded_shape)
    fx = halo.fill(x.copy())
    aty = halo.accumulate(y.copy())
    assert adjoint_error(fx, y, x, aty, COMM) < 1e-13


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128,
                                   np.int32, np.int64, np.float16, np.uint8])
def test_dtypes_and_torch_tensors(dtype, wire_mode):
    torch = pytest.importorskip("torch")
    grid = dp.ProcessGrid((0, 0), periodic=(True, False))
    dec = dp.Decomposition((7, 5, 6), grid, shard={1: 0, 2: 1})
    halo = dp.HaloExchange(dec, {1: (2, 1), 2: 1})
    glob = global_array(dec.global_shape, 3, np.complex128 if np.dtype(dtype).kind == "c"
                        else np.float64)
    glob = (glob * 10).astype(dtype)
    a = padded_with_block(halo, glob, 3, dtype)
    expected = reference_fill(glob, halo, a)
    np.testing.assert_array_equal(halo.fill(a.copy()), expected)
    if np.dtype(dtype) != np.uint8:  # torch has no uint8 DLPack path issue; tested above
        t = torch.from_numpy(a.copy())
        assert halo.fill(t) is t
        np.testing.assert_array_equal(t.numpy(), expected)
    # the adjoint with an accumulate in the same dtype (sums, not copies)
    if np.dtype(dtype).kind in "fc" and np.dtype(dtype).itemsize >= 4:
        rng = np.random.default_rng(5 + COMM.Get_rank())
        x = rng.standard_normal(halo.padded_shape).astype(dtype)
        y = rng.standard_normal(halo.padded_shape).astype(dtype)
        err = adjoint_error(halo.fill(x.copy()), y, x, halo.accumulate(y.copy()), COMM)
        assert err < (1e-5 if np.dtype(dtype).itemsize <= 8 and dtype != np.float64 else 1e-13)


def test_non_contiguous_arrays_and_plan_reuse(wire_mode):
    grid = dp.ProcessGrid((0,), periodic=True)
    dec = dp.Decomposition((4, 11, 6), grid, shard={1: 0})
    halo = dp.HaloExchange(dec, {1: 2, 2: 1})
    glob = global_array(dec.global_shape, 11)
    base = padded_with_block(halo, glob, 11, np.float64)
    expected = reference_fill(glob, halo, base)
    # the same values inside a bigger array: a strided view
    big = np.zeros((base.shape[0] + 2,) + base.shape[1:] + (3,))
    view = big[1:-1, :, :, 1]
    view[...] = base
    for _ in range(3):  # plans are reused; results must not change
        halo.fill(view)
        np.testing.assert_array_equal(view, expected)
    assert len(halo._plans) == 1
    halo.fill(base)
    np.testing.assert_array_equal(base, expected)
    assert len(halo._plans) == 2


@pytest.mark.parametrize("periodic", [True, False])
def test_outer_ghosts_untouched_and_periodic_wrap_explicit(periodic):
    """A hand-checked case: 1-D, 12 cells, width 2 on each side; ghosts off a
    non-periodic domain keep their -1."""
    grid = dp.ProcessGrid((0,), periodic=periodic)
    dec = dp.Decomposition((12,), grid, shard={0: 0})
    halo = dp.HaloExchange(dec, {0: 2})
    a = np.full(halo.padded_shape, -1.0)
    a[halo.owned] = np.arange(12.0)[dec.local_slices()]
    halo.fill(a)
    off, n = dec.offsets()[0], dec.local_shape()[0]
    expected = [float(i % 12) if periodic or 0 <= i < 12 else -1.0
                for i in range(off - 2, off + n + 2)]
    assert a.tolist() == expected


@pytest.mark.parametrize("grid_ndim,seed", CASES[::7])
def test_ranks_may_choose_different_ways(grid_ndim, seed, monkeypatch):
    """Datatype and packed boxes put the same bytes on the wire, so a plan's
    choice (made per rank, from its own timings) needs no agreement."""
    monkeypatch.setattr(halo_module, "FORCED_WAY", ("datatype", "pack")[COMM.Get_rank() % 2])
    _, dec, width = random_layout(seed, COMM, grid_ndim)
    halo = dp.HaloExchange(dec, width)
    glob = global_array(dec.global_shape, seed)
    a = padded_with_block(halo, glob, seed, np.float64)
    expected = reference_fill(glob, halo, a)
    np.testing.assert_array_equal(halo.fill(a), expected)
    rng = np.random.default_rng(seed + 31 * COMM.Get_rank())
    x, y = rng.standard_normal((2,) + halo.padded_shape)
    assert adjoint_error(halo.fill(x.copy()), y, x, halo.accumulate(y.copy()), COMM) < 1e-13


def test_many_arrays_through_one_plan(wire_mode):
    """Persistent requests are kept per array address; more arrays than are kept,
    filled and accumulated in turn, each get their own neighbours' values."""
    grid = dp.ProcessGrid((0, 0), periodic=(True, True))
    dec = dp.Decomposition((9, 7, 5), grid, shard={0: 0, 1: 1})
    halo = dp.HaloExchange(dec, {0: 1, 1: (2, 1), 2: 1})
    count = halo_module._KEPT_ADDRESSES + 2
    globs = [global_array(dec.global_shape, 100 + i) for i in range(count)]
    arrays = [padded_with_block(halo, g, 100 + i, np.float64) for i, g in enumerate(globs)]
    expected = [reference_fill(g, halo, a) for g, a in zip(globs, arrays)]
    for _ in range(2):
        for a, e in zip(arrays, expected):
            np.testing.assert_array_equal(halo.fill(a), e)
    assert len(halo._plans) == 1
    (plan,) = halo._plans.values()
    assert len(plan.requests) <= halo_module._KEPT_ADDRESSES
    if wire_mode == "tuning" and plan.tunable:  # settled, then looked again
        assert plan.last_timings is not None
    rng = np.random.default_rng(COMM.Get_rank())
    for a in arrays:
        x, y = rng.standard_normal((2,) + halo.padded_shape)
        a[...] = y
        assert adjoint_error(halo.fill(x.copy()), y, x, halo.accumulate(a), COMM) < 1e-13
