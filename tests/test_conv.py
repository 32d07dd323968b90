"""Convolutions, transposed convolutions and F.pad on DomainTensors against one
process: output, input gradient, weight and bias gradients.

The matrix is generated: a seeded sample of op options (dims, kernel, stride,
dilation, padding, padding_mode, groups, output_padding) crossed with layouts
(even, uneven, zero-size blocks; periodic grids; 1-, 2- and 3-D grids, the
batch dim sharded too). Every rank draws the same sample.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from domainpar import UnsupportedOpError
from domainpar.comm.decomposition import balanced_sizes
from domainpar.testing import (
    adjoint_test,
    assert_matches_single_process,
    check_on_every_rank,
    raises_on_every_rank,
    shard_like,
)
from tensor_cases import COMM, SIZE, global_tensor, layout

pytestmark = pytest.mark.mpi

SHAPES = {1: (2, 4, 23), 2: (2, 4, 13, 11), 3: (1, 4, 9, 7, 6)}
CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONVS_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def _layouts(rng, nsp):
    """(grid_ndim, kind, periodic, shard_dims) samples for an input with ``nsp`` spatial dims."""
    out = []
    for grid_ndim in (1, 2, 3):
        for kind in ("even", "uneven", "zero"):
            spatial = list(range(2, 2 + nsp))
            rng.shuffle(spatial)
            # the batch dim joins the sharded dims now and then
            dims = tuple(([0] if rng.random() < 0.25 else []) + spatial)
            out.append((grid_ndim, kind, rng.random() < 0.4, dims))
    return out


def _conv_cases(n: int, seed: int = 5):
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        nsp = rng.choice((1, 2, 2, 3))
        k = rng.choice((1, 2, 3, 3, 4, 5))
        stride = rng.choice((1, 1, 2, 3))
        dilation = rng.choice((1, 1, 2))
        groups = rng.choice((1, 2, 4))
        mode = rng.choice(("zeros", "zeros", "reflect", "replicate", "circular"))
        padding = rng.choice((0, 1, 2, "same", "valid", "tuple"))
        if padding == "same" and stride != 1:
            padding = 1
        if padding == "tuple":
            padding = tuple(rng.choice((0, 1, 2)) for _ in range(nsp))
        if mode != "zeros" and padding == "same" and (dilation * (k - 1)) % 2:
            padding = 1  # torch pads asymmetric 'same' only with zeros
        if not _valid(functools.partial(CONVS[nsp], 4, 4, k, stride=stride, padding=padding,
                                        dilation=dilation, groups=groups, padding_mode=mode), nsp):
            continue
        for grid_ndim, kind, periodic, dims in _layouts(rng, nsp):
            if rng.random() < 0.25:  # a sample of the layouts per option set
                cases.append((nsp, k, stride, dilation, groups, mode, padding,
                              grid_ndim, kind, periodic, dims))
    return cases[:n]


def _valid(make, nsp) -> bool:
    """Whether torch accepts the module on the global shape (kernel larger than the
    padded input, reflect padding wider than the dim...): checked on the meta device."""
    try:
        make().to("meta")(torch.empty(SHAPES[nsp], device="meta"))
        return True
    except (RuntimeError, ValueError, NotImplementedError):
        return False


def _check(make, nsp, k, where, dtype, model_seed):
    """``make(in_channels)`` in ``dtype`` on a ``SHAPES[nsp]`` input laid out by
    ``where`` = (grid_ndim, kind, periodic, dims), against one process."""
    grid_ndim, kind, periodic, dims = where
    shape = SHAPES[nsp]
    grid, shard, sizes = layout(shape, dims, grid_ndim, kind, seed=k, periodic=periodic)
    torch.manual_seed(model_seed)
    model = make(shape[1]).to(dtype)
    assert_matches_single_process(model, global_tensor(shape, dtype, seed=k), grid, shard,
                                  sizes=sizes)


def _conv(case, dtype, model_seed):
    nsp, k, stride, dilation, groups, mode, padding = case[:7]
    _check(lambda cin: CONVS[nsp](cin, 4, k, stride=stride, padding=padding, dilation=dilation,
                                  groups=groups, padding_mode=mode),
           nsp, k, case[7:], dtype, model_seed)


@pytest.mark.parametrize("case", _conv_cases(60), ids=lambda c: "-".join(map(str, c)))
def test_conv_matches_one_process(case):
    _conv(case, torch.float64, model_seed=case[1] + 7 * case[2])


@pytest.mark.parametrize("case", _conv_cases(12, seed=11), ids=lambda c: "-".join(map(str, c)))
def test_conv_float32(case):
    _conv(case, torch.float32, model_seed=case[1])


def _conv_t_cases(n: int, seed: int = 5):
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        nsp = rng.choice((1, 2, 2, 3))
        k = rng.choice((1, 2, 3, 4, 5))
        stride = rng.choice((1, 2, 2, 3))
        dilation = rng.choice((1, 1, 2))
        groups = rng.choice((1, 2, 4))
        padding = rng.choice((0, 1, 2))
        out_pad = rng.randrange(max(stride, dilation))
        if not _valid(functools.partial(CONVS_T[nsp], 4, 4, k, stride=stride, padding=padding,
                                        output_padding=out_pad, dilation=dilation, groups=groups),
                      nsp):
            continue
        for grid_ndim, kind, periodic, dims in _layouts(rng, nsp):
            if rng.random() < 0.25:
                cases.append((nsp, k, stride, dilation, groups, padding, out_pad,
                              grid_ndim, kind, periodic, dims))
    return cases[:n]


def _conv_t(case, dtype, model_seed):
    nsp, k, stride, dilation, groups, padding, out_pad = case[:7]
    _check(lambda cin: CONVS_T[nsp](cin, 4, k, stride=stride, padding=padding,
                                    output_padding=out_pad, dilation=dilation, groups=groups),
           nsp, k, case[7:], dtype, model_seed)


@pytest.mark.parametrize("case", _conv_t_cases(50), ids=lambda c: "-".join(map(str, c)))
def test_conv_transpose_matches_one_process(case):
    _conv_t(case, torch.float64, model_seed=case[1] + 5 * case[2])


@pytest.mark.parametrize("case", _conv_t_cases(10, seed=13), ids=lambda c: "-".join(map(str, c)))
def test_conv_transpose_float32(case):
    _conv_t(case, torch.float32, model_seed=case[1])


@pytest.mark.parametrize("n", (62, 63, 64))
def test_strided_conv_where_stride_does_not_divide_offsets(n):
    """ShardTensor's silent failure: H=62 on 2 ranks, kernel 3, stride 2."""
    grid, shard, sizes = layout((1, 2, n, 8), (2,), 1, "even")
    torch.manual_seed(n)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.GELU(),
                          nn.Conv2d(3, 3, 3, stride=2)).double()
    assert_matches_single_process(model, global_tensor((1, 2, n, 8), seed=n), grid, shard)


