"""Reductions of DomainTensors against one process: sum, mean, amax, amin, max,
min, var, std, norm, vector_norm, logsumexp, all, any, over no dims, single
dims and tuples mixing sharded and unsharded dims, keepdim or not; results that
are replicated plain tensors or DomainTensors sharded on the dims that remain.
Values and gradients (input and parameter) on 1-, 2- and 3-D grids with even,
uneven and zero-size blocks, float64 and float32; random floats, so no ties."""
import math

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import domainpar as dp
from domainpar.testing import assert_matches_single_process, shard_like
from tensor_cases import CASES, DTYPES, global_tensor, layout

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD

SHAPE = (2, 3, 7, 6)      # N, C, H, W
SHARD_DIMS = (2, 3, 1)    # H on grid axis 0, W on axis 1, C on axis 2 (3-D grids)

# (dims, keepdim): all dims, one sharded dim, one unsharded dim, mixed tuples.
DIM_SPECS = [(None, False), ((2,), True), ((0,), False), ((1, 3), False), ((0, 2), True),
             ((-1, -2), False), ((0, 1, 2, 3), True)]


def _check(model, x, grid_ndim, kind):
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, grid_ndim, kind)
    return assert_matches_single_process(model, x, grid, shard, sizes=sizes)


def reductions(dims, keepdim):
    """Every reduction over ``dims``: results of one shape, mixed with distinct
    weights so that each one's value and gradient count."""
    def f(x):
        kw = dict(keepdim=keepdim)
        d = dims if dims is not None else tuple(range(x.ndim))
        out = x.sum(dim=dims, **kw) + 0.5 * torch.mean(x, dim=d, **kw)
        out = out + 0.3 * x.amax(dim=d, **kw) - 0.2 * torch.amin(x, dim=d, **kw)
        out = out + 0.7 * torch.var(x, d, correction=0, keepdim=keepdim)
        out = out + 0.4 * x.var(dim=d, unbiased=True, **kw) + 0.6 * x.std(d, **kw)
        out = out - 0.9 * torch.std(x, dim=d, correction=0, keepdim=keepdim)
        out = out + 0.8 * x.std(d, False, keepdim)  # (dims, unbiased, keepdim) positionally
        out = out + 1.1 * x.norm(2, dim=d, **kw) + 0.15 * torch.norm(x, p=1, dim=d, **kw)
        out = out + 0.25 * x.norm(p=math.inf, dim=d, **kw) + 0.35 * x.norm(3, d, **kw)
        out = out + 0.45 * torch.linalg.vector_norm(x, 2.5, d, **kw)
        out = out + 0.55 * torch.linalg.vector_norm(x, -math.inf, d, **kw)
        return out + 1.3 * torch.logsumexp(x * 2, d, **kw)
    return f


@pytest.mark.parametrize("dims,keepdim", DIM_SPECS, ids=str)
@pytest.mark.parametrize("grid_ndim,kind", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions_match_one_process(dims, keepdim, grid_ndim, kind, dtype):
    _check(reductions(dims, keepdim), global_tensor(SHAPE, dtype, seed=1), grid_ndim, kind)


def whole(x):
    """The argument-less forms: one replicated value each."""
    out = x.sum() + x.mean() * 2 + x.max() * 0.5 - torch.min(x) + x.amax() * 0.3
    out = out + x.var() + torch.std(x, unbiased=False) + x.norm() + torch.norm(x, 'fro')
    out = out + torch.norm(x, p=1) + torch.linalg.vector_norm(x) + x.norm(p=math.inf)
    return out + torch.logsumexp(x, dim=(0, 1, 2, 3)) + x.nansum() * 0.1


class Normalise(nn.Module):
    """A parameter times a reduction over sharded dims, and a reduction of a
    parameter-scaled tensor: gradients reach the parameter once."""

    def __init__(self, dtype):
        super().__init__()
        self.w = nn.Parameter(global_tensor((SHAPE[1], 1, 1), dtype, seed=6))

    def forward(self, x):
        y = x * self.w
        m = y.mean(dim=(2, 3), keepdim=True)
        s = y.std(dim=(2, 3), keepdim=True)
        return ((y - m) / (s + 1)).sum(dim=1) + self.w.sum() * y.amax()


@pytest.mark.parametrize("grid_ndim,kind", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_whole_tensor_reductions(grid_ndim, kind, dtype):
    _check(whole, global_tensor(SHAPE, dtype, seed=2), grid_ndim, kind)
    _check(Normalise(dtype), global_tensor(SHAPE, dtype, seed=3), grid_ndim, kind)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dim", [2, 3, 0, -1])
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_max_min_along_a_dim_values_and_indices(op, dim, grid_ndim, kind):
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, grid_ndim, kind)
    t = global_tensor(SHAPE, seed=4)
    for keepdim in (False, True):
        def values(x, keepdim=keepdim):
            return getattr(x, op)(dim, keepdim).values * 2
        assert_matches_single_process(values, t, grid, shard, sizes=sizes)
    x = dp.DomainTensor(t[dp.Decomposition(SHAPE, grid, shard, sizes).local_slices()],
                        dp.Decomposition(SHAPE, grid, shard, sizes))
    got = getattr(torch, op)(x, dim=dim, keepdim=True)
    want = getattr(torch, op)(t, dim=dim, keepdim=True)
    full = lambda v: v.full_tensor() if isinstance(v, dp.DomainTensor) else v  # noqa: E731
    torch.testing.assert_close(full(got.indices), want.indices, rtol=0, atol=0)
    torch.testing.assert_close(full(got[0]), want[0], rtol=0, atol=0)


@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_result_types(grid_ndim, kind):
    """Replicated plain tensors when every sharded dim is reduced, DomainTensors
    sharded on the dims that remain otherwise."""
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, grid_ndim, kind)
    dec = dp.Decomposition(SHAPE, grid, shard, sizes)
    x = dp.DomainTensor(global_tensor(SHAPE)[dec.local_slices()], dec)
    s = x.sum()
    assert type(s) is torch.Tensor and s.shape == ()
    r = x.sum(dim=2)
    if len(shard) > 1:
        assert isinstance(r, dp.DomainTensor)
        assert r.decomposition.shard == {(d - 1 if d > 2 else d): a
                                         for d, a in shard.items() if d != 2}
    else:
        assert type(r) is torch.Tensor
    k = x.mean(dim=0, keepdim=True)
    assert isinstance(k, dp.DomainTensor) and k.shape == (1,) + SHAPE[1:]
    assert k.decomposition.shard == shard
    assert k.decomposition.local_shape() == (1,) + dec.local_shape()[1:]


