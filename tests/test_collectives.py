"""Collectives against the global array: allreduce, allgatherv, scatterv and
gatherv, and repartition (alltoallv) between random rank-agreed layouts on 1-,
2- and 3-D grids, with uneven and zero-size blocks and replicated grid axes;
dtypes that MPI has no arithmetic for travel as bytes."""
import itertools

import numpy as np
import pytest
from mpi4py import MPI

import domainpar as dp
from domainpar.comm import allgatherv, allreduce, bcast, collectives, gatherv, repartition, scatterv
from domainpar.testing import adjoint_error
from layouts import global_array, random_decomposition, random_layout

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD
SIZE, RANK = COMM.Get_size(), COMM.Get_rank()
SEEDS = range(12)
GRID_NDIMS = (1, 2, 3)


def typed(glob, dtype):
    """``glob`` (float64 or complex128) in ``dtype`` with distinct values."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return glob.real > 0
    if dtype.kind in "iu":
        return (np.abs(glob.real) * 40).astype(dtype)
    return glob.astype(dtype) if dtype.kind == "c" else glob.real.astype(dtype)


def random_grid(seed, grid_ndim):
    rng = np.random.default_rng(seed)
    dims = list(MPI.Compute_dims(SIZE, grid_ndim))
    rng.shuffle(dims)
    return rng, dp.ProcessGrid(dims, periodic=bool(seed % 2))


def random_shape(rng, ndim, max_extent=8):
    return tuple(int(rng.integers(0, max_extent + 1)) if rng.random() < 0.1 else
                 int(rng.integers(1, max_extent + 1)) for _ in range(ndim))


# -- allreduce ---------------------------------------------------------------------------------
def values_of(rank, shape, dtype):
    """Rank ``rank``'s contribution: small integers, so float sums are exact."""
    rng = np.random.default_rng(100 + rank)
    return rng.integers(-50, 50, size=shape).astype(dtype)


REDUCE = {"sum": lambda xs: np.sum(xs, axis=0), "max": lambda xs: np.max(xs, axis=0),
          "min": lambda xs: np.min(xs, axis=0), "prod": lambda xs: np.prod(np.sign(xs), axis=0)}


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("kind", ["numpy", "torch", "numpy-strided", "torch-strided"])
def test_allreduce(op, dtype, kind):
    shape = (3, 4, 5)
    contrib = [values_of(r, shape, dtype) for r in range(SIZE)]
    if op == "prod":  # keep products of integers small: +-1 and 0
        contrib = [np.sign(c).astype(dtype) for c in contrib]
    expected = REDUCE[op](np.stack(contrib)).astype(dtype)
    base = np.full((3, 8, 5, 2), 99, dtype)
    if kind.endswith("strided"):  # a non-contiguous view inside a bigger array
        base[:, ::2, :, 1] = contrib[RANK]
        a = base[:, ::2, :, 1]
        assert not a.flags.c_contiguous
    else:
        a = contrib[RANK].copy()
    if kind.startswith("torch"):
        t = torch.from_numpy(base)[:, ::2, :, 1] if kind.endswith("strided") else torch.from_numpy(a)
        assert allreduce(t, COMM, op) is t  # in place, the same object back
        got = t.numpy()
    else:
        assert allreduce(a, COMM, op) is a
        got = a
    np.testing.assert_array_equal(got, expected)
    if kind.endswith("strided"):  # the cells around the view are untouched
        mask = np.ones(base.shape, bool)
        mask[:, ::2, :, 1] = False
        assert (base[mask] == 99).all()


def test_allreduce_on_a_sub_communicator_and_empty_arrays():
    grid = dp.ProcessGrid((0, 0))
    line = grid.axis_comm(1)
    a = np.array([float(RANK)])
    allreduce(a, line, "sum")
    assert a[0] == sum(r for r in range(SIZE) if grid.coords_of(r)[0] == grid.coords[0])
    empty = np.zeros((0, 3))
    assert allreduce(empty, COMM) is empty
    t = torch.ones(4, dtype=torch.float64, requires_grad=True)  # detached view, in place
    allreduce(t, COMM, "sum")
    assert t.detach().tolist() == [float(SIZE)] * 4


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_bcast_copies_the_roots_values(check, kind):
    for root in sorted({0, SIZE - 1}):
        a = np.arange(12.0).reshape(3, 4) + 100 * RANK
        a = torch.from_numpy(a) if kind == "torch" else a
        assert bcast(a, COMM, root, check=check) is a
        np.testing.assert_array_equal(np.asarray(a), np.arange(12.0).reshape(3, 4) + 100 * root)


