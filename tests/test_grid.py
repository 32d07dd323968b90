"""ProcessGrid: coordinates, ranks, neighbours (diagonals, periodic wrap,
PROC_NULL off the grid), sub-communicators, MPI-chosen dims, and adopting a
Cartesian communicator made elsewhere (also through a Fortran handle)."""
import itertools
import math

import numpy as np
import pytest
from mpi4py import MPI

import domainpar as dp
from layouts import global_array, grid_dims_cases

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD
SIZE, RANK = COMM.Get_size(), COMM.Get_rank()
GRID_DIMS = grid_dims_cases(SIZE, max_ndim=4)
CASES = [(dims, periodic) for dims in GRID_DIMS
         for periodic in sorted({tuple(bool((k >> i) & 1) for i in range(len(dims)))
                                 for k in (0, 1, 2, 2**len(dims) - 1)})]


def row_major_rank(coords, dims):
    """MPI's rank of ``coords`` on a grid made without reordering."""
    r = 0
    for c, n in zip(coords, dims):
        r = r * n + c
    return r


def expected_neighbor(coords, offset, dims, periodic):
    target = []
    for c, o, n, p in zip(coords, offset, dims, periodic):
        t = c + o
        if p:
            t %= n
        elif not 0 <= t < n:
            return MPI.PROC_NULL
        target.append(t)
    return row_major_rank(target, dims)


def case_id(case):
    dims, periodic = case
    return "x".join(map(str, dims)) + "-" + "".join("p" if p else "n" for p in periodic)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_coords_and_ranks(case):
    dims, periodic = case
    grid = dp.ProcessGrid(dims, periodic=periodic)
    assert grid.dims == dims and grid.periodic == periodic and grid.ndim == len(dims)
    assert grid.size == SIZE and grid.rank == RANK  # never reordered
    assert row_major_rank(grid.coords, dims) == RANK
    assert tuple(grid.comm.Get_coords(RANK)) == grid.coords
    assert MPI.Comm.Compare(grid.comm, COMM) in (MPI.CONGRUENT, MPI.IDENT)
    all_coords = [grid.coords_of(r) for r in range(SIZE)]
    assert sorted(all_coords) == sorted(itertools.product(*map(range, dims)))
    for r, c in enumerate(all_coords):
        assert row_major_rank(c, dims) == r and grid.rank_of(c) == r
        # whole turns around a periodic axis land on the same rank; off a
        # non-periodic axis there is nobody
        for axis in range(len(dims)):
            for turn in (-1, 1, 2):
                moved = list(c)
                moved[axis] += turn * dims[axis]
                assert grid.rank_of(moved) == (r if periodic[axis] else MPI.PROC_NULL)
    assert COMM.allgather(grid.coords) == all_coords
    for bad in (-1, SIZE):
        with pytest.raises(dp.LayoutError, match=f"rank {bad}"):
            grid.coords_of(bad)
    for bad in ((0,) * (len(dims) + 1), (0,) * (len(dims) - 1)):
        with pytest.raises(dp.LayoutError, match="entries"):
            grid.rank_of(bad)
        with pytest.raises(dp.LayoutError, match="entries"):
            grid.neighbor(bad)
    assert repr(grid).startswith("ProcessGrid(dims=")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_neighbors_with_diagonals_and_messages(case):
    dims, periodic = case
    grid = dp.ProcessGrid(dims, periodic=periodic)
    nbrs = grid.neighbors()
    offsets = [o for o in itertools.product((-1, 0, 1), repeat=len(dims)) if any(o)]
    assert sorted(nbrs) == sorted(offsets)
    for off in offsets + [tuple(2 * o for o in offsets[0]), (0,) * len(dims)]:
        want = expected_neighbor(grid.coords, off, dims, periodic)
        assert grid.neighbor(off) == want
        if off in nbrs:
            assert nbrs[off] == want
    # The real test of a neighbour table: a message to neighbor(+o) comes back
    # from neighbor(-o), and it is that rank that sent it (diagonals included).
    for off in offsets:
        dest, source = grid.neighbor(off), grid.neighbor(tuple(-o for o in off))
        buf = np.array([-7], np.int64)
        grid.comm.Sendrecv(np.array([RANK], np.int64), dest=dest, sendtag=11,
                           recvbuf=buf, source=source, recvtag=11)
        assert buf[0] == (source if source != MPI.PROC_NULL else -7)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_sub_and_axis_comms(case):
    dims, periodic = case
    grid = dp.ProcessGrid(dims, periodic=periodic)
    ndim = len(dims)
    for k in range(ndim + 1):
        for axes in itertools.combinations(range(ndim), k):
            sub = grid.sub(axes)
            assert sub.Get_size() == math.prod(dims[a] for a in axes)
            # members: exactly the ranks sharing my coordinates off ``axes``, in grid order
            members = sub.allgather(RANK)
            expected = [r for r in range(SIZE)
                        if all(grid.coords_of(r)[a] == grid.coords[a]
                               for a in range(ndim) if a not in axes)]
            assert members == expected
            assert sub.Get_rank() == row_major_rank([grid.coords[a] for a in axes],
                                                    [dims[a] for a in axes])
            # made once, whatever the spelling of the axes
            assert grid.sub(tuple(reversed(axes))) is sub
            assert grid.sub([a - ndim for a in axes]) is sub
    for axis in range(ndim):
        ac = grid.axis_comm(axis)
        assert ac is grid.sub((axis,)) and ac is grid.axis_comm(axis - ndim)
        assert ac.Get_size() == dims[axis] and ac.Get_rank() == grid.coords[axis]
        assert tuple(ac.periods) == (periodic[axis],)
        # a sum along the axis adds up exactly the coordinates on that line
        total = ac.allreduce(RANK)
        line = [r for r in range(SIZE) if all(grid.coords_of(r)[a] == grid.coords[a]
                                               for a in range(ndim) if a != axis)]
        assert total == sum(line)
    for bad in (ndim, -ndim - 1):
        with pytest.raises(dp.LayoutError, match=f"grid axis {bad}"):
            grid.axis_comm(bad)


