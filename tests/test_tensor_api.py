"""The DomainTensor API: dp.scatter, DomainTensor.from_local, to_local,
full_tensor, redistribute, .grad, repr, the allow_gather() fallback, and bad
input raising the same error on every rank (docs/design.md, "Errors")."""
import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.testing import assert_matches_single_process, raises_on_every_rank
from tensor_cases import CASES, global_tensor, layout, sizes_for

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD
SIZE, RANK = COMM.Get_size(), COMM.Get_rank()

SHAPE = (2, 3, 7, 6)
SHARD_DIMS = (2, 3, 1)


def _dec(grid_ndim, kind):
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, grid_ndim, kind)
    return dp.Decomposition(SHAPE, grid, shard, sizes)


# -- scatter -----------------------------------------------------------------------------------
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_scatter_from_the_last_rank(grid_ndim, kind):
    dec = _dec(grid_ndim, kind)
    src = SIZE - 1
    t = global_tensor(SHAPE, seed=1)
    x = dp.scatter(t if RANK == src else None, dec.grid, dec.shard, src=src)
    assert isinstance(x, dp.DomainTensor) and x.shape == SHAPE and x.dtype == t.dtype
    # scatter balances its blocks; the test's own sizes are for from_local below.
    assert x.decomposition == dp.Decomposition(SHAPE, dec.grid, dec.shard)
    torch.testing.assert_close(x.to_local(), t[x.decomposition.local_slices()], rtol=0, atol=0)
    torch.testing.assert_close(x.full_tensor(), t, rtol=0, atol=0)
    assert not x.requires_grad


@pytest.mark.parametrize("grid_ndim", [1, 2, 3])
def test_scatter_requires_grad_gives_a_leaf_whose_grad_is_a_domain_tensor(grid_ndim):
    dec = _dec(grid_ndim, "even")
    t = global_tensor(SHAPE, seed=1)
    w = global_tensor(SHAPE, seed=2)
    x = dp.scatter(t if RANK == 0 else None, dec.grid, dec.shard, requires_grad=True)
    assert x.requires_grad and x.is_leaf and x.grad is None
    (x * w).sum().backward()
    assert isinstance(x.grad, dp.DomainTensor)
    assert x.grad.decomposition == x.decomposition
    torch.testing.assert_close(x.grad.full_tensor(), w, rtol=0, atol=0)


@pytest.mark.parametrize("grid_ndim", [1, 2, 3])
def test_scatter_of_a_tensor_requiring_grad_gathers_its_gradient(grid_ndim):
    dec = _dec(grid_ndim, "even")
    src = SIZE // 2
    t = global_tensor(SHAPE, seed=1).requires_grad_(True)
    w = global_tensor(SHAPE, seed=2)
    x = dp.scatter(t if RANK == src else None, dec.grid, dec.shard, src=src)
    assert x.requires_grad and not x.is_leaf
    (torch.tanh(x) * w).sum().backward()
    if RANK == src:
        torch.testing.assert_close(t.grad, w * (1 - torch.tanh(t.detach()) ** 2))
    else:
        assert t.grad is None


# -- from_local ---------------------------------------------------------------------------------
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_from_local_learns_or_takes_the_sizes(grid_ndim, kind):
    dec = _dec(grid_ndim, kind)
    sizes = {d: list(dec.block_sizes(d)) for d in dec.shard}
    t = global_tensor(SHAPE, seed=3)
    block = t[dec.local_slices()].clone().requires_grad_(True)
    learned = dp.DomainTensor.from_local(block, dec.grid, dec.shard)
    given = dp.DomainTensor.from_local(block, dec.grid, dec.shard, sizes=sizes)
    assert learned.decomposition == dec and given.decomposition == dec
    assert learned.shape == SHAPE and learned.to_local() is block
    torch.testing.assert_close(learned.full_tensor(), t, rtol=0, atol=0)
    # Gradients flow to the block: to_local is the block itself, full_tensor an allgather.
    w = global_tensor(SHAPE, seed=4)
    (learned.full_tensor() * w).sum().backward()
    torch.testing.assert_close(block.grad, w[dec.local_slices()], rtol=0, atol=0)
    block.grad = None
    (given.to_local() * 3).sum().backward()
    torch.testing.assert_close(block.grad, torch.full_like(block, 3.0), rtol=0, atol=0)


@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_full_tensor_matches_one_process_with_grads(grid_ndim, kind):
    dec = _dec(grid_ndim, kind)
    sizes = {d: list(dec.block_sizes(d)) for d in dec.shard}
    assert_matches_single_process(lambda x: x.full_tensor() * 2 if isinstance(x, dp.DomainTensor)
                                  else x * 2, global_tensor(SHAPE, seed=5), dec.grid, dec.shard,
                                  sizes=sizes or None)


