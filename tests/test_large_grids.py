"""Cases that only larger grids have (issue 20, item 1), for the 8- and 16-rank
stages (``make test`` mpi-n8, ``make test-large``); below 8 ranks they skip.

The rest of those stages' selection is the existing MPI suite, whose layouts
take their grid dims from the world size (2x2x2 halos, rings of 8 blocks, ...);
here only what nothing else covers: DomainParallel training on a batch x
domain x domain grid (batch over one axis, two spatial dims over two more).
"""
import copy

import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.testing import assert_matches_single_process, shard_like
from domainpar.testing.layouts import block_sizes
from tensor_cases import SIZE, global_tensor
from test_domain_parallel import ChannelMLP, assert_same_parameters, train

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(SIZE < 8, reason="needs 8 ranks (a batch x 2x2 grid)")]

SHAPE = (4, 3, 9, 7)  # (B, C, H, W): B over grid axis 0, H and W over axes 1 and 2


def batch_2x2_grid(kind):
    """A 3-D grid (2x2x2 at 8 ranks, 4x2x2 at 16): batch dim 0 over axis 0,
    spatial dims 2 and 3 over axes 1 and 2, blocks ``kind``."""
    dims = MPI.Compute_dims(SIZE, 3)
    grid = dp.ProcessGrid(dims)
    shard = {0: 0, 2: 1, 3: 2}
    sizes = {d: s for d, a in shard.items()
             if (s := block_sizes(SHAPE[d], dims[a], kind)) is not None}
    return grid, shard, sizes or None


@pytest.mark.parametrize("kind", ["even", "uneven", "zero"])
def test_domain_parallel_training_on_a_batch_by_2x2_grid(kind):
    torch.manual_seed(0)
    model = ChannelMLP().double()
    x = global_tensor(SHAPE, seed=1)
    target = global_tensor((SHAPE[0], 2) + SHAPE[2:], seed=2)
    reference = train(copy.deepcopy(model), x, target)
    grid, shard, sizes = batch_2x2_grid(kind)
    wrapped = dp.DomainParallel(copy.deepcopy(model), grid, bucket_cap_mb=0.0001)
    train(wrapped, shard_like(x, grid, shard, sizes), shard_like(target, grid, shard, sizes))
    assert_same_parameters(wrapped, reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("overlap", [True, False], ids=["nonblocking", "blocking"])
def test_domain_parallel_gradients_on_a_batch_by_2x2_grid(overlap):
    torch.manual_seed(1)
    grid, shard, sizes = batch_2x2_grid("uneven")
    assert_matches_single_process(
        ChannelMLP().double(), global_tensor(SHAPE, seed=3), grid, shard, sizes=sizes,
        wrap=lambda m: dp.DomainParallel(m, grid, bucket_cap_mb=1e-5, overlap=overlap))
