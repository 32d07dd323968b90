"""Bad input: a clear error, raised on EVERY rank alike, within seconds.

Each case runs the bad call on every rank, catches whatever it raises, and
then (one allgather, reached even by a rank that raised nothing) checks that
every rank raised exactly the expected type with the same message naming the
problem. A rank that raised alone would leave the others waiting in a
collective; pytest-timeout turns that hang into a failure.

Cases where something "differs across ranks" need two ranks; at one rank they
check the single-rank error path instead (and that consistent input passes).
"""
import numpy as np
import pytest
from mpi4py import MPI

import domainpar as dp
from domainpar import LayoutError, MismatchError
from domainpar.comm import allgatherv, allreduce, bcast, gatherv, repartition, scatterv
from domainpar.testing import raises_on_every_rank

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]
COMM = MPI.COMM_WORLD
SIZE, RANK = COMM.Get_size(), COMM.Get_rank()
LAST = SIZE - 1
ODD = RANK == LAST  # the one rank that passes something different


def grid2():
    return dp.ProcessGrid((0, 0))


# -- Decomposition ----------------------------------------------------------------------------
def test_global_shapes_differ_across_ranks():
    grid = grid2()
    if SIZE > 1:
        shape = (8, 5) if ODD else (8, 4)
        raises_on_every_rank(MismatchError, ["Decomposition global shapes", "differ between ranks",
                                             "(8, 4)", "(8, 5)"],
                             lambda: dp.Decomposition(shape, grid, shard={0: 0}), exact=True)
    else:  # a world of one always agrees with itself; its own bad shape is an error
        dp.Decomposition((8, 4), grid, shard={0: 0})
        raises_on_every_rank(LayoutError, ["(8, -4)", "negative size"],
                             lambda: dp.Decomposition((8, -4), grid, shard={0: 0}), exact=True)


def test_shard_maps_or_sizes_differ_across_ranks():
    grid = grid2()
    p = grid.dims[0]
    if SIZE > 1:
        shard = {1: 0} if ODD else {0: 0}
        raises_on_every_rank(MismatchError, ["differ between ranks", "shard={1: 0}",
                                             "shard={0: 0}"],
                             lambda: dp.Decomposition((6, 6), grid, shard=shard), exact=True)
    if p > 1:
        sizes = [6] + [0] * (p - 1) if ODD else [0] * (p - 1) + [6]
        raises_on_every_rank(MismatchError, ["differ between ranks", "sizes="],
                             lambda: dp.Decomposition((6, 6), grid, shard={0: 0}, sizes={0: sizes}),
                             exact=True)
    else:
        sizes = [7] if ODD else [6]
        raises_on_every_rank(LayoutError, [f"rank {LAST}:", "sum to its global size 6"],
                             lambda: dp.Decomposition((6, 6), grid, shard={0: 0}, sizes={0: sizes}),
                             exact=True)


@pytest.mark.parametrize("everywhere", [True, False], ids=["everywhere", "one-rank"])
@pytest.mark.parametrize("shard,pattern", [
    ({2: 0}, "shard names tensor dim 2, but the tensor has 2 dims"),
    ({-3: 0}, "shard names tensor dim -3"),
    ({0: 2}, "shard maps dim 0 to grid axis 2, but the grid has 2 axes"),
    ({1: -3}, "grid axis -3"),
    ({0: 0, 1: 0}, "two tensor dims to grid axis 0"),
])
def test_shard_map_naming_a_missing_dim_or_axis(shard, pattern, everywhere):
    grid = grid2()
    given = shard if everywhere or ODD else {0: 0}
    err = raises_on_every_rank(LayoutError, [pattern, f"rank {LAST}:"],
                               lambda: dp.Decomposition((6, 5), grid, shard=given), exact=True)
    if not everywhere and SIZE > 1:
        assert "rank 0:" not in str(err)  # only the rank at fault is named