@pytest.mark.parametrize("grid_ndim", (1, 2))
def test_conv_transpose_is_the_adjoint_of_conv(grid_ndim):
    """<conv(x), y> == <x, conv_transpose(y)> across the layouts the two derive."""
    shape = (1, 3, 14, 9)
    grid, shard, sizes = layout(shape, (2, 3), grid_ndim, "uneven")
    w = global_tensor((2, 3, 3, 3), seed=3)
    x = shard_like(global_tensor(shape, seed=1), grid, shard, sizes)
    y = F.conv2d(x, w, stride=2, padding=1)
    yr = shard_like(global_tensor(tuple(y.shape), seed=2), grid, shard,
                    {d: y.decomposition.block_sizes(d) for d in shard})
    xt = F.conv_transpose2d(yr, w, stride=2, padding=1, output_padding=(1, 0))
    assert xt.shape == x.shape
    lhs = (y * yr).sum()
    rhs = (x * xt).sum()  # xt's layout differs from x's: the product repartitions
    assert abs(float(lhs) - float(rhs)) <= 1e-10 * max(1.0, abs(float(lhs)))


def test_conv_gradient_passes_adjoint_test():
    grid, shard, sizes = layout((2, 2, 11, 10), (2, 3), 2, "zero")
    w = global_tensor((3, 2, 3, 3), seed=4)
    x = shard_like(global_tensor((2, 2, 11, 10), seed=5), grid, shard, sizes)
    adjoint_test(lambda t: F.conv2d(t, w, stride=(2, 1), padding=(1, 2), dilation=(1, 2)), x)


