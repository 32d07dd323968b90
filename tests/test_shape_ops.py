"""Shape ops on DomainTensors (domainpar/ops/shape.py) against one process on the
whole tensor: dim reorderings, squeeze/unsqueeze, expand, and view/reshape/
flatten/unflatten with merges and splits of sharded dims, on 1-, 2- and 3-D
grids with even, uneven and zero-size blocks; the refusals on every rank."""

import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.comm.decomposition import Decomposition, balanced_sizes
from domainpar.testing import assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import CASES, DTYPES, SIZE, global_tensor, layout

pytestmark = pytest.mark.mpi

CASE_IDS = [f"grid{g}-{k}" for g, k in CASES]


def check(fns, shape, shard_dims, case, dtype):
    """Each of ``fns`` on a ``shape`` tensor cut along ``shard_dims`` (the first
    grid-ndim of them) matches one process: output, and input gradient of
    sum(out * w). One layout (and grid) for all of them."""
    grid_ndim, kind = case
    grid, shard, sizes = layout(shape, shard_dims, grid_ndim, kind)
    for i, fn in enumerate(fns if isinstance(fns, (list, tuple)) else [fns]):
        x = global_tensor(shape, dtype, seed=i)
        assert_matches_single_process(fn, x, grid, shard, sizes=sizes)


def sharded(shape, shard, sizes=None, dtype=torch.float64, grid_ndim=None):
    """A DomainTensor of the global random tensor ``shape`` on a grid with one axis
    per entry of ``shard``."""
    grid = dp.ProcessGrid(MPI.Compute_dims(SIZE, grid_ndim or max(len(shard), 1)))
    return shard_like(global_tensor(shape, dtype), grid, shard, sizes, requires_grad=True)