@pytest.mark.parametrize("sizes,pattern", [
    ("short", "sum to its global size 9"),
    ("long", "sum to its global size 9"),
    ("negative", "must be >= 0"),
    ("count", "entries, but grid axis 0 has"),
    ("unsharded", "sizes given for dim 1, which is not sharded"),
])
def test_sizes_that_do_not_fit(sizes, pattern):
    grid = dp.ProcessGrid()
    balanced = list(dp.comm.balanced_sizes(9, SIZE))
    bad = {"short": {0: [b - (c == 0) for c, b in enumerate(balanced)]},
           "long": {0: [b + (c == LAST) for c, b in enumerate(balanced)]},
           "negative": {0: [-1] + [0] * (SIZE - 2) + [10] if SIZE > 1 else [-1]},
           "count": {0: balanced + [0]},
           "unsharded": {1: [3]}}[sizes]
    raises_on_every_rank(LayoutError, [pattern],
                         lambda: dp.Decomposition((9, 3), grid, shard={0: 0}, sizes=bad),
                         exact=True)
    # wrong on one rank only: the same error everywhere, naming that rank
    given = bad if ODD else {0: balanced}
    raises_on_every_rank(LayoutError, [pattern, f"rank {LAST}:"],
                         lambda: dp.Decomposition((9, 3), grid, shard={0: 0}, sizes=given),
                         exact=True)


# -- ProcessGrid ------------------------------------------------------------------------------
@pytest.mark.parametrize("dims,pattern", [
    ((SIZE + 1,), f"hold {SIZE + 1} processes but the communicator has {SIZE}"),
    ((SIZE, 2), f"hold {2 * SIZE} processes but the communicator has {SIZE}"),
    ((0, SIZE + 1), f"which does not divide the communicator size {SIZE}"),
    ((SIZE, -1), "must not be negative"),
    (("x",), "invalid literal"),
])
def test_grid_dims_that_do_not_cover_the_world(dims, pattern):
    raises_on_every_rank(LayoutError, [f"rank {LAST}:", pattern],
                         lambda: dp.ProcessGrid(dims), exact=True)


def test_grid_periodic_of_the_wrong_length_and_dims_that_differ():
    raises_on_every_rank(LayoutError, ["periodic has 3 entries for a 2-D grid"],
                         lambda: dp.ProcessGrid((SIZE, 1), periodic=(True, False, True)),
                         exact=True)
    if SIZE > 1:
        dims = (1, SIZE) if ODD else (SIZE, 1)
        raises_on_every_rank(MismatchError, ["ProcessGrid dims and periodic differ between ranks",
                                             f"dims=(1, {SIZE})", f"dims=({SIZE}, 1)"],
                             lambda: dp.ProcessGrid(dims), exact=True)
        periodic = ODD
        raises_on_every_rank(MismatchError, ["differ between ranks", "periodic=(True,)"],
                             lambda: dp.ProcessGrid(None, periodic=periodic), exact=True)
    else:
        raises_on_every_rank(LayoutError, ["hold 2 processes"],
                             lambda: dp.ProcessGrid((1, 2)), exact=True)


# -- HaloExchange -----------------------------------------------------------------------------
def halo_setup():
    grid = grid2()
    dec = dp.Decomposition((7, 6), grid, shard={0: 0, 1: 1})
    return dec, dp.HaloExchange(dec, {0: 1, 1: (2, 1)})


@pytest.mark.parametrize("op", ["fill", "accumulate"])
def test_halo_array_shape_wrong_on_one_rank(op):
    _, halo = halo_setup()
    shape = list(halo.padded_shape)
    if ODD:
        shape[1] += 1
    a = np.zeros(shape)
    err = raises_on_every_rank(LayoutError, [f"rank {LAST}: HaloExchange.{op}: array shape",
                                             "does not match block"],
                               lambda: getattr(halo, op)(a), exact=True)
    if SIZE > 1:
        assert "rank 0:" not in str(err)


@pytest.mark.parametrize("op", ["fill", "accumulate"])
def test_halo_dtypes_differ_across_ranks(op):
    _, halo = halo_setup()
    if SIZE > 1:
        a = np.zeros(halo.padded_shape, np.float32 if ODD else np.float64)
        raises_on_every_rank(MismatchError, [f"HaloExchange.{op} array dtypes differ between ranks",
                                             "float32", "float64"],
                             lambda: getattr(halo, op)(a), exact=True)
    else:  # one rank: a dtype is only wrong when it cannot travel at all
        raises_on_every_rank(LayoutError, [f"HaloExchange.{op}",
                                           "cannot communicate a builtins.list"],
                             lambda: getattr(halo, op)(np.zeros(halo.padded_shape).tolist()),
                             exact=True)