# -- F.pad -----------------------------------------------------------------------------------------
PAD_CASES = [(mode, pad, grid_ndim, kind, periodic)
             for mode in ("constant", "reflect", "replicate", "circular")
             for pad in ((1, 1, 2, 0), (2, 3, 1, 1), (0, 0, 5, 4), (3, 3, 3, 3))
             for grid_ndim, kind, periodic in ((1, "even", False), (2, "uneven", True),
                                               (2, "zero", False), (3, "zero", True))
             if not (mode == "reflect" and max(pad) >= 6)]


@pytest.mark.parametrize("case", PAD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_pad_matches_one_process(case):
    mode, pad, grid_ndim, kind, periodic = case
    shape = (2, 3, 7, 6)
    grid, shard, sizes = layout(shape, (2, 3, 0), grid_ndim, kind, periodic=periodic)
    kwargs = {"value": 0.5} if mode == "constant" else {}
    assert_matches_single_process(lambda x: F.pad(x, pad, mode=mode, **kwargs),
                                  global_tensor(shape), grid, shard, sizes=sizes)



@pytest.mark.parametrize("kind", ("even", "uneven", "zero"))
@pytest.mark.parametrize("grid_ndim", (1, 2))
def test_constant_pad_of_a_concentrated_tensor_comes_out_balanced(kind, grid_ndim):
    """A few cells sliced off the low end of a sharded dim (all on the first ranks),
    padded back to a long dim with zeros: the output is cut into balanced blocks
    instead of leaving the padding on the last rank, and still matches one
    process; so does a pad on both ends that the edge blocks can take."""
    shape = (2, 3, 17, 6)
    grid, shard, sizes = layout(shape, (2, 3), grid_ndim, kind)

    def sliced_and_padded(x):
        return F.pad(x[:, :, :3], (0, 0, 1, 20), value=0.25)

    assert_matches_single_process(sliced_and_padded, global_tensor(shape), grid, shard,
                                  sizes=sizes)
    y = sliced_and_padded(shard_like(global_tensor(shape), grid, shard, sizes))
    if 2 in y.decomposition.shard:
        assert y.decomposition.block_sizes(2) == balanced_sizes(24, len(y.decomposition
                                                                         .block_sizes(2)))
    assert_matches_single_process(lambda x: F.pad(x, (0, 0, 1, 1)), global_tensor(shape),
                                  grid, shard, sizes=sizes)


def test_constant_pad_adjoint():
    """<pad(x), y> == <x, pad*(y)> where the pad balances its output (a repartition)."""
    grid, shard, sizes = layout((2, 3, 17, 6), (2, 3), 2, "uneven")
    x = shard_like(global_tensor((2, 3, 17, 6), seed=5), grid, shard, sizes)
    adjoint_test(lambda t: F.pad(t[:, :, :2], (0, 0, 0, 30)), x)


@pytest.mark.parametrize("mode", ("reflect", "replicate", "circular"))
def test_pad_of_an_empty_block_along_an_unsharded_dim(mode):
    """An empty block (batch dim sharded, zero-size layout) padded along an
    unsharded dim, while a sharded dim is named with zero padding: the empty
    block keeps its own size along the sharded dim."""
    shape = (2, 3, 7, 6)
    grid, shard, sizes = layout(shape, (0, 3), 2, "zero")
    assert_matches_single_process(lambda x: F.pad(x, (0, 0, 2, 1), mode=mode),
                                  global_tensor(shape), grid, shard, sizes=sizes)

@pytest.mark.parametrize("mode", ("reflect", "replicate", "circular"))
def test_pad_3d_float32(mode):
    shape = (1, 2, 6, 5, 7)
    grid, shard, sizes = layout(shape, (2, 3, 4), 3, "uneven")
    assert_matches_single_process(lambda x: F.pad(x, (1, 2, 2, 1, 1, 1), mode=mode),
                                  global_tensor(shape, torch.float32), grid, shard, sizes=sizes)


# -- refusals ----------------------------------------------------------------------------------
def test_refusals():
    grid, shard, sizes = layout((2, 4, 8, 8), (1, 2), 2, "even")
    x = shard_like(global_tensor((2, 4, 8, 8)), grid, shard, sizes)
    w = global_tensor((4, 4, 3, 3))
    if 1 in shard:  # the channel dim is cut when the grid has an axis for it
        raises_on_every_rank(UnsupportedOpError, ["channel dim 1"],
                             lambda: F.conv2d(x, w, padding=1))
    grid, shard, sizes = layout((4, 8, 8), (1,), 1, "even")
    x3 = shard_like(global_tensor((4, 8, 8)), grid, shard, sizes)
    raises_on_every_rank(UnsupportedOpError, ["batched input"], lambda: F.conv2d(x3, w, padding=1))
    x4 = shard_like(global_tensor((2, 4, 8, 8)), grid, {2: 0}, None)
    wd = shard_like(w, grid, {0: 0}, None) if SIZE > 1 else None
    if wd is not None:
        raises_on_every_rank(UnsupportedOpError, ["weight must be a plain"],
                             lambda: F.conv2d(x4, wd))
    raises_on_every_rank(UnsupportedOpError, ["negative padding"],
                         lambda: F.pad(x4, (0, 0, -1, 0)))


def test_torch_errors_on_every_rank():
    """Bad arguments get torch's own error on every rank, before any message."""
    grid, shard, sizes = layout((1, 4, 8, 8), (2,), 1, "zero")
    x = shard_like(global_tensor((1, 4, 8, 8)), grid, shard, sizes)
    with pytest.raises(RuntimeError, match="strided"):
        F.conv2d(x, global_tensor((4, 4, 3, 3)), stride=2, padding="same")
    with pytest.raises(RuntimeError):
        F.conv2d(x, global_tensor((4, 3, 3, 3)))


def test_the_sample_covers_every_option():
    """The generated matrix keeps covering every option value as it evolves."""
    convs = _conv_cases(60)
    seen = [set(map(str, col)) for col in zip(*convs)]
    nsp, k, stride, dilation, groups, mode, padding, grid_ndim, kind, periodic, _ = seen
    assert nsp == {"1", "2", "3"} and grid_ndim == {"1", "2", "3"}
    assert kind == {"even", "uneven", "zero"} and periodic == {"True", "False"}
    assert mode == {"zeros", "reflect", "replicate", "circular"}
    assert {"same", "valid", "0", "1", "2"} <= padding and any("(" in p for p in padding)
    assert groups == {"1", "2", "4"} and {"1", "2", "3"} <= stride and dilation == {"1", "2"}
    transposed = _conv_t_cases(50)
    seen = [set(map(str, col)) for col in zip(*transposed)]
    assert seen[0] == {"1", "2", "3"} and seen[6] == {"0", "1", "2"}  # dims, output_padding
    assert seen[2] == {"1", "2", "3"} and seen[3] == {"1", "2"} and seen[4] == {"1", "2", "4"}
    assert any(0 in c[-1] for c in convs) and any(0 in c[-1] for c in transposed)  # batch cut


@pytest.mark.parametrize("transposed", (False, True))
def test_blocks_take_onednn_where_torch_would_take_im2col(transposed):
    """float32 3-D blocks too thin for torch's oneDNN size rule are handed to it with
    their spatial dims reordered (conv.local_conv): same numbers as one process."""
    from domainpar.ops.onednn import kernel_order as _onednn_order
    shape = (1, 8, 12, 16, 170)  # 8*12*16 <= 20480 < 8*170*16
    grid, shard, sizes = layout(shape, (2,), 1, "uneven")
    torch.manual_seed(1)
    model = (nn.ConvTranspose3d(8, 2, 3, stride=2, padding=1, output_padding=1) if transposed
             else nn.Conv3d(8, 3, 3, padding=1))
    x = global_tensor(shape, torch.float32, seed=2)
    block = shard_like(x, grid, shard, sizes).to_local().shape
    if not transposed:  # the sharded block is cut by ghost cells: 2 more along dim 2
        block = (1, 8, block[2] + 2, 16, 170)
    args = ((2, 2, 2), (1, 1, 1), (1, 1, 1), 1, (1, 1, 1)) if transposed else \
        ((1, 1, 1), (0, 1, 1), (1, 1, 1), 1, ())
    w_shape = tuple(model.weight.shape)
    assert _onednn_order(tuple(block), torch.float32, "cpu", w_shape, *args) == (2, 1, 0)
    assert_matches_single_process(model, x, grid, shard, sizes=sizes)


@pytest.mark.parametrize("kind", ("even", "uneven", "zero"))
def test_whole_blocks_take_the_local_kernel_choice(kind, monkeypatch):
    """A float32 3-D conv of blocks with every spatial dim whole (the batch dim
    sharded) takes the local call's kernel choice as a sharded block does (torch
    alone would run these thin batch-1 blocks by im2col), with no ghost cells;
    float64 and an asymmetric 'same' stay torch's op on the block. All match one
    process."""
    from domainpar.ops import conv as conv_ops
    calls = []
    local_conv = conv_ops.local_conv

    def counted(func, cells, *args, **kwargs):
        calls.append(tuple(cells.shape))
        return local_conv(func, cells, *args, **kwargs)
    monkeypatch.setattr(conv_ops, "local_conv", counted)
    shape = (3, 4, 9, 8, 7)
    grid, shard, sizes = layout(shape, (0,), 1, kind)
    torch.manual_seed(7)
    for dtype in (torch.float64, torch.float32):
        model = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.GELU(),
                              nn.Conv3d(4, 2, 3, stride=2, dilation=(1, 2, 1))).to(dtype)
        calls.clear()
        assert_matches_single_process(model, global_tensor(shape, dtype, seed=8), grid, shard,
                                      sizes=sizes)
        if dtype == torch.float64:
            assert calls == []
        else:
            assert len(calls) >= 2 and all(c[1:] == (4, 9, 8, 7) for c in calls), calls
    calls.clear()
    even = nn.Conv3d(4, 2, 2, padding="same")  # float32, pads 0 before and 1 after
    assert_matches_single_process(even, global_tensor(shape, torch.float32, seed=9), grid, shard,
                                  sizes=sizes)
    assert calls == []