# -- allgatherv, scatterv, gatherv ----------------------------------------------------------------
@pytest.mark.parametrize("grid_ndim,seed", list(itertools.product(GRID_NDIMS, SEEDS)))
def test_allgatherv_equals_the_global_array(grid_ndim, seed):
    _, dec, _ = random_layout(seed, COMM, grid_ndim)
    glob = global_array(dec.global_shape, seed)
    block = glob[dec.local_slices()]
    for check in (True, False):
        out = allgatherv(block, dec, check=check)
        assert isinstance(out, np.ndarray) and out.dtype == glob.dtype
        np.testing.assert_array_equal(out, glob, err_msg=f"{dec} check={check}")


def test_allgatherv_torch_and_non_contiguous_blocks():
    grid = dp.ProcessGrid((0, 0))
    dec = dp.Decomposition((5, 7, 3), grid, shard={1: 0, 2: 1})
    glob = global_array(dec.global_shape, 4)
    block = glob[dec.local_slices()]
    big = np.zeros(block.shape[:2] + (2 * block.shape[2] + 1,))
    big[:, :, 1::2] = block
    np.testing.assert_array_equal(allgatherv(big[:, :, 1::2], dec), glob)
    t = torch.from_numpy(block.copy()).requires_grad_(True)
    np.testing.assert_array_equal(allgatherv(t, dec), glob)
    tt = torch.from_numpy(np.ascontiguousarray(np.swapaxes(block, 0, 2))).transpose(0, 2)
    assert not tt.is_contiguous()
    np.testing.assert_array_equal(allgatherv(tt, dec), glob)


def scatter_cases():
    roots = sorted({0, SIZE - 1})
    return list(itertools.product(GRID_NDIMS, range(8), roots))


@pytest.mark.parametrize("grid_ndim,seed,root", scatter_cases())
def test_scatterv_then_gatherv_round_trips(grid_ndim, seed, root):
    _, dec, _ = random_layout(seed, COMM, grid_ndim)
    glob = global_array(dec.global_shape, seed)
    block = scatterv(glob.copy() if RANK == root else None, dec, root=root)
    assert block.shape == dec.local_shape() and block.dtype == glob.dtype
    np.testing.assert_array_equal(block, glob[dec.local_slices()], err_msg=repr(dec))
    # gatherv takes the blocks of coordinate 0 of every replicated axis: other
    # replicas hold garbage here, which must not reach the root
    grid = dec.grid
    if any(grid.coords[a] != 0 for a in dec.replicated_axes):
        block = block + 1000.0
    back = gatherv(block, dec, root=root)
    if RANK == root:
        np.testing.assert_array_equal(back, glob, err_msg=repr(dec))
    else:
        assert back is None


@pytest.mark.parametrize("dtype", [np.complex128, np.float16, np.bool_, np.int8, np.uint16,
                                   np.complex64, np.int64])
def test_byte_path_dtypes(dtype):
    rng, grid = random_grid(3, 2)
    shape = (5, 6, 3)
    src = dp.Decomposition(shape, grid, shard={0: 0, 1: 1}, sizes={0: [5] + [0] * (grid.dims[0] - 1)})
    dst = dp.Decomposition(shape, grid, shard={2: 0})
    glob = typed(global_array(shape, 9, np.complex128), dtype)
    root = SIZE - 1
    block = scatterv(glob if RANK == root else None, src, root=root)
    assert block.dtype == glob.dtype
    np.testing.assert_array_equal(block, glob[src.local_slices()])
    np.testing.assert_array_equal(allgatherv(block, src), glob)
    moved = repartition(block, src, dst)
    assert moved.dtype == glob.dtype
    np.testing.assert_array_equal(moved, glob[dst.local_slices()])
    np.testing.assert_array_equal(repartition(moved, dst, src), block)
    back = gatherv(moved, dst, root=0)
    if RANK == 0:
        np.testing.assert_array_equal(back, glob)


def test_scatterv_from_a_torch_tensor():
    grid = dp.ProcessGrid()
    dec = dp.Decomposition((2 * SIZE + 1, 3), grid, shard={0: 0})
    glob = global_array(dec.global_shape, 5, np.float32)
    given = torch.from_numpy(glob) if RANK == 0 else None
    np.testing.assert_array_equal(scatterv(given, dec), glob[dec.local_slices()])


