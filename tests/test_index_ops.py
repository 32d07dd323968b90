"""Indexing ops on DomainTensors (domainpar/ops/index.py) against one process on
the whole tensor: cat/stack, basic indexing and assignment, narrow/select, split/chunk/unbind,
flip and roll, along sharded and unsharded dims, on 1-, 2- and 3-D grids with even,
uneven and zero-size blocks; the derived layouts, the refusals on every rank,
and the adjoint of the mirror exchange behind flip."""
import functools

import pytest
import torch

import domainpar as dp
from domainpar import autograd as ag
from domainpar.tensor import layout as lay
from domainpar.testing import adjoint_test, assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import CASES, DTYPES, global_tensor
from tensor_cases import layout as _layout

pytestmark = pytest.mark.mpi

CASE_IDS = [f"grid{g}-{k}" for g, k in CASES]
DTYPE_IDS = ["f64", "f32"]
# Every layout in float64 (tight) and float32 (rtol 1e-5).
COMBOS = [(c, d) for c in CASES for d in DTYPES]
COMBO_IDS = [f"grid{g}-{k}-{'f64' if d == torch.float64 else 'f32'}" for (g, k), d in COMBOS]
assert set(DTYPES) == {d for _, d in COMBOS}


@functools.cache
def layout(shape, shard_dims, grid_ndim, kind, seed=0):
    """tensor_cases.layout, with one grid per layout for the whole file: a new grid
    (Cart_create and sub-communicators) costs more than the op under test."""
    return _layout(shape, shard_dims, grid_ndim, kind, seed=seed)
SHAPE = (2, 5, 9, 7)
# The first grid-ndim of these dims are cut: dim 2, then 3, then 1.
SHARD_DIMS = (2, 3, 1)


def check(fn, case, dtype, shape=SHAPE, seed=0):
    grid, shard, sizes = layout(shape, SHARD_DIMS, *case, seed=seed)
    assert_matches_single_process(fn, global_tensor(shape, dtype, seed), grid, shard, sizes=sizes)


def sharded(case, dtype=torch.float64, shape=SHAPE):
    grid, shard, sizes = layout(shape, SHARD_DIMS, *case)
    return shard_like(global_tensor(shape, dtype), grid, shard, sizes, requires_grad=True)


# -- cat / stack ------------------------------------------------------------------------------
CATS = [
    lambda x: torch.cat([x, x.sin()], dim=1),                 # UNet skip (sharded on grid3)
    lambda x: torch.concat([x.exp(), x, x * 2], dim=-1),      # cat along sharded dim 3
    lambda x: torch.cat([x, x[:, :, :3] * 2, x[:, :, 5:]], 2),  # along sharded dim 2
    lambda x: torch.cat([x, torch.linspace(0, 1, 2 * 3 * 9 * 7, dtype=x.dtype)
                         .reshape(2, 3, 9, 7)], dim=1),       # a plain tensor sliced in
    lambda x: torch.stack([x, x.cos()], dim=2),
    lambda x: torch.stack((x.sin(), x), dim=-1),
]


@pytest.mark.parametrize("case,dtype", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("k", range(len(CATS)))
def test_cat_stack_match_one_process(k, case, dtype):
    check(CATS[k], case, dtype)


class CatParam(torch.nn.Module):
    """A replicated parameter cat'ed to a sharded activation: its gradient is the
    sum of the per-block partials."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.linspace(-1, 1, 2 * 2 * 9 * 7,
                                                   dtype=torch.float64).reshape(2, 2, 9, 7))

    def forward(self, x):
        return torch.cat([self.p.to(x.dtype) * 3, x], dim=1)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cat_with_parameter_reduces_its_gradient(case):
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, *case)  # grid3: cat along sharded dim 1
    assert_matches_single_process(CatParam(), global_tensor(SHAPE), grid, shard, sizes=sizes)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cat_of_differently_laid_out_inputs(case):
    """The second input has other block boundaries (balanced vs uneven/zero):
    it is repartitioned onto the first one's blocks."""
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, *case)
    x, y = global_tensor(SHAPE, seed=1), global_tensor(SHAPE, seed=2)
    assert_matches_single_process(lambda a, b: torch.cat([a, b.sin()], dim=0), (x, y), grid,
                                  shard, sizes=[sizes, None])
    assert_matches_single_process(lambda a, b: torch.stack([b, a], dim=1), (x, y), grid,
                                  shard, sizes=[None, sizes])


# -- indexing ---------------------------------------------------------------------------------
def INDEX_LIST(x):
    return x[:, [0, 2, 1]]                       # an index list on dim 1