@pytest.mark.parametrize("kind,grid_ndim", [(k, g) for k in ("even", "uneven", "zero")
                                             for g in (1, 2)])
def test_a_kernel_that_reaches_no_neighbour_runs_on_the_block(kind, grid_ndim, monkeypatch):
    """A conv whose kernel is 1 wide, stride 1 and unpadded along every sharded dim
    (a 1x1 conv; any kernel along whole dims) is torch's op on the block: no
    HaloConv, no exchange; but where a block is empty (torch refuses it). A stride
    of 2 there still needs the windowed path. All match one process."""
    from domainpar.ops import conv as conv_ops
    windowed = []
    halo_conv = conv_ops.HaloConv.apply

    def counted(*args):
        windowed.append(1)
        return halo_conv(*args)
    monkeypatch.setattr(conv_ops.HaloConv, "apply", counted)
    shape = (2, 4, 9, 8)
    grid, shard, sizes = layout(shape, (2, 0), grid_ndim, kind)
    empty = 0 in shard_like(global_tensor(shape), grid, shard, sizes).decomposition.block_sizes(2)
    torch.manual_seed(3)
    for dtype in (torch.float64, torch.float32):
        model = nn.Sequential(nn.Conv2d(4, 6, 1), nn.GELU(), nn.Conv2d(6, 2, (1, 3), padding=(0, 1)))
        assert_matches_single_process(model.to(dtype), global_tensor(shape, dtype, seed=4), grid,
                                      shard, sizes=sizes)
        assert (windowed == []) != empty, windowed
        windowed.clear()
    strided = nn.Conv2d(4, 2, 1, stride=2).double()
    assert_matches_single_process(strided, global_tensor(shape, seed=5), grid, shard, sizes=sizes)
    assert len(windowed) == 1


