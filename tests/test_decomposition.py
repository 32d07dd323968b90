"""Decomposition index math: property tests with hypothesis.

Every property is checked for every rank of the grid (a Decomposition answers
for any rank without communicating), so one process checks the whole layout.
Inside hypothesis the Decomposition is built with ``check=False``: no message
is sent, so each rank may draw its own examples without the ranks diverging in
a collective.

Real grids must cover the MPI world, so MPI runs see grids of 1 to 4
processes. The serial tests add larger grids through ``ModelGrid``, a
pure-Python stand-in for a Cartesian communicator (row-major ranks, as
``MPI_Cart_create`` without reordering numbers them);
``test_model_grid_matches_a_real_grid`` checks it against real grids under MPI.
"""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import domainpar as dp
from domainpar.comm import balanced_sizes
from layouts import grid_dims_cases

COMM = MPI.COMM_WORLD
SETTINGS = settings(database=None, deadline=None, max_examples=40)


class ModelGrid:
    """What a Decomposition needs of a ProcessGrid, for a grid of any size
    without that many processes: row-major coordinates, ``rank`` chosen freely."""

    class _Comm:
        def __init__(self, grid):
            self.grid = grid

        def Get_cart_rank(self, coords):
            assert len(coords) == self.grid.ndim
            return int(np.ravel_multi_index(tuple(coords), self.grid.dims))

        def Get_coords(self, rank):
            return list(np.unravel_index(rank, self.grid.dims))

    def __init__(self, dims, rank=0):
        self.dims = tuple(dims)
        self.periodic = (False,) * len(dims)
        self.size = math.prod(dims)
        self.rank = rank
        self.comm = self._Comm(self)
        self.coords = self.coords_of(rank)

    @property
    def ndim(self):
        return len(self.dims)

    def coords_of(self, rank):
        if not 0 <= rank < self.size:
            raise dp.LayoutError(f"rank {rank} is not in a grid of {self.size} processes")
        return tuple(int(c) for c in np.unravel_index(rank, self.dims))


# -- strategies -----------------------------------------------------------------------------
@st.composite
def split(draw, n, parts, zeros=True):
    """``n`` cut into ``parts`` blocks (some empty when ``zeros``)."""
    if parts == 1:
        return [n]
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
    sizes = np.diff([0, *cuts, n]).tolist()
    return sizes


@st.composite
def layouts(draw, grid, max_ndim=4, max_extent=7, max_elements=400):
    """(global shape, shard map, sizes map, explicit sizes by positive dim) for
    ``grid``; dims and axes sometimes given as negative numbers."""
    ndim = draw(st.integers(1, max_ndim))
    shape = draw(st.lists(st.integers(0, max_extent), min_size=ndim, max_size=ndim))
    while math.prod(shape) > max_elements:  # keep the exhaustive checks quick
        shape[int(np.argmax(shape))] //= 2
    n_axes = draw(st.integers(0, min(ndim, grid.ndim)))
    axes = draw(st.permutations(range(grid.ndim)))[:n_axes]
    tdims = draw(st.permutations(range(ndim)))[:n_axes]
    shard, sizes, explicit = {}, {}, {}
    for d, a in zip(tdims, axes):
        key_d = d - ndim if draw(st.booleans()) else d
        key_a = a - grid.ndim if draw(st.booleans()) else a
        shard[key_d] = key_a
        if draw(st.booleans()):
            s = draw(split(shape[d], grid.dims[a]))
            sizes[d - ndim if draw(st.booleans()) else d] = s
            explicit[d] = s
    return tuple(shape), shard, sizes, explicit