@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_all_any(grid_ndim, kind):
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, grid_ndim, kind)
    dec = dp.Decomposition(SHAPE, grid, shard, sizes)
    t = global_tensor(SHAPE, seed=5)
    for b in (t > -1.5, t > 1.5, t > -10, t > 10):
        x = dp.DomainTensor(b[dec.local_slices()], dec)
        full = lambda v: v.full_tensor() if isinstance(v, dp.DomainTensor) else v  # noqa: E731
        for dims, keepdim in [(None, False), (2, False), ((1, 3), True), (0, False)]:
            for name in ("all", "any"):
                kw = {} if dims is None else dict(dim=dims, keepdim=keepdim)
                got, want = getattr(x, name)(**kw), getattr(t.__class__, name)(b, **kw)
                assert torch.equal(full(got), want), (name, dims, keepdim)
        assert torch.equal(torch.all(x), b.all()) and torch.equal(torch.any(x), b.any())


@pytest.mark.parametrize("kind", ["even", "uneven", "zero"])
def test_mean_over_a_sharded_dim_on_a_2d_grid_backward(kind):
    """The mean over H (cut along grid axis 0) of a tensor also cut along W (axis
    1): the result stays sharded on W, and each element's gradient is the
    upstream gradient over H, not times the number of ranks."""
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, 2, kind)
    t = global_tensor(SHAPE, seed=6)
    assert_matches_single_process(lambda x: x.mean(dim=2), t, grid, shard, sizes=sizes)
    dec = dp.Decomposition(SHAPE, grid, shard, sizes)
    x = dp.DomainTensor(t[dec.local_slices()].clone().requires_grad_(True), dec)
    m = x.mean(dim=2)
    upstream = global_tensor(m.shape, seed=7)
    (m * upstream).sum().backward()
    want = (upstream[:, :, None, :] / SHAPE[2]).expand(SHAPE)[dec.local_slices()]
    torch.testing.assert_close(x.grad.to_local(), want, rtol=1e-14, atol=1e-15)
    assert x.grad.decomposition == dec


def test_reduction_oracle_can_fail():
    """A wrong reduction (local sum only) is caught on more than one rank."""
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, 1, "even")
    if grid.size == 1:
        pytest.skip("needs 2 or more ranks: on one rank a block's sum is the global sum")
    with pytest.raises(AssertionError):
        assert_matches_single_process(lambda x: x.to_local().sum() if isinstance(
            x, dp.DomainTensor) else x.sum(), global_tensor(SHAPE), grid, shard)


@pytest.mark.parametrize("grid_ndim,kind", CASES)
@pytest.mark.parametrize("dim", [1, 2, -1])
def test_normalize_matches_one_process(grid_ndim, kind, dim):
    """F.normalize: a global norm along a sharded dim, local along an unsharded one."""
    shape = (2, 3, 7, 5)
    grid, shard, sizes = layout(shape, (2, 3, 1), grid_ndim, kind)
    assert_matches_single_process(lambda x: F.normalize(x, p=2.0, dim=dim) * 3,
                                  global_tensor(shape, seed=11), grid, shard, sizes=sizes)


def test_new_factories_give_plain_tensors():
    """Other dims, or no dim left cut (a sharded dim resized to 1): plain tensors.
    Same-ndim buffers are DomainTensors: tests/test_buffer_writes.py."""
    grid, shard, sizes = layout((4, 6), (1,), 1, "uneven")
    x = shard_like(global_tensor((4, 6), torch.float32), grid, shard, sizes)
    for made in (x.new_zeros(3), x.new_ones((2, 1)), x.new_full((2,), 7.0),
                 x.new_tensor([1.0, 2.0]), x.new_empty(5)):
        assert type(made) is torch.Tensor and made.dtype == torch.float32
    assert torch.equal(x.new_full((2,), 7.0), torch.full((2,), 7.0))