POINTWISE_CASES = [(1, (3, 4, 11), (0, 2), 1), (2, (2, 4, 9, 8), (2, 3), 2),
                   (3, (1, 4, 6, 5, 7), (2, 4), 2), (2, (3, 4, 7, 6), (0, 2), 2)]


@pytest.mark.parametrize("nsp,shape,dims,grid_ndim", POINTWISE_CASES)
@pytest.mark.parametrize("kind", ["even", "uneven", "zero", "periodic"])
def test_a_pointwise_conv_is_a_matrix_product(nsp, shape, dims, grid_ndim, kind, monkeypatch):
    """Kernel 1, stride 1, no padding, one group ('same' and 'valid' too): bias +
    W @ x per sample (``conv.pointwise``), with and without bias, 1-, 2- and 3-D,
    batch and spatial dims sharded, empty batch blocks, a non-contiguous block; the
    other convs of kernel 1 keep their paths (strided, grouped, padded), and so do
    layouts with an empty block on a sharded spatial dim (the windowed path). All
    match one process."""
    from domainpar.ops import conv as conv_ops
    taken = []
    real = conv_ops.pointwise
    monkeypatch.setattr(conv_ops, "pointwise", lambda *a: (taken.append(1), real(*a))[1])
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[nsp]
    grid, shard, sizes = layout(shape, dims, grid_ndim, kind)
    dec = shard_like(global_tensor(shape), grid, shard, sizes).decomposition
    whole = all(min(dec.block_sizes(d)) > 0 for d in dec.shard if d >= 2)
    torch.manual_seed(7)
    for dtype in (torch.float64, torch.float32):
        x = global_tensor(shape, dtype, seed=8)
        for model, pointwise in ((conv(4, 3, 1), True), (conv(4, 5, 1, bias=False), True),
                                 (conv(4, 3, 1, padding="same"), True),
                                 (nn.Sequential(nn.GELU(), conv(4, 2, 1, padding="valid")), True),
                                 (conv(4, 2, 1, groups=2), False),
                                 (conv(4, 2, 1, padding=1), False)):
            assert_matches_single_process(model.to(dtype), x, grid, shard, sizes=sizes)
            assert bool(taken) == (pointwise and whole), (model, taken)
            taken.clear()
        # a non-contiguous block: a transposed view of whole channels and cells
        model = nn.Sequential(_Transposed(), conv(4, 3, 1)).to(dtype)
        assert_matches_single_process(model, x, grid, shard, sizes=sizes)


