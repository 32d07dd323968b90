"""A 3-D UNet (domainpar.testing.models.UNet3d: conv + GroupNorm + GELU blocks,
strided-conv down, transposed-conv up, trilinear up-sampling, skips by cat,
BatchNorm in the bottleneck) trained 5 steps of SGD with momentum on a
1x2xN^3 field, sharded, ends with one process's parameters and BatchNorm
running statistics (float64, rtol 1e-10).

Uneven sizes (62, 63) exercise strides that do not divide the block offsets
and up-sampling back to odd sizes. The one-process run is made once per size
on rank 0 and broadcast.
"""
from __future__ import annotations

import functools

import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.testing import shard_like
from domainpar.testing.models import UNet3d
from training import assert_same_state, reference, train

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
SIZE = COMM.Get_size()
STEPS = 5

# (global size N, grid dims, sharded spatial dims, wrapped in DomainParallel), per rank count
CASES = {
    1: [(64, (1,), (2,), False)],
    2: [(63, (2,), (2,), False), (62, (2,), (3,), True)],
    3: [(64, (3,), (4,), True)],
    4: [(62, (2, 2), (2, 3), False), (63, (4,), (2,), True)],
}


def _data(n: int):
    g = torch.Generator().manual_seed(n)
    x = torch.randn((1, 2, n, n, n), generator=g, dtype=torch.float64)
    target = torch.tanh(x.roll(1, dims=2)) + 0.1 * torch.randn(x.shape, generator=g,
                                                                 dtype=torch.float64)
    return x, target


def _model():
    torch.manual_seed(0)  # the same initial parameters on every rank
    return UNet3d(in_channels=2, out_channels=2, width=2).double()


@functools.cache
def _reference(n: int):
    return reference(_model, *_data(n), STEPS)


@pytest.mark.parametrize("case", CASES.get(SIZE, []), ids=lambda c: "-".join(map(str, c)))
def test_unet_training_matches_one_process(case):
    n, dims, spatial, wrapped = case
    grid = dp.ProcessGrid(dims)
    shard = {d: axis for axis, d in enumerate(spatial)}
    x, target = _data(n)
    xs, ts = shard_like(x, grid, shard), shard_like(target, grid, shard)
    model = _model()
    trained = dp.DomainParallel(model, grid) if wrapped else model
    losses = train(trained, xs, ts, trained.parameters(), STEPS)
    assert_same_state(model, losses, _reference(n))
    # BatchNorm's running statistics are the same on every rank, bit for bit.
    bn = model.bottleneck[0]
    for buf in (bn.running_mean, bn.running_var):
        assert all(torch.equal(buf, other) for other in COMM.allgather(buf))


def test_every_rank_count_has_a_case():
    assert SIZE not in (1, 2, 3, 4) or CASES[SIZE]