INDEXES = [
    lambda x: x[:, 1:, 2:7:2],
    lambda x: x[..., 1::3, None],
    lambda x: x[:, :, 8:2],                      # empty along a sharded dim
    lambda x: x[None, :, 1:4, ::4, -3:],
    lambda x: x[:, 0, 3],                        # ints on sharded dims
    lambda x: x[1, -1, ..., 6],
    lambda x: x[:, :, 4:5][..., 2],
    INDEX_LIST,
    lambda x: x.narrow(2, 1, 4),
    lambda x: torch.narrow(x, -1, 2, 5).narrow(1, 0, 0),
    lambda x: torch.select(x.select(2, 4), 0, -1),
]


@pytest.mark.parametrize("case,dtype", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("k", range(len(INDEXES)))
def test_indexing_matches_one_process(k, case, dtype):
    if INDEXES[k] is INDEX_LIST and case[0] == 3:
        # dim 1 is sharded on a 3-D grid: an index list there is refused
        x = sharded(case, dtype)
        raises_on_every_rank(dp.UnsupportedOpError, ["Tensor.__getitem__", "dim 1"],
                             lambda: INDEXES[k](x))
        return
    check(INDEXES[k], case, dtype)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_slice_of_sharded_dim_keeps_the_intersection_without_messages(case):
    """The output blocks along a sharded dim are exactly the slice's elements that
    each input block holds (uneven, possibly empty), read from the layout alone."""
    x = sharded(case)
    for s in (slice(1, None, 2), slice(2, 7, 3), slice(0, 9, 4), slice(6, 2)):
        y = x[:, :, s]
        d_in, d_out = x.decomposition, y.decomposition
        assert d_out.shard == d_in.shard
        offs = d_in.block_offsets(2)
        picked = range(9)[s]
        want = tuple(sum(1 for i in picked if offs[c] <= i < offs[c + 1])
                     for c in range(len(offs) - 1))
        assert d_out.block_sizes(2) == want
        assert y.to_local()._base is not None or y.to_local().numel() == 0  # a view, no copy


@pytest.mark.parametrize("case,dtype", COMBOS, ids=COMBO_IDS)
def test_advanced_index_on_unsharded_dims(case, dtype):
    check(lambda x: x[torch.tensor([1, 0, 1])], case, dtype)
    check(lambda x: x[:, torch.tensor([True, False, True, True, False])]
          if case[0] < 3 else x[torch.tensor([False, True])], case, dtype)


def test_advanced_index_on_sharded_dims_is_refused():
    for case in CASES:
        x = sharded(case)
        raises_on_every_rank(dp.UnsupportedOpError, ["Tensor.__getitem__", "dim 2"],
                             lambda x=x: x[:, :, torch.tensor([0, 3])])
        raises_on_every_rank(dp.UnsupportedOpError, ["sharded dims [2]"], lambda x=x: x[:, :, [1, 2]])
        raises_on_every_rank(dp.UnsupportedOpError, ["Tensor.__getitem__"],
                             lambda x=x: x[torch.ones(2, 5, dtype=torch.bool)])
        raises_on_every_rank(dp.UnsupportedOpError, ["Tensor.__getitem__"], lambda x=x: x[x > 0])


# -- assignment ---------------------------------------------------------------------------------
def _set_scalar(x):
    y = x * 1
    y[:, 1:4, 2:8:3] = 0.5
    y[0, :, 4] = -1.0
    return y


def _set_domain_value(x):
    y = x.cos()
    y[:, :, 2:5] = x[:, :, 0:3] * 2          # other block boundaries: a repartition
    y[..., 3] = x[..., 1].exp()
    return y


def _set_mask(x):
    y = x * 3
    y[x > 0.2] = 0.0
    return y


class SetParam(torch.nn.Module):
    """A replicated parameter written into a region cut by the blocks: its gradient
    is assembled from the blocks that hold a part of the region."""

    def __init__(self):
        super().__init__()
        self.v = torch.nn.Parameter(torch.linspace(-2, 2, 3 * 4, dtype=torch.float64)
                                    .reshape(3, 4))
        self.w = torch.nn.Parameter(torch.tensor([1.5, -0.5, 2.0], dtype=torch.float64))

    def forward(self, x):
        y = x.sin()
        y[1, 1:4, 3:7, 2] = self.v.to(x.dtype)   # cut along dims 1 and 2, an int on dim 3
        y[:, 2, 5, 4:7] = self.w.to(x.dtype)     # broadcast over dim 0, ints on sharded dims
        return y


SETS = [_set_scalar, _set_domain_value, _set_mask, SetParam()]


@pytest.mark.parametrize("case,dtype", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("k", range(len(SETS)))
def test_setitem_matches_one_process(k, case, dtype):
    check(SETS[k], case, dtype)


def test_setitem_with_index_tensor_is_refused():
    for case in CASES:
        x = sharded(case).detach()
        raises_on_every_rank(dp.UnsupportedOpError, ["Tensor.__setitem__"],
                             lambda x=x: x.__setitem__((slice(None), [0, 1]), 1.0))


# -- split / chunk / unbind ------------------------------------------------------------------------
def _weighted(pieces, dim, join=torch.cat):
    """Pieces re-joined with a different weight each, so a piece out of place shows."""
    return join([p * (i + 1) for i, p in enumerate(pieces)], dim)


SPLITS = [
    lambda x: _weighted(x.split(4, 2), 2),                        # sharded dim (grid1..3)
    lambda x: _weighted(torch.split(x, [1, 5, 0, 3], dim=2), 2),  # explicit sizes, an empty one
    lambda x: _weighted(x.chunk(3, dim=3), 3),                    # sharded on grid2, grid3
    lambda x: _weighted(torch.tensor_split(x, (1, 6), 2), 2),
    lambda x: _weighted(x.chunk(2, 0), 0),                        # unsharded dim: local
    lambda x: _weighted(x.unbind(1), 1, torch.stack),             # sharded on grid3
    lambda x: _weighted(torch.unbind(x, dim=3), 3, torch.stack),
]


@pytest.mark.parametrize("case,dtype", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("k", range(len(SPLITS)))
def test_split_chunk_unbind_match_one_process(k, case, dtype):
    check(SPLITS[k], case, dtype)


# -- flip / roll ----------------------------------------------------------------------------------
FLIPS = [
    lambda x: x.flip(2),
    lambda x: torch.flip(x, (1, 2, 3)),
    lambda x: x.flip(0, -1) * x,             # flipped layout meets the original: repartition
    lambda x: x.roll(3, 2),
    lambda x: torch.roll(x, (-2, 5, 1), (1, 2, 3)),
    lambda x: x.roll((1, 9), (0, 2)),        # a full turn along dim 2
]


@pytest.mark.parametrize("case,dtype", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("k", range(len(FLIPS)))
def test_flip_roll_match_one_process(k, case, dtype):
    check(FLIPS[k], case, dtype)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_flip_reverses_block_sizes_and_roll_keeps_the_layout(case):
    x = sharded(case)
    y = x.flip(2)
    assert y.decomposition.block_sizes(2) == tuple(reversed(x.decomposition.block_sizes(2)))
    assert torch.roll(x, 4, 2).decomposition == x.decomposition


def test_roll_without_dims_is_refused_on_sharded_tensors():
    for case in CASES:
        x = sharded(case)
        raises_on_every_rank(dp.UnsupportedOpError, ["torch.roll", "dim 2"],
                             lambda x=x: torch.roll(x, 3))


@pytest.mark.parametrize("case,dtype", COMBOS, ids=COMBO_IDS)
def test_mirror_exchange_adjoint(case, dtype):
    """<M x, y> == <x, M* y> for the primitive itself (backward = the same
    exchange with shapes swapped) and for flip along every sharded dim."""
    x = sharded(case, dtype).detach()
    dec = x.decomposition
    for d, axis in dec.shard.items():
        sizes = {k: dec.block_sizes(k) for k in dec.shard}
        sizes[d] = tuple(reversed(sizes[d]))
        out = lay.derive(dec, dec.global_shape, dec.shard, sizes)
        comm = dec.grid.axis_comm(axis)

        def mirror(t, out=out, comm=comm):
            return dp.DomainTensor(ag.mirror(t.to_local(), comm, out.local_shape()), out)

        adjoint_test(mirror, x)
        adjoint_test(lambda t, d=d: t.flip(d), x)


REPLICATED = [CatParam(), SetParam(), lambda x: x.flip(2), lambda x: x[:, :, 3],
              lambda x: x.roll(2, 2), lambda x: torch.cat([x, x[:, :, 1:4]], 2)]


@pytest.mark.parametrize("kind", ["even", "zero"])
@pytest.mark.parametrize("k", range(len(REPLICATED)))
def test_with_a_replicated_grid_axis(k, kind):
    """Grid axis 1 cuts no dim: its ranks hold replicas, which must neither send
    twice nor double a gradient."""
    grid, shard, sizes = layout(SHAPE, (2,), 2, kind)
    assert_matches_single_process(REPLICATED[k], global_tensor(SHAPE), grid, shard, sizes=sizes)