class _Transposed(nn.Module):
    """x -> a view with the last two dims' strides swapped and back (not contiguous)."""

    def forward(self, x):
        return x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.ndim > 3 else x[..., :]


def test_blocks_no_order_helps_take_onednn_layout():
    """A float32 3-D block that no reordering gets past torch's size rule goes to
    oneDNN in its own tensor layout: same numbers as one process."""
    from domainpar.ops.onednn import LAYOUT
    from domainpar.ops.onednn import kernel_order as _onednn_order
    shape = (1, 4, 16, 16, 16)
    grid, shard, sizes = layout(shape, (2, 3), 2, "uneven")
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.GELU(), nn.Conv3d(4, 2, 3))
    x = global_tensor(shape, torch.float32, seed=4)
    assert _onednn_order((1, 4, 10, 10, 18), torch.float32, "cpu", (4, 4, 3, 3, 3),
                         (1, 1, 1), (0, 0, 1), (1, 1, 1), 1, ()) == LAYOUT
    assert_matches_single_process(model, x, grid, shard, sizes=sizes)


def test_pointwise_3d_conv_stays_on_torchs_own_path():
    """A 1x1x1 conv (stride 1, no padding) needs no columns on torch's slow path,
    so its block is not converted to oneDNN's layout (a copy each way at the
    step's peak); its numbers still match one process."""
    from domainpar.ops.onednn import LAYOUT
    from domainpar.ops.onednn import kernel_order as _onednn_order
    small = (1, 4, 10, 10, 18)  # no order passes torch's size rule
    assert _onednn_order(small, torch.float32, "cpu", (4, 4, 3, 3, 3), (1, 1, 1), (1, 1, 1),
                         (1, 1, 1), 1, ()) == LAYOUT
    assert _onednn_order(small, torch.float32, "cpu", (2, 4, 1, 1, 1), (1, 1, 1), (0, 0, 0),
                         (1, 1, 1), 1, ()) is None
    shape = (1, 4, 12, 10, 18)
    grid, shard, sizes = layout(shape, (2, 4), 2, "uneven")
    torch.manual_seed(5)
    x = global_tensor(shape, torch.float32, seed=6)
    assert_matches_single_process(nn.Conv3d(4, 2, 1), x, grid, shard, sizes=sizes)


# -- backward in pieces of output rows (large blocks) -------------------------------------------
@pytest.fixture
def backward_in_pieces(monkeypatch):
    """Every conv backward in pieces, however small its block; yields the
    (dim, rows) plans the backward took."""
    from domainpar.ops import conv as conv_ops
    monkeypatch.setattr(conv_ops, "_PIECE_CELLS", 1)
    monkeypatch.setattr(conv_ops, "_PIECE_ROWS", 1)
    monkeypatch.setattr(conv_ops, "_PIECES", 3)
    taken = []
    row_pieces = conv_ops._row_pieces

    def spy(*args):
        plan = row_pieces(*args)
        taken.append(plan)
        return plan

    monkeypatch.setattr(conv_ops, "_row_pieces", spy)
    return taken


