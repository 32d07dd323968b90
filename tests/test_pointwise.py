"""Elementwise ops on DomainTensors against one process (the oracle): arithmetic
with scalars and with plain tensors broadcast along sharded dims, parameters,
activations, in-place forms, comparisons and where, dtype moves, detach/clone,
and binary ops between DomainTensors whose block boundaries differ. Output,
input gradients and parameter gradients, on 1-, 2- and 3-D grids with even,
uneven and zero-size blocks, float64 and float32."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import domainpar as dp
from domainpar.testing import assert_matches_single_process
from tensor_cases import CASES, DTYPES, global_tensor, layout, sizes_for

pytestmark = pytest.mark.mpi

SHAPE = (2, 3, 7, 6)      # N, C, H, W
SHARD_DIMS = (2, 3, 1)    # H on grid axis 0, W on axis 1, C on axis 2 (3-D grids)


def _case(grid_ndim, kind):
    return layout(SHAPE, SHARD_DIMS, grid_ndim, kind)


def _check(model, inputs, grid_ndim, kind, shard=None, sizes=None, grid=None):
    g, s, z = _case(grid_ndim, kind)
    return assert_matches_single_process(model, inputs, grid or g,
                                         s if shard is None else shard,
                                         sizes=z if sizes is None else sizes)


# A (1, 1, H, W) mask and a (H, 1) field: plain tensors cut to the block along sharded dims.
MASK = (global_tensor((1, 1) + SHAPE[2:], seed=7) > 0).double()
FIELD = global_tensor((SHAPE[2], 1), seed=8)


def arithmetic(x):
    mask, field = MASK.to(x.dtype), FIELD.to(x.dtype)
    y = 2.5 * x + 1 - x / 3 + 0.5 ** (x * 0.1) + x ** 2 - (1.5 - x) * x
    y = y * mask + field - torch.sub(y, 0.25, alpha=2) / (x.abs() + 1)
    y = torch.add(y, field, alpha=0.5) + torch.mul(x, mask) + torch.maximum(x, field)
    return -y + torch.clamp(x, -0.5, 0.7) + torch.exp(x * 0.2) * torch.sin(x)


class Affine(nn.Module):
    """A (C, 1, 1) scale and bias and a PReLU's (C,) weight: sliced along C when C is
    sharded, broadcast along H and W, so their gradients are summed over the ranks."""

    def __init__(self, dtype):
        super().__init__()
        self.scale = nn.Parameter(global_tensor((SHAPE[1], 1, 1), dtype, seed=3))
        self.bias = nn.Parameter(global_tensor((SHAPE[1], 1, 1), dtype, seed=4))
        self.mask_scale = nn.Parameter(global_tensor((1, 1) + SHAPE[2:], dtype, seed=5))
        self.prelu = nn.PReLU(SHAPE[1], dtype=dtype)  # a per-channel weight, cut when C is

    def forward(self, x):
        y = torch.tanh(x * self.scale + self.bias) * self.mask_scale + self.bias ** 2
        return self.prelu(y - 0.5)


ACTIVATIONS = {
    "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu, "tanh": torch.tanh, "leaky_relu": lambda x: F.leaky_relu(x, 0.1),
    "softplus": F.softplus, "sigmoid": torch.sigmoid, "method_relu": lambda x: x.relu(),
}


def all_activations(x):
    return sum(f(x * (i + 1) * 0.5) for i, f in enumerate(ACTIVATIONS.values()))


def in_place(x):
    y = x.clone().mul_(2)
    y += MASK.to(x.dtype)
    y = x * y
    F.relu(y, inplace=True)
    y = y * 1.0  # relu saved its output: later in-place ops work on a copy
    y.add_(1.5).div_(2)
    y -= x
    y *= 3
    z = torch.sin(x)
    z.sub_(MASK.to(x.dtype), alpha=0.5)
    return y + z


def comparisons(x):
    field = FIELD.to(x.dtype)
    keep = (x > 0) & (x < 1.5) | (x <= field)
    y = torch.where(x > field, x, 0.1 * x) + torch.where(keep, x * x, torch.zeros_like(x))
    flags = (x >= 0).to(x.dtype) + (x != field).to(x.dtype) + torch.eq(x, x).to(x.dtype)
    return y + flags + torch.where(x < 0, x, 2.0)


def dtype_moves(x):
    return x.double() * 2 + x.to(torch.float32).to(x.dtype) * x + x.float().double()


def detach_clone(x):
    return x * x.detach() + x.clone() * 2 + x.detach().clone()


def arithmetic_and_comparisons(x):
    return arithmetic(x) + comparisons(x)


def in_place_moves_and_copies(x):
    return in_place(x) + dtype_moves(x) + detach_clone(x)


# Grouped so that each case costs one oracle run (the suite runs on 2 cores).
@pytest.mark.parametrize("fn", [arithmetic_and_comparisons, all_activations,
                                in_place_moves_and_copies], ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_elementwise_matches_one_process(fn, grid_ndim, kind, dtype):
    _check(fn, global_tensor(SHAPE, dtype, seed=1), grid_ndim, kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_parameters_broadcast_along_sharded_dims(grid_ndim, kind, dtype):
    _check(Affine(dtype), global_tensor(SHAPE, dtype, seed=1), grid_ndim, kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_binary_ops_same_layout(grid_ndim, kind, dtype):
    def f(a, b):
        return a * b + torch.atan2(a, b) - a / (b.abs() + 1) + torch.maximum(a, b) + (a > b) * a
    a, b = global_tensor(SHAPE, dtype, seed=1), global_tensor(SHAPE, dtype, seed=2)
    _check(f, (a, b), grid_ndim, kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_binary_ops_different_block_boundaries(grid_ndim, kind, dtype):
    """The second input is cut elsewhere (other sizes, or a sharded dim less): it is
    repartitioned onto the first's blocks, never paired block by block."""
    grid, shard, sizes = _case(grid_ndim, kind)
    other = "uneven" if kind != "uneven" else "zero"
    sizes_b = {d: sizes_for(SHAPE[d], grid.dims[a], other, seed=5) for d, a in shard.items()}
    sizes_b = {d: s for d, s in sizes_b.items() if s is not None}
    if grid.size > 1 and kind != "uneven":
        assert sizes_b and sizes_b != (sizes or {}), "the test must use different boundaries"

    def f(a, b):
        y = a + b * 2 - a * b
        y = y + torch.where(b > 0, a, b)
        y.add_(b)  # in place on a's layout, b repartitioned
        return y
    a, b = global_tensor(SHAPE, dtype, seed=1), global_tensor(SHAPE, dtype, seed=2)
    _check(f, (a, b), grid_ndim, kind, grid=grid, shard=[shard, shard],
           sizes=[sizes, sizes_b or None])
    # b sharded on one dim fewer (replicated along the other axes).
    shard_c = dict(list(shard.items())[:-1])
    _check(f, (a, b), grid_ndim, kind, grid=grid, shard=[shard, shard_c],
           sizes=[sizes, None])
    # b a plain replicated tensor with the full shape: cut to a's blocks.
    _check(f, (a, b), grid_ndim, kind, grid=grid, shard=[shard, None], sizes=[sizes, None])


