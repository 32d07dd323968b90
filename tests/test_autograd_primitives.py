"""Every autograd Function in domainpar.autograd.primitives against its adjoint:
the dot-product test <F x, y> == <x, F* y> with F* taken from backward, on
random uneven layouts (zero-size blocks, replicated grid axes) over 1-, 2- and
3-D grids, in float64; and each backward equal to its partner's forward."""
import numpy as np
import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar import autograd as ag
from domainpar.testing import adjoint_test, check_on_every_rank, inner
from layouts import random_decomposition, random_layout

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
CASES = [(grid_ndim, seed) for grid_ndim in (1, 2, 3) for seed in range(3)]


def _grid(grid_ndim, seed):
    rng = np.random.default_rng(seed)
    dims = list(MPI.Compute_dims(COMM.Get_size(), grid_ndim))
    rng.shuffle(dims)
    return dp.ProcessGrid(dims), rng


def _shape(rng, ndim, max_extent=7):
    return [int(rng.integers(0, max_extent + 1)) if rng.random() < 0.1 else
            int(rng.integers(1, max_extent + 1)) for _ in range(ndim)]


def _decomposition(grid_ndim, seed):
    """A random decomposition (uneven, maybe zero-size blocks, maybe replicated axes)."""
    grid, rng = _grid(grid_ndim, seed)
    shape = _shape(rng, grid_ndim + int(rng.integers(0, 2)))
    return random_decomposition(rng, grid, shape), rng


def _replicated(shape, seed):
    """The same random tensor on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _per_rank(shape, seed):
    """A different random tensor on every rank."""
    g = torch.Generator().manual_seed(seed * 7919 + 13 + RANK)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _block(dec, seed):
    """This rank's block of a global random tensor (replicas hold the same block)."""
    return _replicated(dec.global_shape, seed)[dec.local_slices()].clone()


def assert_close(got, want, rtol=0.0, atol=0.0):
    """Collective. torch.testing.assert_close on every rank, failing on all alike
    (a rank that fails alone would leave the others waiting in the next collective)."""
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        problem = None
    except AssertionError as exc:
        problem = f"rank {RANK}: {exc}"
    problems = [p for p in COMM.allgather(problem) if p]
    if problems:
        raise AssertionError("; ".join(problems))


