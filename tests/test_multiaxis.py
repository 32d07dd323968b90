"""A tensor dim cut over several grid axes (issue 18, item 1): Decomposition's
``shard={d: (a, b)}`` on ``ProcessGrid.merged``, the repartition between a grid
and its merged grids (dot-product adjoint test), and the rules that use it
against one process: reshape/view/flatten merging cut dims and splitting them
back (ops/shape.py), and FFTs whose transform dims hold every grid axis
(ops/fft.py). Grids of 1-4 ranks with 1-3 axes; even, uneven and zero-size
blocks. The model zoo's 2x2 rows (UNETR, SwinUNETR, FNO, TFNO) are
tests/test_model_zoo.py's."""
import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar import autograd as ag
from domainpar.comm.decomposition import Decomposition
from domainpar.testing import (
    adjoint_test,
    assert_matches_single_process,
    block_sizes,
    check_on_every_rank,
    raises_on_every_rank,
    shard_like,
)
from tensor_cases import SIZE, global_tensor

pytestmark = pytest.mark.mpi

# Grids that exist on this many ranks, 2-D and 3-D (1-D grids have one axis to cut).
GRIDS = {1: [(1, 1), (1, 1, 1)], 2: [(2, 1), (1, 2), (1, 2, 1)],
         3: [(3, 1), (1, 3), (1, 1, 3)], 4: [(2, 2), (4, 1), (2, 2, 1), (2, 1, 2)]}[SIZE]
KINDS = ("even", "uneven", "zero")
CASES = [(g, k) for g in GRIDS for k in KINDS]
IDS = [f"grid{'x'.join(map(str, g))}-{k}" for g, k in CASES]


def _two_axes(dims):
    """The two grid axes the tests cut over: the first two of more than one
    process (axes of one process where there are not enough)."""
    wide = [a for a, n in enumerate(dims) if n > 1]
    rest = [a for a in range(len(dims)) if a not in wide]
    return tuple((wide + rest)[:2])


def _layout(shape, dims, cut, kind, seed=0):
    """(grid, shard, sizes): dims ``cut`` of ``shape`` cut along ``_two_axes``."""
    grid = dp.ProcessGrid(dims)
    axes = _two_axes(dims)
    shard = dict(zip(cut, axes))
    sizes = {d: s for d, a in shard.items()
             if (s := block_sizes(shape[d], dims[a], kind, seed)) is not None}
    return grid, shard, sizes or None