def test_binary_op_result_equals_one_process_directly():
    """Without the oracle helper: values of a + b with different boundaries."""
    grid, shard, _ = layout(SHAPE, SHARD_DIMS, 1, "even")
    a, b = global_tensor(SHAPE, seed=1), global_tensor(SHAPE, seed=2)
    da = dp.scatter(a, grid, shard)
    sizes_b = {2: sizes_for(SHAPE[2], grid.dims[0], "zero", seed=9)} if grid.size > 1 else None
    db = dp.DomainTensor(b[dp.Decomposition(SHAPE, grid, shard, sizes_b).local_slices()],
                         dp.Decomposition(SHAPE, grid, shard, sizes_b))
    out = da + db
    assert isinstance(out, dp.DomainTensor)
    assert out.decomposition == da.decomposition
    torch.testing.assert_close(out.full_tensor(), a + b, rtol=0, atol=0)


def test_in_place_keeps_the_tensor_and_its_layout():
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, 2, "uneven")
    x = dp.scatter(global_tensor(SHAPE, seed=1), grid, shard)
    y = x.clone()
    before = y.decomposition
    z = y.mul_(2)
    assert z is y and y.decomposition == before
    torch.testing.assert_close(y.full_tensor(), 2 * global_tensor(SHAPE, seed=1))