def _vjp(forward, x, y):
    """What backward computes for ``forward`` at ``x`` with upstream gradient ``y``."""
    x = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(forward(x), x, y, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


# -- halo fill / accumulate ------------------------------------------------------------------
@pytest.mark.parametrize("grid_ndim,seed", CASES)
@pytest.mark.parametrize("which", ["fill", "fill owned", "accumulate"])
def test_halo_adjoint(grid_ndim, seed, which):
    """The fill, on a copy or in place in a buffer its caller owns (``owned``: a
    clone here, as the ops' freshly padded blocks), and the accumulate are each
    other's adjoints; the backward of each is its partner, bit for bit."""
    _, dec, width = random_layout(seed, COMM, grid_ndim, max_extent=7, max_width=3)
    halo = dp.HaloExchange(dec, width)
    f = {"fill": ag.halo_fill, "accumulate": ag.halo_accumulate,
         "fill owned": lambda t, h: ag.halo_fill(t.clone(), h, owned=True)}[which]
    partner = ag.halo_accumulate if which.startswith("fill") else ag.halo_fill
    x = _per_rank(halo.padded_shape, seed)
    # Every rank's padded array is its own: inner products sum over all ranks.
    adjoint_test(lambda t: f(t, halo), x, x_space=dec.grid.comm, y_space=dec.grid.comm,
                 seed=seed)
    y = _per_rank(halo.padded_shape, seed + 100)
    assert_close(_vjp(lambda t: f(t, halo), x, y), partner(y, halo),
                               rtol=0, atol=0)


@pytest.mark.parametrize("grid_ndim,seed", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_in_place_halo_pair_adjoint(grid_ndim, seed, dtype):
    """fill_in_place and accumulate_in_place (the pair fused Functions such as
    HaloConv call on their own buffers) are each other's adjoints, and the
    autograd pair computes the same values."""
    _, dec, width = random_layout(seed, COMM, grid_ndim, max_extent=7, max_width=3)
    halo = dp.HaloExchange(dec, width)
    x = _per_rank(halo.padded_shape, seed).to(dtype)
    fill = lambda t: ag.primitives.fill_in_place(t.clone(), halo)  # noqa: E731
    acc = lambda t: ag.primitives.accumulate_in_place(t.clone(), halo)  # noqa: E731
    rtol = 1e-10 if dtype == torch.float64 else 2e-2
    adjoint_test(fill, x, adjoint=acc, x_space=dec.grid.comm, y_space=dec.grid.comm,
                 rtol=rtol, seed=seed)
    assert_close(fill(x), ag.halo_fill(x, halo), rtol=0, atol=0)
    assert_close(acc(x), ag.halo_accumulate(x, halo), rtol=0, atol=0)
    owned, expected = x.clone(), fill(x)  # an owned buffer is filled where it is, no copy
    out = ag.halo_fill(owned, halo, owned=True)
    check_on_every_rank(out.data_ptr() == owned.data_ptr() and torch.equal(out, expected),
                        "the owned fill copied its buffer or filled other values")


# -- allreduce-sum / broadcast -----------------------------------------------------------------
@pytest.mark.parametrize("grid_ndim,seed", CASES)
def test_allreduce_sum_adjoint(grid_ndim, seed):
    dec, rng = _decomposition(grid_ndim, seed)
    comm = dec.grid.sub(dec.shard.values())
    x = _per_rank(_shape(rng, 2), seed)
    # Per-rank partials in, one replicated value out.
    adjoint_test(lambda t: ag.allreduce_sum(t, comm), x, x_space=comm, y_space=None, seed=seed)
    y = _replicated(x.shape, seed + 1)
    # Backward is the identity: no rank multiplies the gradient by the comm size.
    assert_close(_vjp(lambda t: ag.AllreduceSum.apply(t, comm), x, y),
                               ag.Broadcast.apply(y, comm, None), rtol=0, atol=0)
    assert_close(_vjp(lambda t: ag.AllreduceSum.apply(t, comm), x, y), y,
                               rtol=0, atol=0)


@pytest.mark.parametrize("grid_ndim,seed", CASES)
def test_broadcast_adjoint(grid_ndim, seed):
    dec, rng = _decomposition(grid_ndim, seed)
    comm = dec.grid.sub(dec.shard.values())
    x = _replicated(_shape(rng, 2), seed)
    # A replicated value in, per-rank copies out: backward sums over comm.
    adjoint_test(lambda t: ag.Broadcast.apply(t, comm, None), x, x_space=None, y_space=comm,
                 seed=seed)
    y = _per_rank(x.shape, seed + 1)
    want = ag.AllreduceSum.apply(y, comm)
    assert_close(_vjp(lambda t: ag.Broadcast.apply(t, comm, None), x, y), want,
                               rtol=0, atol=1e-13)
    assert_close(want, torch.from_numpy(comm.allreduce(y.numpy(), op=MPI.SUM)),
                               rtol=0, atol=1e-13)


def test_broadcast_defers_the_partial_gradient():
    grid = dp.ProcessGrid((COMM.Get_size(),))
    got = []
    x = _replicated((3,), 0).requires_grad_(True)
    (ag.broadcast(x, grid.comm, got.append) * 2).sum().backward()
    assert x.grad is None and len(got) == 1
    assert_close(got[0], torch.full((3,), 2.0, dtype=torch.float64))


# -- scatter / gather --------------------------------------------------------------------------
def _root(dec, seed):
    return int(np.random.default_rng(seed + 5).integers(0, dec.grid.size))


@pytest.mark.parametrize("grid_ndim,seed", CASES)
def test_scatter_adjoint(grid_ndim, seed):
    dec, _ = _decomposition(grid_ndim, seed)
    root = _root(dec, seed)
    x = _replicated(dec.global_shape, seed) if dec.grid.rank == root else \
        torch.empty(0, dtype=torch.float64)
    # The root's global tensor in (others hold nothing), blocks out.
    adjoint_test(lambda t: ag.scatter(t, dec, root), x, x_space=dec.grid.comm, y_space=dec,
                 seed=seed)
    y = _block(dec, seed + 1)
    assert_close(_vjp(lambda t: ag.scatter(t, dec, root), x, y),
                               ag.gather(y, dec, root), rtol=0, atol=0)


@pytest.mark.parametrize("grid_ndim,seed", CASES)
def test_gather_adjoint(grid_ndim, seed):
    dec, _ = _decomposition(grid_ndim, seed)
    root = _root(dec, seed)
    x = _block(dec, seed)
    adjoint_test(lambda t: ag.gather(t, dec, root), x, x_space=dec, y_space=dec.grid.comm,
                 seed=seed)
    y = _replicated(dec.global_shape, seed + 1) if dec.grid.rank == root else \
        torch.empty(0, dtype=torch.float64)
    assert_close(_vjp(lambda t: ag.gather(t, dec, root), x, y),
                               ag.scatter(y, dec, root), rtol=0, atol=0)
    full = ag.gather(x, dec, root)
    assert_close(full, _replicated(dec.global_shape, seed) if dec.grid.rank == root else
                 torch.empty(0, dtype=torch.float64), rtol=0, atol=0)


# -- allgather / shard ---------------------------------------------------------------------------
@pytest.mark.parametrize("grid_ndim,seed", CASES)
def test_allgather_adjoint(grid_ndim, seed):
    dec, _ = _decomposition(grid_ndim, seed)
    x = _block(dec, seed)
    adjoint_test(lambda t: ag.allgather(t, dec), x, x_space=dec, y_space=None, seed=seed)
    assert_close(ag.allgather(x, dec), _replicated(dec.global_shape, seed),
                               rtol=0, atol=0)
    y = _replicated(dec.global_shape, seed + 1)
    assert_close(_vjp(lambda t: ag.allgather(t, dec), x, y), ag.shard(y, dec),
                               rtol=0, atol=0)


@pytest.mark.parametrize("grid_ndim,seed", CASES)
def test_shard_adjoint(grid_ndim, seed):
    dec, _ = _decomposition(grid_ndim, seed)
    x = _replicated(dec.global_shape, seed)
    adjoint_test(lambda t: ag.shard(t, dec), x, x_space=None, y_space=dec, seed=seed)
    y = _block(dec, seed + 1)
    # The replicated tensor's gradient is the blocks' gradients assembled, once.
    assert_close(_vjp(lambda t: ag.shard(t, dec), x, y), ag.allgather(y, dec),
                               rtol=0, atol=0)
    assert_close(_vjp(lambda t: ag.shard(t, dec), x, y),
                               _replicated(dec.global_shape, seed + 1), rtol=0, atol=0)


# -- repartition ------------------------------------------------------------------------------------
@pytest.mark.parametrize("grid_ndim,seed", CASES)
def test_repartition_adjoint(grid_ndim, seed):
    src, rng = _decomposition(grid_ndim, seed)
    dst = random_decomposition(rng, src.grid, src.global_shape)
    x = _block(src, seed)
    f = lambda t: ag.Repartition.apply(t, src, dst)  # noqa: E731  (the Function, even if src == dst)
    adjoint_test(f, x, x_space=src, y_space=dst, seed=seed)
    assert_close(f(x), _block(dst, seed), rtol=0, atol=0)
    y = _block(dst, seed + 1)
    assert_close(_vjp(f, x, y), ag.Repartition.apply(y, dst, src), rtol=0, atol=0)
    assert_close(_vjp(f, x, y), _block(src, seed + 1), rtol=0, atol=0)


@pytest.mark.parametrize("grid_ndim", (1, 2, 3))
def test_repartition_between_layouts_of_the_same_blocks_moves_nothing(grid_ndim):
    """Where every rank holds the same cells under both layouts (a dim cut over a
    grid axis of one process is whole, like one not cut), ``ag.repartition`` hands
    the block back as it is; where any rank's cells differ, it moves them. Both by
    ``Decomposition.same_blocks``, checked against every rank's slices."""
    dims = MPI.Compute_dims(COMM.Get_size(), grid_ndim)
    grid = dp.ProcessGrid(list(dims)[::-1])
    one = [a for a in range(grid_ndim) if grid.dims[a] == 1]
    many = [a for a in range(grid_ndim) if grid.dims[a] > 1]
    shape = (5, 6, 7)
    whole = dp.Decomposition(shape, grid, {})
    pairs = [(whole, whole, True)]
    if one:
        pairs.append((whole, dp.Decomposition(shape, grid, {1: one[0]}), True))
    if many:
        cut = dp.Decomposition(shape, grid, {2: many[0]})
        pairs += [(whole, cut, False),
                  (cut, dp.Decomposition(shape, grid, {2: many[0]}, {2: [7] + [0] * (
                      grid.dims[many[0]] - 1)}), False)]
    for src, dst, same in pairs:
        slices_agree = all(src.local_slices(r) == dst.local_slices(r) for r in range(grid.size))
        assert src.same_blocks(dst) == dst.same_blocks(src) == same == slices_agree
        x = _block(src, 3).requires_grad_()
        out = ag.repartition(x, src, dst)
        assert (out is x) == same
        assert_close(out, _block(dst, 3), rtol=0, atol=0)


@pytest.mark.parametrize("grid_ndim,seed", CASES[:6])
def test_repartition_of_strided_blocks_and_gradients(grid_ndim, seed):
    """Repartition packs straight out of a strided block (a transposed view, a
    slice with steps; no contiguous copy first) and takes a strided gradient:
    the same values as from contiguous ones, forward and backward."""
    src, rng = _decomposition(grid_ndim, seed)
    dst = random_decomposition(rng, src.grid, src.global_shape)
    f = lambda t: ag.Repartition.apply(t, src, dst)  # noqa: E731
    x = _block(src, seed)
    strided = x.mT.contiguous().mT if x.ndim >= 2 else x
    stepped = torch.stack([x, torch.zeros_like(x)], 1).flatten(0, 1)[0::2] if x.ndim else x
    for view in (strided, stepped):
        assert torch.equal(view, x)
        assert_close(f(view), _block(dst, seed), rtol=0, atol=0)
    y = _block(dst, seed + 1)
    y_strided = y.mT.contiguous().mT if y.ndim >= 2 else y
    assert_close(_vjp(f, x, y_strided), _block(src, seed + 1), rtol=0, atol=0)


# -- no P-fold gradients ----------------------------------------------------------------------------
@pytest.mark.parametrize("grid_ndim", [1, 2, 3])
def test_mean_of_a_sharded_tensor_has_gradient_one_over_n(grid_ndim):
    dec, _ = _decomposition(grid_ndim, 11)
    shape = dec.global_shape
    n = int(np.prod(shape))
    block = _block(dec, 3).requires_grad_(True)
    comm = dec.grid.sub(dec.shard.values())
    (ag.allreduce_sum(block.sum(), comm) / max(n, 1)).backward()
    assert_close(block.grad, torch.full_like(block, 1 / max(n, 1)), rtol=0, atol=0)
    # The same through a DomainTensor and its mean rule.
    x = dp.DomainTensor(_block(dec, 3).requires_grad_(True), dec)
    if n:
        x.mean().backward()
        assert_close(x.grad.to_local(), torch.full(dec.local_shape(), 1 / n,
                                                                 dtype=torch.float64))


def test_adjoint_test_catches_a_wrong_adjoint():
    """The helper can fail: a doubled gradient is an O(1) error."""
    dec, _ = _decomposition(1, 1)
    x = _replicated(dec.global_shape, 0)
    if x.numel() == 0:
        x = _replicated((4,), 0)
        dec = dp.Decomposition((4,), dec.grid, {0: 0})
    with pytest.raises(AssertionError, match="adjoint test failed"):
        adjoint_test(lambda t: ag.shard(t, dec), x, y_space=dec,
                     adjoint=lambda y: 2 * ag.allgather(y, dec))
    assert inner(x, x) > 0
