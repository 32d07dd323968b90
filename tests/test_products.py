"""Products of two DomainTensors (torch.matmul / @ / torch.bmm / torch.einsum;
domainpar/ops/linear.py and ops/einsum.py) against one process on the whole
tensors: the output and the gradients of both operands, float64 and float32, even,
uneven (on a periodic grid) and zero-size blocks, 1-, 2- and 3-D grids.

- Only shared batch dims sharded (attention over windows or heads): local.
- A sharded contracted dim: partial products and an allreduce-sum; the result is
  replicated along that axis (a plain tensor when no sharded dim remains).
- Free dims of both operands sharded over one grid axis (attention scores with
  both sequences sharded): the smaller operand gathered along the axis (more in
  tests/test_attention_products.py).
"""
import functools

import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.testing import adjoint_test, assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import DTYPES, KINDS, SIZE, global_tensor, sizes_for

pytestmark = pytest.mark.mpi

COMBOS = [(g, k, d) for g in (1, 2, 3) for k in KINDS for d in DTYPES]
IDS = [f"grid{g}-{k}-{str(d)[6:]}" for g, k, d in COMBOS]


@functools.cache
def grid_of(grid_ndim: int, periodic: bool) -> dp.ProcessGrid:
    """One grid per shape of grid for the whole file (all operands must share it)."""
    return dp.ProcessGrid(MPI.Compute_dims(SIZE, grid_ndim), periodic=periodic)


def shard_of(shape, dims, grid, kind):
    """(shard, sizes): ``dims[i]`` cut along grid axis i, as many as the grid has axes."""
    shard = {d: a for a, d in enumerate(dims[:grid.ndim])}
    sizes = {d: sizes_for(shape[d], grid.dims[a], kind) for d, a in shard.items()}
    return shard, ({d: s for d, s in sizes.items() if s is not None} or None)


def check(fn, shapes, dims, grid_ndim, kind, dtype, kinds=None):
    """The oracle for ``fn(*operands)``: operand i of ``shapes[i]`` cut on ``dims[i]``
    (None: a plain replicated tensor) with blocks of ``kinds[i]`` (default: ``kind``)."""
    grid = grid_of(grid_ndim, kind == "uneven")
    maps = [(None, None) if d is None else shard_of(s, d, grid, k)   # None: a plain tensor
            for s, d, k in zip(shapes, dims, kinds or [kind] * len(shapes))]
    inputs = tuple(global_tensor(s, dtype, seed=i) for i, s in enumerate(shapes))
    assert_matches_single_process(fn, inputs, grid, [m[0] for m in maps],
                                  sizes=[m[1] for m in maps])


# -- only batch dims sharded: local ----------------------------------------------------------------
# (batch, heads, windows, tokens, features): the three batch dims cut, on every operand alike
Q, K, V = (4, 3, 5, 6, 4), (4, 3, 5, 7, 4), (4, 3, 5, 7, 3)
BATCH = (0, 1, 2)


def attention(q, k, v):
    """Scores in every spelling, then softmax over the (whole) key dim and @ v."""
    s = (q @ k.transpose(-2, -1) + 2 * torch.matmul(q, k.mT)
         + torch.einsum("abcxd,abcyd->abcxy", q, k) + q.matmul(k.transpose(-1, -2)))
    return torch.softmax(s / 4, dim=-1) @ v


@pytest.mark.parametrize("grid_ndim,kind,dtype", COMBOS, ids=IDS)
def test_attention_over_sharded_batch_dims(grid_ndim, kind, dtype):
    check(attention, (Q, K, V), (BATCH,) * 3, grid_ndim, kind, dtype)