@pytest.mark.parametrize("width,pattern", [
    ({0: -1}, "width -1 for dim 0 must not be negative"),
    ({1: (1, -2)}, "width (1, -2) for dim 1 must not be negative"),
    ({2: 1}, "width names dim 2, but the array has 2 dims"),
    (1, "width must be a dict"),
])
def test_bad_halo_widths(width, pattern):
    dec, _ = halo_setup()
    raises_on_every_rank(LayoutError, [pattern], lambda: dp.HaloExchange(dec, width), exact=True)
    given = width if ODD else {0: 1}
    raises_on_every_rank(LayoutError, [f"rank {LAST}:", pattern],
                         lambda: dp.HaloExchange(dec, given), exact=True)
    if SIZE > 1 and isinstance(width, dict):
        w = {0: 2} if ODD else {0: 1}
        raises_on_every_rank(MismatchError, ["HaloExchange widths differ between ranks"],
                             lambda: dp.HaloExchange(dec, w), exact=True)


# -- collectives ------------------------------------------------------------------------------
def block_of(dec, dtype=np.float64, extra=0):
    shape = list(dec.local_shape())
    shape[-1] += extra
    return np.zeros(shape, dtype)


COLLECTIVE_CALLS = {
    "allgatherv": lambda a, src, dst: allgatherv(a, src),
    "gatherv": lambda a, src, dst: gatherv(a, src, root=LAST),
    "repartition": lambda a, src, dst: repartition(a, src, dst),
}


def layouts():
    grid = grid2()
    src = dp.Decomposition((5, 7), grid, shard={0: 0, 1: 1})
    dst = dp.Decomposition((5, 7), grid, shard={1: 0})
    return src, dst


@pytest.mark.parametrize("name", sorted(COLLECTIVE_CALLS))
def test_collective_dtypes_differ_across_ranks(name):
    src, dst = layouts()
    call = COLLECTIVE_CALLS[name]
    if SIZE > 1:
        a = block_of(src, np.complex64 if ODD else np.float64)
        raises_on_every_rank(MismatchError, [f"{name} dtypes", "differ between ranks", "complex64",
                                             "float64"],
                             lambda: call(a, src, dst), exact=True)
    else:
        raises_on_every_rank(LayoutError, [f"{name}: domainpar cannot communicate a builtins.list"],
                             lambda: call(block_of(src).tolist(), src, dst), exact=True)


@pytest.mark.parametrize("name", sorted(COLLECTIVE_CALLS))
def test_collective_block_shape_wrong_on_one_rank(name):
    src, dst = layouts()
    a = block_of(src, extra=1 if ODD else 0)
    raises_on_every_rank(LayoutError, [f"rank {LAST}: {name}: block shape",
                                       f"local shape {src.local_shape(LAST)}"],
                         lambda: COLLECTIVE_CALLS[name](a, src, dst), exact=True)


def test_repartition_between_different_global_shapes_or_grids():
    src, _ = layouts()
    other = dp.Decomposition((5, 8), src.grid, shard={1: 0})
    raises_on_every_rank(LayoutError, ["repartition: global shapes differ ((5, 7) -> (5, 8))"],
                         lambda: repartition(block_of(src), src, other), exact=True)
    elsewhere = dp.Decomposition((5, 7), grid2(), shard={1: 0})
    raises_on_every_rank(LayoutError, ["on different grids"],
                         lambda: repartition(block_of(src), src, elsewhere), exact=True)


def test_repartition_over_the_count_limit_on_one_rank(monkeypatch):
    """Message sizes differ per rank in a repartition; one rank over MPI's
    count limit must still make every rank raise."""
    from domainpar.comm import collectives
    src, dst = layouts()
    if ODD:
        monkeypatch.setattr(collectives, "_MAX_COUNT", 8)
    raises_on_every_rank(LayoutError, [f"rank {LAST}: repartition:", "exceed MPI's count limit"],
                         lambda: repartition(block_of(src), src, dst), exact=True)


def test_unchecked_repartition_near_the_count_limit_on_one_rank(monkeypatch):
    """check=False (the autograd layer) skips the agreement, except where some
    rank's block could reach MPI's count limit: then the rank whose messages pass
    it (the one with the largest block) still makes every rank raise."""
    from domainpar.comm import collectives
    src, dst = layouts()
    largest = max(int(np.prod(dst.local_shape(r))) for r in range(SIZE)) * 8
    monkeypatch.setattr(collectives, "_MAX_COUNT", largest - 1)  # on every rank alike
    over = [r for r in range(SIZE) if int(np.prod(dst.local_shape(r))) * 8 == largest]
    raises_on_every_rank(LayoutError, [f"rank {over[0]}: repartition:",
                                       "exceed MPI's count limit"],
                         lambda: repartition(block_of(src), src, dst, check=False))


