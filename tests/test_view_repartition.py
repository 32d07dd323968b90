"""``view`` that needs its blocks repartitioned first (domainpar/ops/shape.py):
Swin's window partition ``x.view(B, D // ws, ws, ...)`` on blocks that do not
hold whole windows (a dim of 32 cut 11/11/10 into windows of 4), and the window
reverse, against one process with gradients, on 1-, 2- and 3-D grids with even,
uneven and zero-size blocks. Such a view is a copy of the blocks, so a write
through it (or through anything sharing its data) is refused on every rank."""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import domainpar as dp
from domainpar.testing import assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import CASES, SIZE, global_tensor, layout

pytestmark = pytest.mark.mpi

CASE_IDS = [f"grid{g}-{k}" for g, k in CASES]
WS = 4
SHAPE = (2, 20, 12, 8, 3)  # (B, D, H, W, C): 5 x 3 x 2 windows of 4^3


# -- MONAI's window partition and reverse (monai/networks/nets/swin_unetr.py), verbatim -----------
def window_partition(x, window_size):
    b, d, h, w, c = x.shape
    x = x.view(b, d // window_size[0], window_size[0], h // window_size[1], window_size[1],
               w // window_size[2], window_size[2], c)
    return x.permute(0, 1, 3, 5, 2, 4, 6, 7).contiguous().view(
        -1, window_size[0] * window_size[1] * window_size[2], c)


def window_reverse(windows, window_size, dims):
    b, d, h, w = dims
    x = windows.view(b, d // window_size[0], h // window_size[1], w // window_size[2],
                     window_size[0], window_size[1], window_size[2], -1)
    return x.permute(0, 1, 4, 2, 5, 3, 6, 7).contiguous().view(b, d, h, w, -1)


def window_mix(windows):
    """A per-window op that mixes a window's tokens (attention-like)."""
    scores = torch.einsum("wtc,wsc->wts", windows, windows).softmax(-1)
    return torch.einsum("wts,wsc->wtc", scores, windows.sin())


def swin_round_trip(x):
    b, d, h, w, _ = x.shape
    windows = window_partition(x, (WS, WS, WS))
    return window_reverse(window_mix(windows), (WS, WS, WS), (b, d, h, w)) * x


def split_round_trip(x):
    """The partition's split views and the reverse's merge, windows kept apart
    per dim (merging two sharded window dims into one is another matter)."""
    b, d, h, w, c = x.shape
    v = x.view(b, d // WS, WS, h // WS, WS, w // WS, WS, c).permute(0, 1, 3, 5, 2, 4, 6, 7)
    mixed = v.softmax(dim=4) * v.sum(dim=(4, 5, 6), keepdim=True).cos()
    return mixed.permute(0, 1, 4, 2, 5, 3, 6, 7).contiguous().view(b, d, h, w, c)


def check(fn, shape, shard_dims, case):
    grid, shard, sizes = layout(shape, shard_dims, *case)
    assert_matches_single_process(fn, global_tensor(shape), grid, shard, sizes=sizes)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_split_views_round_trip(case):
    # D, H, W cut along grid axes 0, 1, 2: each split view repartitions its own dim
    check(split_round_trip, SHAPE, (1, 2, 3), case)


@pytest.mark.parametrize("kind", ("even", "uneven", "zero"))
def test_monai_window_partition_round_trip(kind):
    # B = 2: the partition's last view merges (B, nD, nH, nW) and moves the cut onto B
    check(swin_round_trip, SHAPE, (1,), (1, kind))


@pytest.mark.parametrize("kind", ("even", "uneven", "zero"))
def test_monai_window_partition_batch_one(kind):
    check(swin_round_trip, (1,) + SHAPE[1:], (1,), (1, kind))


def test_monai_window_partition_on_2d_grid_h_whole():
    # a 2-D grid whose second axis cuts the channels: the windows stay on one cut dim
    check(swin_round_trip, (1, 20, 8, 4, 4), (1, 4), (2, "uneven"))


def test_blocks_of_11_11_10_become_whole_windows():
    # 32 rows cut 11/11/10 (balanced on 3 ranks): 8 windows of 4 -> 3/3/2 windows
    grid = dp.ProcessGrid((SIZE,))
    x = shard_like(global_tensor((1, 32, 3)), grid, {1: 0})
    y = x.view(1, 8, 4, 3)
    windows = {1: (8,), 2: (4, 4), 3: (3, 3, 2), 4: (2, 2, 2, 2)}[SIZE]
    assert y.decomposition.shard == {1: 0}
    assert y.decomposition.block_sizes(1) == windows
    assert torch.equal(y.full_tensor(), global_tensor((1, 32, 3)).view(1, 8, 4, 3))
    back = y.view(1, 32, 3)  # a merge of the cut windows dim with a whole dim: local
    assert back.decomposition.block_sizes(1) == tuple(4 * n for n in windows)
    assert back.to_local().data_ptr() == y.to_local().data_ptr()


def test_empty_tensor_window_view():
    check(lambda x: x.view(0, 5, 4, 3).sin(), (0, 20, 3), (1,), (1, "uneven"))


def test_views_that_need_no_repartition_still_share_blocks():
    # blocks of 8 rows: whole windows, so the view is a view of the block, writable
    grid = dp.ProcessGrid((SIZE,))
    x = shard_like(global_tensor((8 * SIZE, 3)), grid, {0: 0})
    y = x.view(2 * SIZE, 4, 3)
    assert y.to_local().data_ptr() == x.to_local().data_ptr()
    y.mul_(2)
    assert torch.equal(x.full_tensor(), 2 * global_tensor((8 * SIZE, 3)))


# -- writes through a view that is a copy: refused on every rank ---------------------------------
def _copied_view():
    """(x, y): y = x.view(...) that repartitions on every rank count above 1."""
    grid = dp.ProcessGrid((SIZE,))
    sizes = [4] * SIZE
    if SIZE > 1:  # blocks of 5, 4 ..., 3 rows: not whole windows of 4
        sizes[0], sizes[-1] = 5, 3
    x = shard_like(global_tensor((4 * SIZE, 3)), grid, {0: 0}, {0: sizes})
    return x, x.view(SIZE, 4, 3)


WRITES = {
    "add_": lambda x, y: y.add_(1),
    "iadd": lambda x, y: y.__iadd__(1),
    "setitem": lambda x, y: y.__setitem__((slice(None), 0), 0.0),
    "copy_": lambda x, y: y.copy_(y.detach() * 2),
    "relu_inplace": lambda x, y: F.relu(y, inplace=True),
    "dropout_positional": lambda x, y: F.dropout(y, 0.5, False, True),
    "base_mul_": lambda x, y: x.mul_(2),
    "base_setitem": lambda x, y: x.__setitem__(0, 1.0),
    "alias_of_view": lambda x, y: y.permute(1, 0, 2)[0].zero_(),
    "detached_view": lambda x, y: y.detach().fill_(0),
    "data_of_view": lambda x, y: y.data.zero_(),
    "alias_of_base": lambda x, y: x.t().view(3, -1).sub_(1),
}


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
def test_write_through_copied_view_refused(write):
    if SIZE == 1:
        pytest.skip("needs 2 ranks (one block holds whole windows: no repartition)")
    x, y = _copied_view()
    raises_on_every_rank(dp.UnsupportedOpError, ["repartition", "clone()"],
                         lambda: WRITES[write](x, y))


def test_copied_view_out_of_place_and_clone_are_fine():
    x, y = _copied_view()
    z = y.clone()
    z.add_(1)
    w = y + 1
    w.mul_(2)
    ref = global_tensor(x.shape).view(y.shape)
    assert torch.equal(z.full_tensor(), ref + 1)
    assert torch.equal(w.full_tensor(), (ref + 1) * 2)
    x.requires_grad_(True)  # autograd state is not a write
    assert torch.equal(x.full_tensor(), global_tensor(x.shape))


def test_gather_onto_one_rank_still_refused():
    # (2, 3) cut on dim 0 viewed as (3, 2): rows of 2 are the unit and there is one
    grid = dp.ProcessGrid((SIZE,))
    x = shard_like(global_tensor((2, 3)), grid, {0: 0})
    if SIZE > 1:
        raises_on_every_rank(dp.UnsupportedOpError, ["Tensor.view", "one rank"],
                             lambda: x.view(3, 2))
    else:
        assert x.view(3, 2).shape == (3, 2)


# -- layouts aligned to whole windows: the view needs no repartition -------------------------------
def test_aligned_sizes():
    from domainpar.comm.decomposition import aligned_sizes
    assert aligned_sizes(32, 3, 4) == (12, 12, 8)
    assert aligned_sizes(32, 1, 4) == (32,)
    assert aligned_sizes(8, 4, 4) == (4, 4, 0, 0)
    assert aligned_sizes(10, 2, 4) == (4, 6)  # the 2 rows left over go to the last block
    assert aligned_sizes(0, 3, 4) == (0, 0, 0)
    assert aligned_sizes(7, 3, 1) == (3, 2, 2)


@pytest.mark.parametrize("grid_ndim", (1, 2))
def test_scatter_aligned_to_windows_views_blocks(grid_ndim):
    grid = dp.ProcessGrid(MPI.Compute_dims(SIZE, grid_ndim))
    shard = {1: 0, 2: 1} if grid_ndim == 2 else {1: 0}
    t = global_tensor((1, 32, 12, 3))
    x = dp.scatter(t, grid, shard, align={1: 4, 2: 4} if grid_ndim == 2 else {1: 4})
    assert all(s % 4 == 0 for d in shard for s in x.decomposition.block_sizes(d))
    y = x.view(1, 8, 4, 3, 4, 3)
    assert y.to_local().data_ptr() == x.to_local().data_ptr() or x.to_local().numel() == 0
    assert torch.equal(y.full_tensor(), t.view(1, 8, 4, 3, 4, 3))
    y.mul_(2)  # a true view: the write reaches x, as in one process
    assert torch.equal(x.full_tensor(), 2 * t)
    assert_matches_single_process(swin_round_trip_2d, t, grid, shard,
                                  sizes={d: x.decomposition.block_sizes(d) for d in shard})


def swin_round_trip_2d(x):
    b, h, w, c = x.shape
    v = x.view(b, h // WS, WS, w // WS, WS, c).permute(0, 1, 3, 2, 4, 5)
    mixed = v.softmax(dim=3) * v.sum(dim=(3, 4), keepdim=True).sin()
    return mixed.permute(0, 1, 3, 2, 4, 5).contiguous().view(b, h, w, c)


def test_align_errors_on_every_rank():
    grid = dp.ProcessGrid((SIZE,))
    t = global_tensor((8, 3))
    for align, words in (({1: 4}, "not sharded"), ({0: 0}, "positive integer"),
                         ({0: 2.5}, "positive integer")):
        with pytest.raises(dp.LayoutError, match=words):
            dp.scatter(t, grid, {0: 0}, align=align)
    with pytest.raises(dp.LayoutError, match="both sizes and align"):
        dp.Decomposition((8, 3), grid, {0: 0}, {0: [8] + [0] * (SIZE - 1)}, align={0: 4})