@pytest.mark.parametrize("grid_ndim,kind,dtype", COMBOS, ids=IDS)
def test_bmm_and_broadcast_batch_dims(grid_ndim, kind, dtype):
    """bmm over a sharded batch (the other grid axes replicate); matmul against a
    replicated DomainTensor (broadcast along the sharded batch dims: its gradient is
    summed over their ranks) and one of fewer dims."""
    check(lambda a, b: torch.bmm(a, b) + a.bmm(b), ((6, 5, 4), (6, 4, 3)), ((0,), (0,)),
          grid_ndim, kind, dtype)
    check(lambda a, b: torch.bmm(a, b), ((6, 5, 4), (6, 4, 3)), ((0,), None),  # b plain
          grid_ndim, kind, dtype)
    check(lambda q, k, w: (q @ k.transpose(-2, -1)) @ w, (Q, (5, 7, 4), (7, 2)),
          (BATCH, (), ()), grid_ndim, kind, dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_products_keep_the_layout(kind):
    """The cut batch dims keep their axes and blocks (a dim on an axis of one rank is
    whole, and may come out unsharded)."""
    grid = grid_of(2, False)
    qs, qz = shard_of(Q, BATCH, grid, kind)
    q = shard_like(global_tensor(Q), grid, qs, qz)
    k = shard_like(global_tensor(K, seed=1), grid, qs, qz)
    s = q @ k.transpose(-2, -1)
    cut = {d: a for d, a in qs.items() if grid.dims[a] > 1}
    assert {d: a for d, a in s.decomposition.shard.items() if grid.dims[a] > 1} == cut
    assert all(s.decomposition.block_sizes(d) == q.decomposition.block_sizes(d) for d in cut)


# -- a sharded contracted dim: partial products + allreduce ------------------------------------
@pytest.mark.parametrize("grid_ndim,kind,dtype", COMBOS, ids=IDS)
def test_sharded_contracted_dim(grid_ndim, kind, dtype):
    """The contracted dim on grid axis 0 on both operands; a batch (or a free dim of
    one operand) on axis 1: the result is sharded there and replicated along axis 0."""
    # dot and vector forms: a plain replicated result
    check(lambda x, y, a: torch.matmul(x, y) + (x @ a).sum() + (a.T @ x).sum(),
          ((9,), (9,), (9, 5)), ((0,), (0,), (0,)), grid_ndim, kind, dtype)
    # matrix-vector and matrix-matrix with rows on axis 1
    check(lambda a, v, b: torch.cat([a @ v, (a @ b).sum(-1)]),
          ((6, 9), (9,), (9, 5)), ((1, 0), (0,), (0,)), grid_ndim, kind, dtype)
    # batched: the batch on axis 1, k on axis 0 (matmul, bmm, einsum)
    check(lambda a, b: torch.matmul(a, b) + torch.bmm(a, b) - torch.einsum("bnk,bkm->bnm", a, b),
          ((4, 6, 9), (4, 9, 5)), ((2, 0), (1, 0)), grid_ndim, kind, dtype)


@pytest.mark.parametrize("grid_ndim", (1, 2, 3))
def test_operands_laid_out_differently(grid_ndim):
    """Uneven blocks against balanced ones on the shared batch and contracted dims:
    the second operand is repartitioned onto the first one's blocks."""
    for dims in (((0,), (0,)), ((2, 0), (1, 0))):
        check(lambda a, b: a @ b, ((4, 6, 9), (4, 9, 5)), dims, grid_ndim, "zero",
              torch.float64, kinds=["zero", "even"])


def test_a_fully_contracted_product_is_replicated_and_its_adjoint_holds():
    grid = grid_of(1, False)
    a = shard_like(global_tensor((4, 6, 9)), grid, {2: 0}, sizes_of((4, 6, 9), 2, grid))
    x = shard_like(global_tensor((4, 9, 5), seed=1), grid, {1: 0}, sizes_of((4, 9, 5), 1, grid))
    y = a @ x
    assert not isinstance(y, dp.DomainTensor) or not y.decomposition.shard
    torch.testing.assert_close(_full(y), global_tensor((4, 6, 9)) @ global_tensor((4, 9, 5),
                                                                                     seed=1))
    adjoint_test(lambda t: a @ t, x)                    # x -> A x: output replicated
    adjoint_test(lambda t: (t @ x.detach()).sum(0), a)  # A -> A x, summed over the batch


def sizes_of(shape, d, grid):
    return {d: sizes_for(shape[d], grid.dims[0], "uneven")} if grid.dims[0] > 1 else None


def _full(v):
    return v.full_tensor() if isinstance(v, dp.DomainTensor) else v


# -- free dims of both operands sharded: the smaller one gathered ---------------------------------
def test_attention_scores_with_both_sequences_sharded():
    """Once refused; now q (the smaller operand: 6 tokens against 7) is gathered along
    the axis and the scores come out sharded on the keys, like k
    (tests/test_attention_products.py has the oracle tests, with softmax and v)."""
    grid = grid_of(1, False)
    q = shard_like(global_tensor((2, 6, 4)), grid, {1: 0})
    k = shard_like(global_tensor((2, 7, 4), seed=1), grid, {1: 0})
    kt = k.transpose(-2, -1)
    want = global_tensor((2, 6, 4)) @ global_tensor((2, 7, 4), seed=1).mT
    for s in (torch.matmul(q, kt), q @ kt, torch.bmm(q, kt), torch.einsum("bxd,byd->bxy", q, k)):
        torch.testing.assert_close(_full(s), want)
        assert s.to_local().shape == (2, 6, k.to_local().shape[1])


def test_a_label_sharded_over_two_axes_is_refused():
    """A shared label cut over another grid axis in the second operand: matching the
    first would replicate the second along the axis it is cut on."""
    grid = grid_of(2, False)
    if min(grid.dims) == 1:
        pytest.skip("needs 4 ranks (a 2x2 grid)")
    a = shard_like(global_tensor((4, 6, 9)), grid, {0: 0})
    b = shard_like(global_tensor((4, 9, 5), seed=1), grid, {0: 1})
    raises_on_every_rank(dp.UnsupportedOpError, ["torch.bmm", "gathered along grid axes [1]",
                                                 "redistribute it"],
                         lambda: torch.bmm(a, b))


def test_out_is_refused():
    grid = grid_of(1, False)
    a = shard_like(global_tensor((4, 6, 9)), grid, {0: 0})
    raises_on_every_rank(dp.UnsupportedOpError, ["torch.bmm", "out="],
                         lambda: torch.bmm(a, a.transpose(1, 2), out=torch.empty(4, 6, 6)))
