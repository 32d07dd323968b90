"""dp.io.ShardedDataset: each rank gets its block of every sample, in an order
that is the same on every rank, with and without prefetch, under mpio and the
serial fallback."""
from __future__ import annotations

import pytest
import torch

import domainpar as dp
from domainpar.io import blocks
from domainpar.testing import check_on_every_rank, raises_on_every_rank, shard_like
from io_cases import COMM, SIZE, expected_padded, fresh
from tensor_cases import global_tensor, layout

pytestmark = pytest.mark.mpi

N = 5
X_SHAPE, Y_SHAPE = (N, 2, 7, 6), (N, 1, 7, 6)


def _files(shared_dir, grid, shard, sizes):
    gx = global_tensor(X_SHAPE, torch.float32, seed=1)
    gy = global_tensor(Y_SHAPE, torch.float64, seed=2)
    path = fresh(shared_dir, "samples")
    dp.io.write(path, "x", shard_like(gx, grid, shard, sizes))
    dp.io.write(path, "y", shard_like(gy, grid, shard, sizes))
    return path, gx, gy


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_samples_shuffled_alike_on_every_rank(shared_dir, mode, prefetch):
    grid, shard, sizes = layout(X_SHAPE, (2, 3), 2, "uneven", periodic=(True, False))
    path, gx, gy = _files(shared_dir, grid, shard, sizes)
    problems = []
    # A seed drawn on rank 0 (with prefetch), or a fixed one whose first two
    # epochs are known to differ (without).
    seed = None if prefetch else 3
    with dp.io.ShardedDataset(path, "x", "y", grid=grid, shard=shard, sizes=sizes,
                              shuffle=True, seed=seed, prefetch=prefetch) as ds:
        if len(ds) != N:
            problems.append(f"len {len(ds)}")
        orders = []
        for _ in range(2):
            order = ds.order()
            orders.append(order)
            got = []
            for x, y in ds:
                got.append((x.to_local().clone(), y.to_local().clone()))
                COMM.allreduce(1)  # the caller's collectives while the thread reads
            for i, (x, y) in zip(order, got):
                want_x = gx[i:i + 1][x_slices(grid, shard, sizes)]
                want_y = gy[i:i + 1][y_slices(grid, shard, sizes)]
                if not torch.equal(x, want_x) or not torch.equal(y, want_y):
                    problems.append(f"sample {i}")
        if sorted(orders[0]) != list(range(N)) or (seed is not None and orders[0] == orders[1]):
            problems.append(f"epoch orders {orders}")
        if COMM.allgather(orders) != [orders] * SIZE:
            problems.append("orders differ between ranks")
        # Prefetch ran in the thread for every sample but each epoch's first.
        if ds.prefetched != (2 * (N - 1) if prefetch else 0):
            problems.append(f"prefetched {ds.prefetched}")
        x, y = ds[3]  # direct access: sample 3 of the file, not of the order
        if not torch.equal(x.to_local(), gx[3:4][x_slices(grid, shard, sizes)]):
            problems.append("ds[3]")
    check_on_every_rank(not problems, problems)


def x_slices(grid, shard, sizes):
    return dp.Decomposition((1,) + X_SHAPE[1:], grid, shard, sizes).local_slices()


def y_slices(grid, shard, sizes):
    return dp.Decomposition((1,) + Y_SHAPE[1:], grid, shard, sizes).local_slices()


def test_inputs_with_halo(shared_dir, mode):
    grid, shard, sizes = layout(X_SHAPE, (2,), 1, "zero", periodic=True)
    path, gx, _ = _files(shared_dir, grid, shard, sizes)
    problems = []
    with dp.io.ShardedDataset(path, "x", grid=grid, shard=shard, sizes=sizes,
                              halo={2: 2, 3: 1}, fill=-1) as ds:
        for k, h in enumerate(ds):
            dec = h.block.decomposition
            want = expected_padded(gx, dec, blocks.widths({2: 2, 3: 1}, dec), {2}, fill=-1,
                                   base=(k, 0, 0, 0))
            if not isinstance(h, dp.io.HaloBlock) or not torch.equal(h.padded, want):
                problems.append(f"sample {k}")
    check_on_every_rank(not problems, problems)


def test_bad_datasets(shared_dir, mode):
    grid = dp.ProcessGrid((SIZE,))
    path, _, _ = _files(shared_dir, grid, {2: 0}, None)
    dp.io.write(path, "short", shard_like(global_tensor((N - 1, 1, 7, 6)), grid, {2: 0}))
    raises_on_every_rank(dp.LayoutError, ["x has 5 samples but short has 4"],
                         lambda: dp.io.ShardedDataset(path, "x", "short", grid=grid, shard={2: 0}))
    raises_on_every_rank(dp.io.DataError, ["no dataset 'z'"],
                         lambda: dp.io.ShardedDataset(path, "x", "z", grid=grid, shard={2: 0}))
    raises_on_every_rank(dp.LayoutError, ["dim 4"],
                         lambda: dp.io.ShardedDataset(path, "x", grid=grid, shard={4: 0}))
    with dp.io.ShardedDataset(path, "x", grid=grid, shard={2: 0}) as ds:
        raises_on_every_rank(IndexError, ["out of range"], lambda: ds[N])