# -- the decomposition ---------------------------------------------------------------------------
@pytest.mark.parametrize("dims", GRIDS + [(SIZE,)], ids=str)
@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_blocks_follow_row_major_order_of_the_axes(dims, order):
    grid = dp.ProcessGrid(dims)
    axes = tuple(range(len(dims)))[::(1 if order == "forward" else -1)]
    n = 3 * SIZE + 1
    dec = Decomposition((2, n, 3), grid, {1: axes})
    assert dec.grid.root is grid
    # this process's block: its row-major position over ``axes`` among the grid's
    position = 0
    for a in axes:
        position = position * dims[a] + grid.coords[a]
    parts = [n // SIZE + (c < n % SIZE) for c in range(SIZE)]
    start = sum(parts[:position])
    check_on_every_rank(dec.local_slices()[1] == slice(start, start + parts[position]),
                        f"{dec.local_slices()} at position {position}")
    check_on_every_rank(dec.local_shape() == (2, parts[position], 3))


def test_axes_of_one_process_shard_nothing():
    grid = dp.ProcessGrid((SIZE, 1))
    dec = Decomposition((5, 7), grid, {0: (0, 1)})
    assert dec.grid is grid and dec.shard == {0: 0}
    assert dec == Decomposition((5, 7), grid, {0: 0})


def test_given_sizes_along_a_multi_axis_dim():
    grid = dp.ProcessGrid(GRIDS[0])
    sizes = [0] * (SIZE - 1) + [9] if SIZE > 1 else [9]
    dec = Decomposition((9, 2), grid, {0: (0, 1)}, {0: sizes})
    assert dec.block_sizes(0) == tuple(sizes)
    assert sum(dec.local_shape(r)[0] for r in range(SIZE)) == 9


@pytest.mark.parametrize("shard,sizes,match", [
    ({0: (0, 1), 1: (0,)}, None, "grid axis 0"),
    ({0: (0, 0)}, None, "one twice"),
    ({0: (0, 5)}, None, "axes"),
    ({0: ()}, None, "no grid axis"),
    ({0: (0, 1)}, {0: [4, 5, 0, 0, 0]}, "entries"),
])
def test_bad_multi_axis_shard_raises_on_every_rank(shard, sizes, match):
    grid = dp.ProcessGrid(GRIDS[0])
    raises_on_every_rank(dp.LayoutError, match,
                         lambda: Decomposition((9, 4), grid, shard, sizes))


# -- the repartition and its adjoint ------------------------------------------------------------
@pytest.mark.parametrize("dims,kind", CASES, ids=IDS)
def test_repartition_to_and_from_a_merged_grid_adjoint(dims, kind):
    shape = (2, 7, 5)
    grid, shard, sizes = _layout(shape, dims, (1, 2), kind)
    src = Decomposition(shape, grid, shard, sizes)
    axes = _two_axes(dims)
    for dst in (Decomposition(shape, grid, {2: axes}),
                Decomposition(shape, grid, {1: axes[::-1]},
                              {1: block_sizes(7, SIZE, kind, seed=3) or [7 // SIZE] * (SIZE - 1)
                               + [7 - 7 // SIZE * (SIZE - 1)]})):
        x = global_tensor(shape, seed=1)[src.local_slices()].clone()
        f = lambda t, a=src, b=dst: ag.Repartition.apply(t, a, b)  # noqa: E731
        adjoint_test(f, x, x_space=src, y_space=dst)
        adjoint_test(lambda t, a=src, b=dst: ag.Repartition.apply(t, b, a), f(x),
                     x_space=dst, y_space=src)
        moved = f(x)
        check_on_every_rank(torch.equal(moved, global_tensor(shape, seed=1)[dst.local_slices()]))
        check_on_every_rank(torch.equal(ag.Repartition.apply(moved, dst, src), x))


def test_scatter_and_redistribute_over_several_axes():
    dims = GRIDS[0]
    grid = dp.ProcessGrid(dims)
    t = global_tensor((3, 10, 4))
    src = SIZE - 1  # a rank whose number differs on the reversed merged grid
    x = dp.scatter(t if grid.rank == src else None, grid, {1: (1, 0)}, src=src)
    assert torch.equal(x.full_tensor(), t)
    y = x.redistribute({1: 0, 2: 1})
    assert y.decomposition.grid is grid and torch.equal(y.full_tensor(), t)
    z = y.redistribute({2: (0, 1)})
    assert torch.equal(z.full_tensor(), t)


def test_from_local_refuses_several_axes():
    grid = dp.ProcessGrid(GRIDS[0])
    raises_on_every_rank(dp.DomainparError, "several axes",
                         lambda: dp.DomainTensor.from_local(torch.zeros(2, 3), grid, {0: (0, 1)}))


# -- reshape, view, flatten: merging cut dims and splitting them back -----------------------------
def _tokens_and_back(x):
    """UNETR: a patch grid flattened into tokens, and the tokens viewed back."""
    b, c, h, w, d = x.shape
    t = x.flatten(2).transpose(1, 2) * 2
    return t.transpose(1, 2).reshape(b, c, h, w, d).sin() + x


def _windows_and_back(x):
    """Swin: a window partition (windows merged into a batch) and its reverse."""
    b, h, w, c = x.shape
    win = x.view(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, c)
    win = win.softmax(dim=1)
    back = win.view(b, h // 2, w // 2, 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
    return back * x


SHAPE_CASES = {
    "flatten": ((2, 3, 8, 6, 2), (2, 3), lambda x: x.flatten(2).sin()),
    "reshape (B, C, -1)": ((2, 3, 8, 6), (2, 3), lambda x: x.reshape(2, 3, -1).cos() * 3),
    "view regroup": ((4, 6, 3), (0, 1), lambda x: x.reshape(6, 4, 3).exp()),
    "tokens and back": ((1, 3, 8, 6, 2), (2, 3), _tokens_and_back),
    "windows and back": ((1, 8, 6, 3), (1, 2), _windows_and_back),
}


@pytest.mark.parametrize("name", SHAPE_CASES)
@pytest.mark.parametrize("dims,kind", CASES, ids=IDS)
def test_merging_cut_dims_matches_one_process(dims, kind, name):
    shape, cut, fn = SHAPE_CASES[name]
    grid, shard, sizes = _layout(shape, dims, cut, kind)
    assert_matches_single_process(fn, global_tensor(shape), grid, shard, sizes=sizes)


@pytest.mark.parametrize("dims,kind", CASES, ids=IDS)
def test_splitting_a_multi_axis_dim_matches_one_process(dims, kind):
    shape = (2, 24, 3)
    axes = _two_axes(dims)
    grid = dp.ProcessGrid(dims)
    sizes = block_sizes(24, SIZE, kind)
    fns = [lambda x: x.view(2, 4, 6, 3).sin(), lambda x: x.unflatten(1, (2, 3, 4)).cos(),
           lambda x: x.reshape(2, 6, 4, 3)[:, 1:].exp()]
    for fn in fns:
        assert_matches_single_process(fn, global_tensor(shape), grid, {1: axes},
                                      sizes={1: sizes} if sizes else None)


def test_split_goes_back_to_the_grid_the_user_made():
    if SIZE < 4:
        pytest.skip("needs 4 ranks (a 2x2 grid) for a merged grid")
    grid = dp.ProcessGrid((2, 2))
    x = shard_like(global_tensor((1, 3, 8, 6)), grid, {2: 0, 3: 1})
    tokens = x.flatten(2)
    assert tokens.decomposition.grid is grid.merged((0, 1))
    assert tokens.decomposition.shard == {2: 0} and tokens.decomposition.grid.dims == (4,)
    back = tokens.view(1, 3, 8, 6)
    assert back.decomposition.grid is grid and back.decomposition.shard == {2: 0, 3: 1}
    assert torch.equal(back.full_tensor(), global_tensor((1, 3, 8, 6)))


def test_float32_merge_as_close_as_one_process():
    shape, cut, fn = SHAPE_CASES["tokens and back"]
    grid, shard, sizes = _layout(shape, GRIDS[0], cut, "uneven")
    assert_matches_single_process(fn, global_tensor(shape, torch.float32), grid, shard,
                                  sizes=sizes)


def test_writes_into_a_merged_view_refused_on_every_rank():
    if SIZE < 4:
        pytest.skip("needs 4 ranks (a 2x2 grid): elsewhere the view needs no repartition")
    grid = dp.ProcessGrid((2, 2))
    x = shard_like(global_tensor((1, 8, 6, 3)), grid, {1: 0, 2: 1})
    v = x.view(1, 48, 3)
    raises_on_every_rank(dp.UnsupportedOpError, "copy", lambda: v.add_(1))
    raises_on_every_rank(dp.UnsupportedOpError, "copy", lambda: x.mul_(2))
    assert torch.equal(v.clone().add_(1).full_tensor(), global_tensor((1, 48, 3)) + 1)


def test_tensors_of_a_grid_and_its_merged_grid():
    """Elementwise ops repartition one operand onto the other; other rules refuse
    on every rank, naming both grids."""
    if SIZE < 4:
        pytest.skip("needs 4 ranks (a 2x2 grid) for a merged grid")
    grid = dp.ProcessGrid((2, 2))
    a, b = global_tensor((2, 8, 6)), global_tensor((2, 8, 6), seed=2)
    assert_matches_single_process(lambda x, y: x * y.sin() + y, (a, b), grid,
                                  [{1: 0, 2: 1}, {1: (0, 1)}])
    x, y = shard_like(a, grid, {1: 0, 2: 1}), shard_like(b, grid, {2: (1, 0)})
    raises_on_every_rank(dp.UnsupportedOpError, ["different process grids", "merged"],
                         lambda: torch.cat([x, y]))


# -- FFTs with no free dim ------------------------------------------------------------------------
FFT_2D = {  # rfft2 alone is irfft2's input; fft along dim 3 mirrors rfft along dim 2
    "irfft2 of rfft2": lambda x: torch.fft.irfft2(torch.fft.rfft2(x) * 1.5, s=x.shape[-2:]),
    "fft2": lambda x: torch.fft.fft2(x, norm="ortho").real,
    "rfftn padded": lambda x: torch.fft.rfftn(x, s=(14, 9), dim=(2, 3)).imag,
    "rfft of one dim": lambda x: torch.fft.rfft(x, dim=2).real,
}


@pytest.mark.parametrize("name", FFT_2D)
@pytest.mark.parametrize("dims,kind", CASES, ids=IDS)
def test_fft_over_every_grid_axis_matches_one_process(dims, kind, name):
    shape = (1, 1, 12, 10)
    grid, shard, sizes = _layout(shape, dims, (2, 3), kind)
    assert_matches_single_process(FFT_2D[name], global_tensor(shape), grid, shard, sizes=sizes)


@pytest.mark.parametrize("dims,kind", CASES, ids=IDS)
def test_fftn_3d_field_matches_one_process(dims, kind):
    shape = (1, 6, 8, 5)
    grid = dp.ProcessGrid(dims)
    shard = {d + 1: a for d, a in enumerate(range(len(dims)))}
    sizes = {d: s for d, a in shard.items()
             if (s := block_sizes(shape[d], dims[a], kind)) is not None}
    for fn in (lambda x: torch.fft.irfftn(torch.fft.rfftn(x, dim=(1, 2, 3)).conj().exp(),
                                          s=(6, 8, 5), dim=(1, 2, 3)),
               lambda x: torch.fft.fftn(x, dim=(1, 2, 3)).abs()):
        assert_matches_single_process(fn, global_tensor(shape), grid, shard, sizes=sizes or None)


def test_rfft2_comes_back_on_the_input_layout():
    dims = GRIDS[0]
    grid = dp.ProcessGrid(dims)
    x = shard_like(global_tensor((1, 1, 12, 10)), grid, {2: 0, 3: 1})
    y = torch.fft.rfft2(x)
    if MPI.COMM_WORLD.Get_size() == 4:  # 2x2: merged and back
        assert y.decomposition.grid is grid and y.decomposition.shard == {2: 0, 3: 1}
    z = torch.fft.irfft2(y, s=(12, 10))
    assert z.decomposition.grid is grid
    torch.testing.assert_close(z.full_tensor(), global_tensor((1, 1, 12, 10)))


def test_fft_still_refused_where_no_merge_helps():
    if SIZE < 2:
        pytest.skip("needs a cut dim (2 ranks or more)")
    grid = dp.ProcessGrid((SIZE,))
    x = shard_like(global_tensor((1, 1, 12)), grid, {2: 0})
    raises_on_every_rank(dp.UnsupportedOpError, ["torch.fft.fft", "no other dim"],
                         lambda: torch.fft.fft(x))