def test_unchecked_bcast_refuses_a_strided_array():
    """check=False trusts that shapes agree, not that the array can be written."""
    with pytest.raises(LayoutError, match="bcast: the array must be C-contiguous"):
        bcast(np.zeros((4, 4))[:, ::2], COMM, check=False)


@pytest.mark.parametrize("name", ["allgatherv", "repartition"])
def test_unchecked_collectives_refuse_a_block_that_does_not_fit(name):
    """check=False trusts the caller's layout, not its blocks: a block of another
    shape is refused before any message, by the rank that holds it (here every rank)."""
    src, dst = layouts()
    call = {"allgatherv": lambda a: allgatherv(a, src, check=False),
            "repartition": lambda a: repartition(a, src, dst, check=False)}[name]
    with pytest.raises(LayoutError, match=f"{name}: block shape .* does not match"):
        call(block_of(src, extra=1))


@pytest.mark.parametrize("root", sorted({0, LAST}))
def test_scatterv_root_array_with_the_wrong_shape(root):
    src, _ = layouts()
    wrong = np.zeros((5, 8)) if RANK == root else None
    raises_on_every_rank(LayoutError, [f"rank {root}: scatterv: the root's array has shape (5, 8)",
                                       "global shape is (5, 7)"],
                         lambda: scatterv(wrong, src, root=root), exact=True)
    not_an_array = [[0.0] * 7] * 5 if RANK == root else None
    raises_on_every_rank(LayoutError, [f"rank {root}: scatterv", "cannot communicate"],
                         lambda: scatterv(not_an_array, src, root=root), exact=True)
    # and the communicator is still fine afterwards: a good scatter works
    good = np.arange(35.0).reshape(5, 7) if RANK == root else None
    np.testing.assert_array_equal(scatterv(good, src, root=root),
                                  np.arange(35.0).reshape(5, 7)[src.local_slices()])


@pytest.mark.parametrize("op", ["scatterv", "gatherv"])
def test_bad_or_differing_roots(op):
    src, _ = layouts()

    def call(root):
        if op == "scatterv":
            return scatterv(np.zeros((5, 7)) if RANK == root else None, src, root=root)
        return gatherv(block_of(src), src, root=root)

    for bad in (SIZE, -1, 0.5):
        raises_on_every_rank(LayoutError,
                             [f"root {bad!r} is not a rank of the grid's {SIZE} processes"],
                             lambda bad=bad: call(bad), exact=True)
    if SIZE > 1:
        root = 1 if ODD else 0
        raises_on_every_rank(MismatchError, [f"{op} ", "differ between ranks", "root=0", "root=1"],
                             lambda: call(root), exact=True)
    else:
        call(np.int64(0))  # a numpy integer is a root as good as any


def test_allreduce_errors():
    a = np.ones(3)
    raises_on_every_rank(LayoutError, ["allreduce: op 'avg' is not one of"],
                         lambda: allreduce(a, COMM, "avg"), exact=True)
    raises_on_every_rank(LayoutError, ["MPI has no arithmetic type for dtype object"],
                         lambda: allreduce(np.array([1, None], dtype=object), COMM), exact=True)
    if SIZE > 1:
        b = np.ones(4 if ODD else 3)
        raises_on_every_rank(MismatchError, ["allreduce shapes or dtypes differ between ranks",
                                             "float64(3,)", "float64(4,)"],
                             lambda: allreduce(b, COMM), exact=True)
        c = np.ones(3, np.float32 if ODD else np.float64)
        raises_on_every_rank(MismatchError, ["float32(3,)"],
                             lambda: allreduce(c, COMM), exact=True)
    else:
        raises_on_every_rank(LayoutError, ["cannot communicate"],
                             lambda: allreduce([1.0], COMM), exact=True)
    # nothing was changed by a refused call, and a good one still works
    assert a.tolist() == [1.0] * 3
    assert allreduce(a, COMM).tolist() == [float(SIZE)] * 3


def test_error_on_one_rank_does_not_desynchronise_the_next_collective():
    """After many refused calls the ranks are still in step."""
    src, dst = layouts()
    for _ in range(5):
        a = block_of(src, extra=1 if ODD else 0)
        raises_on_every_rank(LayoutError, ["block shape"], lambda a=a: allgatherv(a, src), exact=True)
    glob = np.arange(35.0).reshape(5, 7)
    np.testing.assert_array_equal(allgatherv(glob[src.local_slices()], src), glob)