# -- repartition ------------------------------------------------------------------------------------
def check_repartition(src, dst, seed, dtype=np.float64):
    """There and back, with and without the agreement check (the autograd layer's)."""
    glob = typed(global_array(src.global_shape, seed), dtype)
    block = glob[src.local_slices()]
    for check in (True, False):
        out = repartition(block, src, dst, check=check)
        assert out.shape == dst.local_shape() and out.dtype == glob.dtype
        np.testing.assert_array_equal(out, glob[dst.local_slices()],
                                      err_msg=f"{src} -> {dst} check={check}")
        back = repartition(out, dst, src, check=check)
        np.testing.assert_array_equal(back, block, err_msg=f"{dst} -> {src} check={check}")


def test_unchecked_collectives_send_no_agreement(monkeypatch):
    """check=False (the autograd layer: blocks follow from agreed layouts) skips the
    agreement allreduce that check=True sends; a repartition whose blocks stay far
    from MPI's count limit sends none either."""
    grid = dp.ProcessGrid((0,))
    src = dp.Decomposition((3, 2 * SIZE + 1), grid, shard={1: 0})
    dst = dp.Decomposition((3, 2 * SIZE + 1), grid, shard={0: 0})
    block = global_array(src.global_shape, 7)[src.local_slices()]
    calls = []
    real = collectives.agree
    monkeypatch.setattr(collectives, "agree", lambda *a, **k: (calls.append(a), real(*a, **k)))
    for check in (True, False):
        calls.clear()
        repartition(block, src, dst, check=check)
        allgatherv(block, src, check=check)
        bcast(np.zeros(3), COMM, check=check)
        assert len(calls) == (3 if check else 0), check


@pytest.mark.parametrize("grid_ndim,seed", list(itertools.product(GRID_NDIMS, range(20))))
def test_repartition_between_random_layouts(grid_ndim, seed):
    rng, grid = random_grid(seed, grid_ndim)
    shape = random_shape(rng, int(rng.integers(1, 5)))
    src = random_decomposition(rng, grid, shape)
    dst = random_decomposition(rng, grid, shape)
    check_repartition(src, dst, seed)


@pytest.mark.parametrize("grid_ndim", GRID_NDIMS)
def test_repartition_named_cases(grid_ndim):
    grid = dp.ProcessGrid((0,) * grid_ndim)
    axis = int(np.argmax(grid.dims))  # the axis with the most processes
    p = grid.dims[axis]
    C, H, W = 3, 2 * p + 1, 3 * p - 1
    shape = (C, H, W)
    on_h = dp.Decomposition(shape, grid, shard={1: axis})
    on_w = dp.Decomposition(shape, grid, shard={2: axis})
    check_repartition(on_h, on_w, 1)                          # sharded on H -> on W
    uneven = dp.Decomposition(shape, grid, shard={1: axis}, sizes={1: [H] + [0] * (p - 1)})
    check_repartition(uneven, on_h, 2)                        # everything on one -> balanced
    zeros = dp.Decomposition(shape, grid, shard={2: axis},
                             sizes={2: [0] * (p - 1) + [W]} if p > 1 else None)
    check_repartition(zeros, uneven, 3)                       # zero-size blocks both ways
    replicated = dp.Decomposition(shape, grid)                # every axis replicates
    check_repartition(replicated, on_w, 4)
    check_repartition(on_h, replicated, 5)
    empty = dp.Decomposition((C, 0, W), grid, shard={1: axis})
    check_repartition(empty, dp.Decomposition((C, 0, W), grid, shard={2: axis}), 6)
    if grid_ndim >= 2:
        other = (axis + 1) % grid_ndim
        a = dp.Decomposition(shape, grid, shard={1: axis})         # replicates ``other``
        b = dp.Decomposition(shape, grid, shard={2: other})        # replicates ``axis``
        check_repartition(a, b, 7)
        full = dp.Decomposition(shape, grid, shard={0: other, 1: axis})
        check_repartition(full, b, 8)
        check_repartition(b, full, 9)