@pytest.mark.parametrize("rows, pieces", [(64, 8), (40, 5), (32, 4), (16, 2), (15, 1), (7, 1)])
def test_backward_pieces_are_at_least_eight_rows_thick(rows, pieces):
    """A large block goes in at most 8 pieces along D, none thinner than 8 output
    rows (thin slabs cost oneDNN more than their memory saves); within
    ``backward_in_pieces_at_any_size`` (``domainpar plan``'s scaled-down blocks)
    as many pieces as rows allow, up to 8."""
    from domainpar.ops import conv as conv_ops
    padded = (1, 64, rows + 2, 34, 34)  # far above the 16k-cell floor
    spec = conv_ops.ConvSpec(F.conv3d, (1, 1, 1), (0, 1, 1), (1, 1, 1), 1, ((2, (1, 1)),),
                             ((2, (0, rows + 2)),), (1, 4, rows, 32, 32))
    plan = conv_ops._row_pieces(spec, padded)
    assert (1 if plan is None else len(plan[1])) == pieces
    if plan is not None:
        assert plan[0] == 2 and all(b - a >= 8 for a, b in plan[1])
        assert plan[1][0][0] == 0 and plan[1][-1][1] == rows
    with conv_ops.backward_in_pieces_at_any_size():
        plan = conv_ops._row_pieces(spec, padded)
    assert len(plan[1]) == min(8, rows)


@pytest.mark.parametrize("case", _conv_cases(24, seed=17), ids=lambda c: "-".join(map(str, c)))
def test_conv_backward_in_pieces_matches_one_process(case, backward_in_pieces):
    _conv(case, torch.float64, model_seed=case[1])