def test_dims_chosen_by_mpi():
    assert dp.ProcessGrid().dims == (SIZE,)
    assert dp.ProcessGrid(None, periodic=True).periodic == (True,)
    assert dp.ProcessGrid(SIZE).dims == (SIZE,)
    for ndim in (1, 2, 3):
        grid = dp.ProcessGrid((0,) * ndim)
        assert grid.dims == tuple(MPI.Compute_dims(SIZE, ndim))
        assert math.prod(grid.dims) == SIZE
    # a fixed entry is kept and the zeros share what is left
    assert dp.ProcessGrid((0, SIZE)).dims == (1, SIZE)
    assert dp.ProcessGrid((1, 0, 1)).dims == (1, SIZE, 1)
    if SIZE % 2 == 0:
        assert dp.ProcessGrid((2, 0)).dims == (2, SIZE // 2)
    grid = dp.ProcessGrid((0, 0), periodic=(False, True))
    assert grid.periodic == (False, True)
    assert grid.comm.Get_topology() == MPI.CART


def test_grid_on_a_sub_communicator():
    """comm= other than the world: two independent grids, one per half."""
    half = COMM.Split(RANK % 2, RANK)
    grid = dp.ProcessGrid((0, 0), comm=half)
    assert grid.size == half.Get_size() and grid.rank == half.Get_rank()
    assert math.prod(grid.dims) == half.Get_size()
    dec = dp.Decomposition((5, 3), grid, shard={0: 0, 1: 1})
    glob = global_array(dec.global_shape, 1)
    out = dp.comm.allgatherv(glob[dec.local_slices()], dec)
    np.testing.assert_array_equal(out, glob)
    half.Free()


@pytest.mark.parametrize("dims", GRID_DIMS[:5], ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize("via", ["object", "fortran-handle"])
def test_from_comm_adopts_a_cartesian_communicator(dims, via):
    periodic = [i % 2 == 1 for i in range(len(dims))]
    cart = COMM.Create_cart(list(dims), periods=periodic, reorder=False)
    given = cart if via == "object" else MPI.Comm.f2py(cart.py2f())
    grid = dp.ProcessGrid.from_comm(given)
    assert grid.dims == dims and grid.periodic == tuple(periodic)
    assert grid.rank == cart.Get_rank() and grid.coords == tuple(cart.Get_coords(cart.Get_rank()))
    # a duplicate: the simulation's messages never mix with domainpar's
    assert grid.comm != cart and MPI.Comm.Compare(grid.comm, cart) == MPI.CONGRUENT
    for off, r in grid.neighbors().items():
        assert r == expected_neighbor(grid.coords, off, dims, periodic)
    # and it works as a grid: a decomposition over it gathers the global array
    dec = dp.Decomposition((7, 6, 5, 4)[: len(dims)], grid, shard={d: d for d in range(len(dims))})
    glob = global_array(dec.global_shape, 2)
    np.testing.assert_array_equal(dp.comm.allgatherv(glob[dec.local_slices()], dec), glob)
    cart.Free()
    # the duplicate outlives the original
    assert grid.comm.allreduce(1) == SIZE


def test_from_comm_with_reordering_allowed():
    """A simulation may let MPI reorder; the adopted grid takes the cart's ranks as they are."""
    cart = COMM.Create_cart(list(MPI.Compute_dims(SIZE, 2)), periods=[True, False], reorder=True)
    grid = dp.ProcessGrid.from_comm(cart)
    assert grid.rank == cart.Get_rank() and grid.coords == tuple(cart.Get_coords(cart.Get_rank()))
    assert grid.neighbor((1, 0)) == cart.Shift(0, 1)[1]
    assert grid.neighbor((0, -1)) == cart.Shift(1, 1)[0]
    cart.Free()


def test_from_comm_rejects_non_cartesian_communicators():
    with pytest.raises(dp.LayoutError, match="Cartesian"):
        dp.ProcessGrid.from_comm(COMM)
    dup = COMM.Dup()
    with pytest.raises(dp.LayoutError, match="Cartesian"):
        dp.ProcessGrid.from_comm(MPI.Comm.f2py(dup.py2f()))
    dup.Free()
    graph = COMM.Create_dist_graph_adjacent([(RANK - 1) % SIZE], [(RANK + 1) % SIZE])
    with pytest.raises(dp.LayoutError, match="Cartesian"):
        dp.ProcessGrid.from_comm(graph)
    graph.Free()
    with pytest.raises(dp.LayoutError, match="Cartesian"):
        dp.ProcessGrid.from_comm(MPI.COMM_NULL)


def test_grid_of_one_process():
    grid = dp.ProcessGrid((1, 1, 1), periodic=True, comm=MPI.COMM_SELF)
    assert grid.size == 1 and grid.coords == (0, 0, 0)
    # periodic on a single process: every neighbour is oneself
    assert set(grid.neighbors().values()) == {0}
    grid = dp.ProcessGrid((1, 1), periodic=False, comm=MPI.COMM_SELF)
    assert set(grid.neighbors().values()) == {MPI.PROC_NULL}
    assert grid.sub(()).Get_size() == 1 and grid.axis_comm(1).Get_size() == 1