# -- redistribute, grad, repr --------------------------------------------------------------------
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_redistribute(grid_ndim, kind):
    dec = _dec(grid_ndim, kind)
    t = global_tensor(SHAPE, seed=6)
    x = dp.DomainTensor(t[dec.local_slices()].clone().requires_grad_(True), dec)
    # Move every sharded dim one place along (dims 0, 1, 2 of the 4).
    shard = {d: a for d, a in zip((0, 1, 3), dec.shard.values())}
    other = {d: sizes_for(SHAPE[d], dec.grid.dims[a], "zero", seed=2) for d, a in shard.items()}
    other = {d: s for d, s in other.items() if s is not None} or None
    y = x.redistribute(shard, other)
    assert y.decomposition == dp.Decomposition(SHAPE, dec.grid, shard, other)
    torch.testing.assert_close(y.to_local(), t[y.decomposition.local_slices()], rtol=0, atol=0)
    w = global_tensor(SHAPE, seed=7)
    (y * w).sum().backward()
    assert isinstance(x.grad, dp.DomainTensor) and x.grad.decomposition == dec
    torch.testing.assert_close(x.grad.full_tensor(), w, rtol=0, atol=0)


def test_repr_names_the_layout():
    dec = _dec(2, "uneven")
    x = dp.DomainTensor(global_tensor(SHAPE)[dec.local_slices()], dec)
    text = repr(x)
    assert text.startswith("DomainTensor(global_shape=(2, 3, 7, 6)")
    assert "dim 2 (size 7) over grid axis 0" in text and "float64" in text
    assert str(x) == text


# -- allow_gather --------------------------------------------------------------------------------
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_allow_gather_runs_an_op_with_no_rule_like_one_process(grid_ndim, kind):
    dec = _dec(grid_ndim, kind)
    sizes = {d: list(dec.block_sizes(d)) for d in dec.shard} or None

    def f(x):
        with dp.allow_gather():
            y = torch.cumprod(x, dim=2) + x.cumsum(3)
            z = torch.sort(x, dim=2).values
        return y * z

    assert_matches_single_process(f, global_tensor(SHAPE, seed=8), dec.grid, dec.shard,
                                  sizes=sizes)


def test_without_allow_gather_an_op_with_no_rule_raises_naming_it():
    dec = _dec(1, "uneven")
    x = dp.DomainTensor(global_tensor(SHAPE)[dec.local_slices()], dec)
    raises_on_every_rank(dp.UnsupportedOpError, r"cumprod.*dim 2 \(size 7\)",
                         lambda: torch.cumprod(x, dim=2))
    raises_on_every_rank(dp.UnsupportedOpError, r"cumprod.*allow_gather",
                         lambda: x.cumprod(2))


# -- bad input: the same error on every rank --------------------------------------------------------
def test_from_local_with_unsharded_dims_that_differ():
    grid = dp.ProcessGrid((SIZE,))
    block = torch.zeros(3 + (RANK == SIZE - 1 and SIZE > 1), 4, dtype=torch.float64)
    if SIZE > 1:
        raises_on_every_rank(dp.LayoutError, "dim 0 is not sharded but its size differs",
                             lambda: dp.DomainTensor.from_local(block, grid, {1: 0}))
    x = dp.DomainTensor.from_local(torch.zeros(3, 4, dtype=torch.float64), grid, {1: 0})
    assert x.shape == (3, 4 * SIZE)


def test_from_local_with_dtypes_that_differ():
    grid = dp.ProcessGrid((SIZE,))
    dtype = torch.float32 if RANK == SIZE - 1 and SIZE > 1 else torch.float64
    block = torch.zeros(2, 3, dtype=dtype)
    if SIZE > 1:
        raises_on_every_rank(dp.LayoutError, "dtype",
                             lambda: dp.DomainTensor.from_local(block, grid, {0: 0}))
        raises_on_every_rank(dp.LayoutError, "dtype", lambda: dp.DomainTensor.from_local(
            block, grid, {0: 0}, sizes={0: [2] * SIZE}))


def test_domain_tensors_on_two_grids_do_not_mix():
    g1, g2 = dp.ProcessGrid((SIZE,)), dp.ProcessGrid((SIZE,))
    t = global_tensor((4, 5))
    a = dp.scatter(t, g1, {0: 0})
    b = dp.scatter(t, g2, {0: 0})
    raises_on_every_rank(dp.UnsupportedOpError, "different process grids", lambda: a + b)
    raises_on_every_rank(dp.UnsupportedOpError, "different process grids",
                         lambda: torch.mul(a, b))


def test_scatter_requires_grad_on_integer_data():
    grid = dp.ProcessGrid((SIZE,))
    src = SIZE - 1
    t = torch.arange(12).reshape(3, 4) if RANK == src else None
    raises_on_every_rank(dp.DomainparError, "requires_grad=True needs floating point",
                         lambda: dp.scatter(t, grid, {1: 0}, src=src, requires_grad=True))
    x = dp.scatter(t, grid, {1: 0}, src=src)
    torch.testing.assert_close(x.full_tensor(), torch.arange(12).reshape(3, 4))