@pytest.mark.parametrize("grid_ndim,seed", list(itertools.product(GRID_NDIMS, range(40))))
def test_a_repartition_that_keeps_every_block_at_home_sends_nothing(grid_ndim, seed):
    """``_stays_local`` (no Alltoallv: each rank copies its own pieces) holds only
    where every rank's destination block lies in its own source block, checked
    against every rank's slices; it holds where the destination cuts dims the
    source holds whole along axes the source replicates, and the values move right."""
    rng, grid = random_grid(seed, grid_ndim)
    shape = random_shape(rng, int(rng.integers(1, 4)))
    src = random_decomposition(rng, grid, shape)
    dst = random_decomposition(rng, grid, shape)

    def inside(inner, outer):
        return all(o.start <= i.start and i.stop <= o.stop or i.start == i.stop
                   for i, o in zip(inner, outer))
    if collectives._stays_local(src, dst):
        assert all(inside(dst.local_slices(r), src.local_slices(r)) for r in range(grid.size))
    free = list(src.replicated_axes)
    whole = [d for d in range(len(shape)) if d not in src.shard]
    if free and whole:
        shard = dict(src.shard)
        shard[whole[0]] = free[0]
        sizes = {d: src.block_sizes(d) for d in src.shard}
        cut = dp.Decomposition(shape, grid, shard, sizes)
        assert collectives._stays_local(src, cut)
        check_repartition(src, cut, seed)


@pytest.mark.parametrize("grid_ndim,seed", list(itertools.product((2, 3), range(8))))
def test_replicas_communicate_within_their_own_group(grid_ndim, seed):
    """Documented provenance: on the axes ``src`` replicates, a rank takes its
    pieces from the replicas that share its coordinates there (repartition),
    and each replica group gathers among itself (allgatherv). Replicas here
    hold different values (a marker of their coordinates on those axes), so a
    piece from the wrong replica shows."""
    rng, grid = random_grid(seed, grid_ndim)
    shape = random_shape(rng, int(rng.integers(1, 4)))
    src = random_decomposition(rng, grid, shape)
    dst = random_decomposition(rng, grid, shape)
    marker = float(sum((c + 1) * 10 ** (k + 2) for k, c in
                       enumerate(grid.coords[a] for a in src.replicated_axes)))
    glob = global_array(shape, seed)
    out = repartition(glob[src.local_slices()] + marker, src, dst)
    np.testing.assert_array_equal(out, glob[dst.local_slices()] + marker, err_msg=f"{src} -> {dst}")
    np.testing.assert_array_equal(allgatherv(glob[src.local_slices()] + marker, src), glob + marker)


def test_repartition_torch_and_strided_input():
    grid = dp.ProcessGrid((0, 0))
    shape = (4, 9, 5)
    src = dp.Decomposition(shape, grid, shard={1: 0, 2: 1})
    dst = dp.Decomposition(shape, grid, shard={0: 1})
    glob = global_array(shape, 12)
    block = glob[src.local_slices()]
    t = torch.from_numpy(np.asfortranarray(block))
    np.testing.assert_array_equal(repartition(t, src, dst), glob[dst.local_slices()])
    big = np.zeros((block.shape[0], 2 * block.shape[1], block.shape[2]))
    big[:, ::2] = block
    np.testing.assert_array_equal(repartition(big[:, ::2], src, dst), glob[dst.local_slices()])


@pytest.mark.parametrize("grid_ndim,seed", list(itertools.product(GRID_NDIMS, range(10))))
def test_repartition_adjoint(grid_ndim, seed):
    """<R x, y> == <x, R^T y> with R^T = repartition(dst -> src), for layouts
    that replicate nothing (R is then a permutation of the global array)."""
    rng, grid = random_grid(seed, grid_ndim)
    shape = random_shape(rng, grid_ndim + int(rng.integers(0, 2)))
    src = random_decomposition(rng, grid, shape, replicate=False)
    dst = random_decomposition(rng, grid, shape, replicate=False)
    local = np.random.default_rng(1000 * seed + RANK)
    x = local.standard_normal(src.local_shape())
    y = local.standard_normal(dst.local_shape())
    rx = repartition(x, src, dst)
    rty = repartition(y, dst, src)
    assert adjoint_error(rx, y, x, rty, COMM) < 1e-13
    # and it is exact: the global sums of squares agree (nothing lost, nothing doubled)
    assert COMM.allreduce(float((rx ** 2).sum())) == pytest.approx(
        COMM.allreduce(float((x ** 2).sum())), rel=1e-13)