@pytest.mark.parametrize("options", [dict(kernel_size=3, padding=1),
                                     dict(kernel_size=3, stride=2, padding=1),
                                     dict(kernel_size=3, dilation=2, padding="same"),
                                     dict(kernel_size=4, stride=3, padding=2, groups=2)],
                         ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
@pytest.mark.parametrize("grid_ndim", (1, 2))
def test_conv3d_backward_in_pieces(options, grid_ndim, backward_in_pieces):
    """A 3-D conv on uneven blocks of a 3-D input, backward in pieces along D, also
    where D is sharded, against one process; the pieces are really taken (a rank
    with a single output row along D has nothing to cut)."""
    shape = (1, 4, 17, 9, 8)
    grid, shard, sizes = layout(shape, (2, 3, 4), grid_ndim, "uneven", seed=3)
    torch.manual_seed(3)
    assert_matches_single_process(nn.Conv3d(4, 4, **options).double(), global_tensor(shape),
                                  grid, shard, sizes=sizes)
    pieces = [p for p in backward_in_pieces if p is not None]
    assert all(dim == 2 and len(rows) > 1 for dim, rows in pieces)
    assert COMM.allreduce(len(pieces)) > 0


# -- forward in pieces of output rows (ops/onednn.py's tuned_conv) ------------------------------
@pytest.mark.parametrize("options", [dict(kernel_size=3, padding=1),
                                     dict(kernel_size=3, stride=2, padding=(0, 1, 1)),
                                     dict(kernel_size=(2, 3, 3), dilation=2, padding="same"),
                                     dict(kernel_size=3, padding=1, padding_mode="circular")],
                         ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
@pytest.mark.parametrize("grid_ndim,kind", [(1, "uneven"), (2, "even"), (3, "zero")])
def test_conv3d_forward_in_pieces(options, grid_ndim, kind, conv_tuning):
    """Float32 3-D convs whose forward the tuning runs in pieces of output rows on
    every block (the fake clock favours them), forward and backward against one
    process; the pieces are really taken somewhere."""
    shape = (1, 4, 17, 9, 8)
    grid, shard, sizes = layout(shape, (2, 3, 4), grid_ndim, kind, periodic=True, seed=4)
    torch.manual_seed(4)
    assert_matches_single_process(nn.Conv3d(4, 4, **options), global_tensor(shape, torch.float32),
                                  grid, shard, sizes=sizes)
    _, ran = conv_tuning
    assert COMM.allreduce(sum(p is not None for p in ran)) > 0


@pytest.mark.parametrize("mode", ("circular", "reflect", "replicate", "zeros"))
@pytest.mark.parametrize("grid_ndim", (1, 2))
def test_padded_conv_keeps_its_input_layout(mode, grid_ndim):
    """nn.Conv3d(k=3, padding=1) in every padding mode maps blocks to blocks of the
    same size (the non-zero modes run F.pad then a valid conv, whose outputs are
    anchored at their windows' centres), on even and uneven layouts; and matches
    one process."""
    shape = (1, 3, 12, 10, 8)
    for kind in ("even", "uneven"):
        grid, shard, sizes = layout(shape, (2, 3), grid_ndim, kind, periodic=True, seed=2)
        torch.manual_seed(1)
        conv = nn.Conv3d(3, 3, 3, padding=1, padding_mode=mode).double()
        x = shard_like(global_tensor(shape), grid, shard, sizes)
        assert conv(x).to_local().shape == x.to_local().shape
        assert_matches_single_process(conv, global_tensor(shape), grid, shard, sizes=sizes)


@pytest.mark.parametrize("kind", ["even", "zero"])
def test_ranks_choose_one_kernel_way(conv_tuning, monkeypatch, kind):
    """A sharded conv's first forward: its ranks keep the way whose slowest rank is
    faster (ops/onednn.py, ``_AGREED``). Rank 0 times pieces at 1 and whole at 3,
    the others whole at 1 and pieces at 2: each alone would keep its own, together
    they keep pieces. A rank with an empty block takes part with no times; later
    forwards agree no more; the numbers are one process's."""
    from domainpar.ops import onednn
    state, ran = conv_tuning
    state["favour"], state["other"] = ("pieces", 3.0) if COMM.Get_rank() == 0 else ("whole", 2.0)
    agreements = []
    slowest = onednn._slowest
    monkeypatch.setattr(onednn, "_slowest", lambda *a: agreements.append(a) or slowest(*a))
    shape = (1, 4, 6 * SIZE, 10, 12)
    grid, shard, sizes = layout(shape, (2,), 1, kind)
    torch.manual_seed(3)  # the same weights on every rank
    conv = nn.Conv3d(4, 3, 3, padding=1).requires_grad_(False)
    x = global_tensor(shape, torch.float32, seed=5)
    truth = F.conv3d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    xs = shard_like(x, grid, shard, sizes)
    for _ in range(2):
        out = conv(xs).full_tensor()
        assert (out.double() - truth).abs().max() < 1e-4
    assert len(agreements) == 1
    empty = 0 in xs.to_local().shape
    assert list(onednn._CHOICES.values()) == ([] if empty else [ran[1]])
    assert empty or ran[1] is not None


@pytest.mark.parametrize("kind,grid_ndim,periodic", [(k, g, p) for k in ("even", "uneven", "zero")
                                                      for g in (1, 2) for p in (False, True)])
def test_a_conv_that_wants_no_gradient_runs_without_the_function(kind, grid_ndim, periodic,
                                                                 monkeypatch):
    """Under ``torch.no_grad``, or in grad mode with no operand requiring a
    gradient, a conv with ghost cells runs HaloConv's forward without the
    Function (``halo_conv``: no autograd node, no saved slabs) and gives, bit for
    bit, what the Function gives; with any operand requiring a gradient it takes
    the Function. Both match one process."""
    from domainpar.ops import conv as conv_ops
    applied = []
    apply = conv_ops.HaloConv.apply
    monkeypatch.setattr(conv_ops.HaloConv, "apply",
                        lambda *a: applied.append(1) or apply(*a))
    shape = (1, 3, 9, 8, 7)
    grid, shard, sizes = layout(shape, (2, 3), grid_ndim, kind, periodic=periodic, seed=4)
    torch.manual_seed(2)  # the same weights on every rank
    conv = nn.Conv3d(3, 2, 3, padding=1, dilation=(2, 1, 1)).double()
    x = global_tensor(shape, seed=6)
    truth = conv(x).detach()
    xs = shard_like(x, grid, shard, sizes)
    with_function = conv(xs)  # the weights require gradients
    took = [len(applied) == 1 and with_function.requires_grad]
    with torch.no_grad():
        inference = conv(xs)
    conv.requires_grad_(False)
    frozen = conv(xs)
    took.append(len(applied) == 1 and not inference.requires_grad and frozen.grad_fn is None)
    error = (inference.full_tensor() - truth).abs().max().item()
    conv(shard_like(x, grid, shard, sizes, requires_grad=True))  # the input alone
    took.append(len(applied) == 2)
    same = (torch.equal(inference.to_local(), with_function.to_local().detach())
            and torch.equal(frozen.to_local(), inference.to_local()))
    check_on_every_rank(took == [True] * 3 and same and error < 1e-12,
                        f"Function taken {took}, the same bits {same}, error {error}")