# -- dim reorderings ---------------------------------------------------------------------------
# Chains: each exercises several forms; the oracle checks the composite.
REORDERS = [
    lambda x: x.permute(2, 0, 1).sin(),
    lambda x: torch.transpose(x, -1, 1).swapaxes(0, 1).exp(),
    lambda x: torch.swapdims(x, 2, 0).movedim(0, -1).sin() * torch.permute(x, (1, 0, 2)),
    lambda x: torch.movedim(x, (0, 1), (2, 0)).moveaxis(-1, 0).sin(),
    lambda x: x.mT.sin() + x.mH.cos() + torch.transpose(x, 1, 2),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reorderings(case, dtype):
    check(REORDERS, (5, 4, 6), (0, 1, 2), case, dtype)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_matrix_transposes(case):
    check([lambda x: x.T.sin() + x.t() * 3 + torch.t(x).cos(),
           lambda x: x.H.sin() * torch.adjoint(x)], (7, 5), (1, 0), case, torch.float64)


def test_reordering_keeps_block_sizes():
    x = sharded((6, 4, 5), {0: 0, 2: 1}, grid_ndim=2)
    y = x.permute(2, 0, 1)
    assert y.shape == (5, 6, 4)
    assert y.decomposition.shard == {1: 0, 0: 1} or y.decomposition.shard == {0: 1, 1: 0}
    assert y.decomposition.block_sizes(1) == x.decomposition.block_sizes(0)
    assert y.decomposition.block_sizes(0) == x.decomposition.block_sizes(2)
    assert y.to_local().shape == y.decomposition.local_shape()


# -- squeeze / unsqueeze -----------------------------------------------------------------------
SQUEEZES = [
    lambda x: x.squeeze(1).sin(),
    lambda x: x.squeeze().sin(),
    lambda x: torch.squeeze(x, (1, 3)).unsqueeze(0).sin(),
    lambda x: x.squeeze(0).squeeze(-1) * 2,  # dim 0 is not size 1: a no-op
    lambda x: torch.unsqueeze(x, -1).unsqueeze(2).squeeze(2).unsqueeze(1).sin(),
]

# "size1" cuts dims of global size 1 (blocks of 1 and 0 rows) that are squeezed or expanded.
SQUEEZE_LAYOUTS = [((0, 2, 1), torch.float64), ((0, 2, 1), torch.float32),
                   ((1, 0, 3), torch.float64)]
LAYOUT_IDS = ["wide-f64", "wide-f32", "size1-f64"]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("shard_dims,dtype", SQUEEZE_LAYOUTS, ids=LAYOUT_IDS)
def test_squeeze_unsqueeze(case, dtype, shard_dims):
    check(SQUEEZES, (5, 1, 4, 1), shard_dims, case, dtype)


def test_squeeze_only_global_size_one_dims():
    # A block of one row along a dim of global size 3 must not be squeezed.
    grid = dp.ProcessGrid((SIZE,))
    sizes = [1] * (SIZE - 1) + [2]
    x = shard_like(global_tensor((SIZE + 1, 2, 1)), grid, {0: 0}, {0: sizes})
    y = x.squeeze()
    assert y.shape == (SIZE + 1, 2) and y.to_local().shape == (sizes[grid.rank], 2)


# -- expand ------------------------------------------------------------------------------------
EXPANDS = [
    lambda x: x.expand(5, 3, 4).sin(),
    lambda x: x.expand(2, -1, 3, -1).sin() + x.expand(5, 1, 4),
    lambda x: torch.broadcast_to(x, (5, 2, 4)).sin() * x.expand_as(torch.empty(3, 5, 2, 4)),
]
EXPAND_LAYOUTS = [((0, 2), torch.float64), ((0, 2), torch.float32), ((2, 1, 0), torch.float64)]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("shard_dims,dtype", EXPAND_LAYOUTS, ids=LAYOUT_IDS)
def test_expand(case, dtype, shard_dims):
    check(EXPANDS, (5, 1, 4), shard_dims, case, dtype)


# -- view / reshape ----------------------------------------------------------------------------
RESHAPES = [
    # merges whose sharded dim is the outermost of its group: no communication
    lambda x: x.view(24, 5, 3).sin() + x.flatten(0, 1),
    lambda x: torch.flatten(x, 2).sin(),
    lambda x: x.reshape(1, 24, 1, 5, 3, 1).sin(),
    # splits and regroupings (dim 0's blocks may need repartitioning)
    lambda x: x.reshape(3, 2, 4, 5, 3).sin() + x.unflatten(0, (3, 2)),
    lambda x: x.reshape(2, 3, 2, 2, 15).sin(),
    lambda x: torch.reshape(x, (4, 6, 15)).sin(),
    # a sharded dim that is not the outermost of its group: reshape repartitions
    lambda x: x.reshape(6, 20, 3).sin(),
    # reshapes after a reordering (the block is not contiguous)
    lambda x: x.permute(1, 0, 2, 3).reshape(4, 6, 15).sin() + x.transpose(0, 1).reshape(4, 6, 15),
    lambda x: x.reshape_as(torch.empty(6, 20, 3)).sin(),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reshapes(case, dtype):
    # dims 0 and 2 cut (a 3-D grid replicates along its third axis)
    check(RESHAPES, (6, 4, 5, 3), (0, 2), case, dtype)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reshapes_three_sharded_dims(case):
    check([lambda x: x.view(24, 5, 3).sin() + x.unflatten(0, (2, 3)).reshape(24, 5, 3),
           lambda x: x.reshape(2, 3, 2, 2, 5, 3).sin(),
           lambda x: x.reshape(6, 4, 5, 1, 3).sin()], (6, 4, 5, 3), (0, 2, 3), case, torch.float64)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_flatten_inner_sharded_dim(case):
    # one sharded dim, not the outermost: reshape repartitions onto dim 0
    check([lambda x: x.flatten().sin() + x.ravel(), lambda x: x.reshape(-1, 3).sin(),
           lambda x: x.reshape(6, -1).sin()], (6, 4, 5, 3), (2,), case, torch.float64)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reshapes_other_sharded_dims(case):
    # dim 1 sharded (not outermost of a merge with dim 0), dim 3 merged as the inner dim
    check([lambda x: x.reshape(24, 15).sin() + x.flatten(0, 1).flatten(1),
           lambda x: x.reshape(6, 4, 15).sin(),
           lambda x: x.unflatten(1, (2, 2)).sin()], (6, 4, 5, 3), (1, 3), case, torch.float64)


def _dec(shape, shard, sizes, grid_ndim=1):
    grid = dp.ProcessGrid(MPI.Compute_dims(SIZE, grid_ndim))
    return grid, Decomposition(shape, grid, shard, sizes)


def test_merge_keeps_blocks_and_scales_sizes():
    # (B, C, H, W) with H cut unevenly: view(B, C, H * W) cuts dim 2 into blocks s_i * W
    sizes = [2 * (i + 1) for i in range(SIZE)]
    h = sum(sizes)
    x = sharded((2, 3, h, 5), {2: 0}, {2: sizes})
    y = x.view(2, 3, h * 5)
    assert y.decomposition.shard == {2: 0}
    assert y.decomposition.block_sizes(2) == tuple(5 * s for s in sizes)
    assert y.to_local().data_ptr() == x.to_local().data_ptr()  # a view of the block
    assert torch.equal(y.full_tensor(), x.full_tensor().view(2, 3, h * 5))


def test_split_view_when_blocks_divide():
    sizes = [4 * (i % 2) + 4 for i in range(SIZE)]  # 4, 8, 4, 8 ...: multiples of 4
    n = sum(sizes)
    x = sharded((n, 3), {0: 0}, {0: sizes})
    y = x.view(n // 4, 4, 3)
    assert y.decomposition.block_sizes(0) == tuple(s // 4 for s in sizes)
    assert torch.equal(y.full_tensor(), x.full_tensor().view(n // 4, 4, 3))
    assert_matches_single_process(lambda t: t.view(n // 4, 4, 3).sin(), global_tensor((n, 3)),
                                  x.grid, {0: 0}, sizes={0: sizes})


def test_split_view_and_reshape_repartition():
    # blocks of 3 rows cannot be cut into whole (.., 2) rows: view and reshape move data
    # (a view that repartitioned refuses writes: tests/test_view_repartition.py)
    n = 3 * SIZE + (1 if SIZE % 2 else 0)  # even, so the split exists
    sizes = [3] * SIZE
    sizes[0] += n - 3 * SIZE
    x = sharded((n, 5), {0: 0}, {0: sizes})
    for y in (x.reshape(n // 2, 2, 5), x.view(n // 2, 2, 5)):
        assert sum(y.decomposition.block_sizes(0)) == n // 2
    for fn in (lambda t: t.reshape(n // 2, 2, 5).sin(), lambda t: t.view(n // 2, 2, 5).sin()):
        assert_matches_single_process(fn, global_tensor((n, 5)), x.grid, {0: 0},
                                      sizes={0: sizes})


def test_view_of_non_contiguous_blocks_copies_on_every_rank():
    # Empty blocks view where full ones cannot: every rank must take the same path.
    grid, shard, sizes = layout((6, 4, 5), (0,), 1, "zero")
    x = shard_like(global_tensor((6, 4, 5)), grid, shard, sizes)
    y = x.transpose(1, 2).view(6, 20)
    assert torch.equal(y.full_tensor(), global_tensor((6, 4, 5)).transpose(1, 2).reshape(6, 20))


def test_view_merge_with_inner_sharded_dim_repartitions():
    # dim 1 is cut but dim 0 is the outermost of the merge: the cut moves onto dim 0
    x = sharded((4, 6, 5), {1: 0})
    y = x.view(24, 5)
    assert y.decomposition.shard == {0: 0}
    assert y.decomposition.block_sizes(0) == tuple(6 * b for b in balanced_sizes(4, SIZE))
    assert torch.equal(y.full_tensor(), global_tensor((4, 6, 5)).view(24, 5))
    assert_matches_single_process(lambda t: t.view(24, 5).sin(), global_tensor((4, 6, 5)),
                                  x.grid, {1: 0})


def test_regroup_that_would_gather_onto_one_rank_refused():
    # (2, 3) cut on dim 0 -> (3, 2): whole rows of 2 are the unit and there is only one
    x = sharded((2, 3), {0: 0})
    if SIZE > 1:
        raises_on_every_rank(dp.UnsupportedOpError, ["Tensor.reshape", "one rank"],
                             lambda: x.reshape(3, 2))
    else:
        assert x.reshape(3, 2).shape == (3, 2)


def test_in_place_shape_changes_refused():
    x = sharded((4, 1, 3), {0: 0})
    for fn in (lambda: x.squeeze_(1), lambda: x.unsqueeze_(0), lambda: x.transpose_(0, 2),
               lambda: x.as_strided((4, 3), (3, 1))):
        raises_on_every_rank(dp.UnsupportedOpError, ["out-of-place", "(4, 1, 3)"], fn)


def test_view_dtype():
    x = sharded((6, 4), {0: 0}, dtype=torch.float64)
    y = x.detach().view(torch.int64)
    assert y.decomposition == x.decomposition and y.dtype == torch.int64
    z = x.detach().float().view(torch.int16)
    assert z.shape == (6, 8)
    raises_on_every_rank(dp.UnsupportedOpError, ["last dim"],
                         lambda: sharded((6, 4), {1: 0}).detach().view(torch.int16))


def test_empty_tensor_reshape():
    grid_case = CASES[2]  # 1-D grid, zero-size blocks
    check(lambda x: x.reshape(0, 4).sin(), (4, 0), (0,), grid_case, torch.float64)


# -- results used afterwards: reductions and gradients -----------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_shape_ops_then_reduction(case, dtype):
    check([lambda x: (x.reshape(6, 20, 3).sin() ** 2).sum() + x.flatten(0, 1).exp().sum(),
           lambda x: (x.reshape(24, 5, 3).cos() * x.transpose(0, 1).reshape(24, 5, 3)).sum(),
           lambda x: x.unsqueeze(0).expand(2, -1, -1, -1, -1).sin().sum(dim=0)
           + x.movedim(0, -1).reshape(4, 5, 18).square().sum()],
          (6, 4, 5, 3), (0, 2), case, dtype)