# -- the properties -------------------------------------------------------------------------
def check_properties(dec, explicit, owner_checks=True):
    """Every documented property of ``dec``, for every rank of its grid."""
    grid, shape = dec.grid, dec.global_shape
    shard = dec.shard
    assert all(0 <= d < dec.ndim for d in shard) and all(0 <= a < grid.ndim for a in shard.values())
    assert dec.replicated_axes == tuple(a for a in range(grid.ndim) if a not in shard.values())

    # block sizes and offsets along every dim
    for d in range(dec.ndim):
        sizes, offs = dec.block_sizes(d), dec.block_offsets(d)
        assert dec.block_sizes(d - dec.ndim) == sizes and dec.block_offsets(d - dec.ndim) == offs
        if d not in shard:
            assert dec.axis_of(d) is None
            assert sizes == (shape[d],) and offs == (0, shape[d])
            continue
        p, n = grid.dims[shard[d]], shape[d]
        assert dec.axis_of(d) == shard[d] == dec.axis_of(d - dec.ndim)
        assert len(sizes) == p and len(offs) == p + 1
        assert sum(sizes) == n and all(s >= 0 for s in sizes)
        assert offs[0] == 0 and offs[-1] == n
        assert all(offs[c + 1] - offs[c] == sizes[c] for c in range(p))
        if d in explicit:
            assert list(sizes) == list(explicit[d])
        else:  # balanced: the first n % p get one more
            assert sizes == tuple(n // p + (c < n % p) for c in range(p))
        # owner_coord inverts the offsets, skipping zero-size blocks
        for i in range(n):
            c = dec.owner_coord(d, i)
            assert offs[c] <= i < offs[c + 1] and sizes[c] > 0
        for bad in (-1, n):
            with pytest.raises(dp.LayoutError, match="outside dim"):
                dec.owner_coord(d, bad)

    # every rank's block: shape, offsets, slices, from its coordinates
    counts = np.zeros(shape, np.int64)
    group_counts = {}
    for r in range(grid.size):
        coords = grid.coords_of(r)
        ls, off, sl = dec.local_shape(r), dec.offsets(r), dec.local_slices(r)
        for d in range(dec.ndim):
            if d in shard:
                c = coords[shard[d]]
                assert ls[d] == dec.block_sizes(d)[c] and off[d] == dec.block_offsets(d)[c]
            else:
                assert ls[d] == shape[d] and off[d] == 0
        assert sl == tuple(slice(o, o + n) for o, n in zip(off, ls))
        assert all(0 <= s.start <= s.stop <= n for s, n in zip(sl, shape))
        counts[sl] += 1
        key = tuple(coords[a] for a in dec.replicated_axes)
        group_counts.setdefault(key, np.zeros(shape, np.int64))[sl] += 1
    # the blocks tile the global array exactly once per replica group
    replicas = math.prod(grid.dims[a] for a in dec.replicated_axes)
    assert len(group_counts) == replicas
    assert (counts == replicas).all()
    for g in group_counts.values():
        assert (g == 1).all()
    # this rank's defaults are its own rank's answers
    assert dec.local_shape() == dec.local_shape(grid.rank)
    assert dec.offsets() == dec.offsets(grid.rank)
    assert dec.local_slices() == dec.local_slices(grid.rank)

    if not owner_checks:
        return
    # owner(): the owner's block holds the index, within the asking rank's replica group
    reps = {}
    for r in range(grid.size):
        reps.setdefault(tuple(grid.coords_of(r)[a] for a in dec.replicated_axes), r)
    for index in np.ndindex(*shape):
        for key, r in reps.items():
            o = dec.owner(index, rank=r)
            assert all(s.start <= i < s.stop for i, s in zip(index, dec.local_slices(o)))
            assert tuple(grid.coords_of(o)[a] for a in dec.replicated_axes) == key
        assert dec.owner(index) == dec.owner(index, rank=grid.rank)
    with pytest.raises(dp.LayoutError, match="entries"):
        dec.owner((0,) * (dec.ndim + 1))


def build(grid, layout):
    shape, shard, sizes, explicit = layout
    return dp.Decomposition(shape, grid, shard=shard, sizes=sizes, check=False), explicit


# -- serial tests: no MPI communication at all ---------------------------------------------------
MODEL_DIMS = [(1,), (2,), (3,), (5,), (1, 1), (2, 3), (4, 1), (1, 4), (2, 2, 2), (3, 1, 2),
              (1, 2, 3), (2, 2, 1, 2)]


@pytest.mark.parametrize("dims", MODEL_DIMS, ids=lambda d: "x".join(map(str, d)))
@SETTINGS
@given(data=st.data())
def test_properties_on_model_grids(dims, data):
    rank = data.draw(st.integers(0, math.prod(dims) - 1), label="rank")
    grid = ModelGrid(dims, rank)
    layout = data.draw(layouts(grid, max_elements=150), label="layout")
    dec, explicit = build(grid, layout)
    check_properties(dec, explicit)


@settings(database=None, deadline=None, max_examples=200)
@given(n=st.integers(0, 1000), parts=st.integers(1, 64))
def test_balanced_sizes(n, parts):
    s = balanced_sizes(n, parts)
    assert len(s) == parts and sum(s) == n
    q, r = divmod(n, parts)
    assert s[:r] == (q + 1,) * r and s[r:] == (q,) * (parts - r)
    assert max(s) - min(s) <= 1 and list(s) == sorted(s, reverse=True)


def test_balanced_and_explicit_by_hand():
    grid = ModelGrid((4,))
    assert dp.Decomposition((10,), grid, {0: 0}, check=False).block_sizes(0) == (3, 3, 2, 2)
    assert dp.Decomposition((10,), grid, {0: 0}, check=False).block_offsets(0) == (0, 3, 6, 8, 10)
    assert dp.Decomposition((2,), grid, {0: 0}, check=False).block_sizes(0) == (1, 1, 0, 0)
    dec = dp.Decomposition((5,), grid, {0: 0}, sizes={0: [0, 5, 0, 0]}, check=False)
    assert dec.block_offsets(0) == (0, 0, 5, 5, 5)
    assert [dec.owner_coord(0, i) for i in range(5)] == [1] * 5
    assert [dec.local_slices(r) for r in range(4)] == [
        (slice(0, 0),), (slice(0, 5),), (slice(5, 5),), (slice(5, 5),)]
    dec = dp.Decomposition((6,), grid, {0: 0}, sizes={0: [2, 0, 0, 4]}, check=False)
    assert [dec.owner_coord(0, i) for i in range(6)] == [0, 0, 3, 3, 3, 3]
    assert [dec.owner((i,)) for i in range(6)] == [0, 0, 3, 3, 3, 3]
    # a 2-D grid: rank = row-major coordinates, replicated axis keeps the asker's coordinate
    grid = ModelGrid((2, 3))
    dec = dp.Decomposition((5, 7), grid, {1: 0}, check=False)  # axis 1 replicates
    assert dec.replicated_axes == (1,)
    assert dec.local_shape(4) == (5, 3) and dec.offsets(4) == (0, 4)   # coords (1, 1)
    assert dec.owner((0, 2), rank=5) == 2 and dec.owner((0, 5), rank=0) == 3


def test_negative_dims_and_axes_are_normalised():
    grid = ModelGrid((2, 3))
    a = dp.Decomposition((4, 5, 6), grid, {-1: -2, 0: -1}, sizes={-1: [6, 0]}, check=False)
    b = dp.Decomposition((4, 5, 6), grid, {2: 0, 0: 1}, sizes={2: [6, 0]}, check=False)
    assert a == b and hash(a) == hash(b) and a.shard == {0: 1, 2: 0}
    c = dp.Decomposition((4, 5, 6), grid, {2: 0, 0: 1}, check=False)
    assert a != c
    assert "shard={0: 1, 2: 0}" in repr(a)


@pytest.mark.parametrize("shape,shard,sizes,match", [
    ((4, 5), {2: 0}, None, "tensor dim 2"),
    ((4, 5), {-3: 0}, None, "tensor dim -3"),
    ((4, 5), {0: 2}, None, "grid axis 2"),
    ((4, 5), {0: -3}, None, "grid axis -3"),
    ((4, 5), {0: 0, -2: 1}, None, "dim 0 twice"),
    ((4, 5), {0: 0, 1: -2}, None, "two tensor dims to grid axis 0"),
    ((4, -5), {0: 0}, None, "negative size"),
    ((4, 5), {0: 0}, {0: [4]}, "1 entries, but grid axis 0 has 2"),
    ((4, 5), {0: 0}, {0: [1, 2]}, "sum to its global size 4"),
    ((4, 5), {0: 0}, {0: [5, -1]}, "must be >= 0"),
    ((4, 5), {0: 0}, {1: [2, 3]}, "dim 1, which is not sharded"),
    ((4, 5), {0: 0}, {7: [2, 2]}, "dim 7, which is not sharded"),
    (5, {}, None, "Decomposition"),
])
def test_bad_arguments_raise_layout_error(shape, shard, sizes, match):
    grid = ModelGrid((2, 3))
    with pytest.raises(dp.LayoutError, match=match):
        dp.Decomposition(shape, grid, shard=shard, sizes=sizes, check=False)


def test_queries_reject_bad_dims_ranks_and_indices():
    grid = ModelGrid((2, 3))
    dec = dp.Decomposition((4, 5), grid, {0: 0}, check=False)
    for bad in (2, -3):
        with pytest.raises(dp.LayoutError, match="dim"):
            dec.block_sizes(bad)
        with pytest.raises(dp.LayoutError, match="dim"):
            dec.axis_of(bad)
        with pytest.raises(dp.LayoutError, match="dim"):
            dec.owner_coord(bad, 0)
    for bad in (-1, 6):
        with pytest.raises(dp.LayoutError, match="rank"):
            dec.local_shape(bad)
    with pytest.raises(dp.LayoutError, match="outside dim 1"):
        dec.owner((0, 5))


def test_a_world_of_one_is_a_valid_grid():
    """Serial, without mpiexec: the default grid has one process and every
    query (and the collective consistency check) works."""
    dp.init()
    grid = dp.ProcessGrid(comm=MPI.COMM_SELF)
    assert grid.dims == (1,) and grid.size == 1 and grid.coords == (0,)
    dec = dp.Decomposition((6, 4), grid, shard={0: 0})
    assert dec.local_shape() == (6, 4) and dec.offsets() == (0, 0)
    assert dec.local_slices() == (slice(0, 6), slice(0, 4))
    assert dec.owner((5, 3)) == 0 and dec.block_sizes(0) == (6,)
    dec = dp.Decomposition((0, 3), dp.ProcessGrid((1, 1), comm=MPI.COMM_SELF), shard={1: 1})
    assert dec.local_shape() == (0, 3)
    if COMM.Get_size() == 1:
        grid = dp.ProcessGrid()
        assert grid.size == 1 and grid.dims == (1,)
        dec = dp.Decomposition((3, 3, 3), grid, shard={2: 0})
        check_properties(dec, {})


# -- MPI tests: real grids over the whole world ---------------------------------------------------
GRID_DIMS = grid_dims_cases(COMM.Get_size())


@pytest.fixture(scope="module")
def real_grids():
    """One real grid per dims case, built in the same order on every rank."""
    return {dims: dp.ProcessGrid(dims, periodic=[i % 2 == 0 for i in range(len(dims))])
            for dims in GRID_DIMS}


@pytest.mark.mpi
@pytest.mark.parametrize("dims", GRID_DIMS, ids=lambda d: "x".join(map(str, d)))
@SETTINGS
@given(data=st.data())
def test_properties_on_real_grids(real_grids, dims, data):
    grid = real_grids[dims]
    layout = data.draw(layouts(grid, max_elements=150), label="layout")
    dec, explicit = build(grid, layout)
    check_properties(dec, explicit)


@pytest.mark.mpi
@pytest.mark.parametrize("dims", GRID_DIMS, ids=lambda d: "x".join(map(str, d)))
@settings(database=None, deadline=None, max_examples=20)
@given(data=st.data())
def test_model_grid_matches_a_real_grid(real_grids, dims, data):
    """The serial tests' ModelGrid numbers ranks exactly as MPI does."""
    grid = real_grids[dims]
    model = ModelGrid(dims, grid.rank)
    assert model.coords == grid.coords
    for r in range(grid.size):
        assert model.coords_of(r) == grid.coords_of(r)
        assert model.comm.Get_cart_rank(grid.coords_of(r)) == grid.rank_of(grid.coords_of(r)) == r
    layout = data.draw(layouts(grid, max_elements=60), label="layout")
    real, _ = build(grid, layout)
    fake, _ = build(model, layout)
    for r in range(grid.size):
        assert real.local_slices(r) == fake.local_slices(r)
    for index in itertools.islice(np.ndindex(*real.global_shape), 60):
        assert real.owner(index) == fake.owner(index)


@pytest.mark.mpi
@pytest.mark.parametrize("dims", GRID_DIMS, ids=lambda d: "x".join(map(str, d)))
def test_checked_construction_agrees_on_every_rank(real_grids, dims):
    """The default (checked) constructor: one collective, same answers everywhere."""
    grid = real_grids[dims]
    rng = np.random.default_rng(len(dims))
    shape = tuple(int(n) for n in rng.integers(0, 9, size=len(dims) + 1))
    shard = {d: d for d in range(len(dims))}
    sizes = {0: np.diff([0, *sorted(rng.integers(0, shape[0] + 1, dims[0] - 1)), shape[0]]).tolist()}
    dec = dp.Decomposition(shape, grid, shard=shard, sizes=sizes)
    check_properties(dec, sizes, owner_checks=False)
    everyone = COMM.allgather((dec.local_slices(), [dec.local_slices(r) for r in range(grid.size)]))
    for r, (mine, all_of_them) in enumerate(everyone):
        assert all_of_them == everyone[0][1] and mine == all_of_them[r]


@pytest.mark.mpi
def test_grid_of_comm_self_under_mpi():
    """Under mpiexec too, a grid over COMM_SELF is a valid world of one."""
    grid = dp.ProcessGrid((1, 1), comm=MPI.COMM_SELF)
    dec = dp.Decomposition((3, 4), grid, shard={0: 0, 1: 1}, sizes={0: [3], 1: [4]})
    assert dec.local_shape() == (3, 4) and dec.owner((2, 3)) == 0
    check_properties(dec, {0: [3], 1: [4]})
