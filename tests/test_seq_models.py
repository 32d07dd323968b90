"""Sequence and spectral models on sharded 2-D fields, trained 3 steps of SGD
with momentum, end with one process's parameters (float64, rtol 1e-10):

- ViT2d (domainpar.testing.models): patches by a strided conv, the patch grid
  flattened into tokens, ring attention (a hand-written SDPA block and
  nn.MultiheadAttention), tokens back to a field by a transposed conv;
- FNO2d: 4 spectral layers with 12 modes on a 1x1x128x128 field: distributed
  rfft2/irfft2, spectral truncation and complex einsum on the transposed
  layout.

Layouts: the field's H sharded on 1-D grids (even and uneven), batch x domain
and H x W on 2-D grids. Also: the token sequence made from a sharded field
keeps a correct sharding through the reshape.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.testing import assert_matches_single_process, shard_like
from domainpar.testing.models import FNO2d, ViT2d
from training import assert_same_state, reference, train

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
SIZE = COMM.Get_size()
STEPS = 3


def _field(shape, seed):
    """A smooth-ish input and a target that needs information from far away
    (a roll along H), so attention and the spectral path matter."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    target = torch.tanh(x.roll(shape[-2] // 3, dims=-2)) + 0.1 * torch.randn(
        shape, generator=g, dtype=torch.float64)
    return x, target


# -- ViT ---------------------------------------------------------------------------------------
# (batch, H, W, grid dims, shard {dim: axis}, H block sizes or None, DomainParallel)
VIT_CASES = {
    1: [(2, 64, 48, (1,), {2: 0}, None, False)],
    2: [(1, 64, 48, (2,), {2: 0}, None, False), (2, 64, 40, (2,), {2: 0}, [21, 43], True)],
    3: [(1, 64, 48, (3,), {2: 0}, [16, 40, 8], True)],
    4: [(1, 64, 48, (4,), {2: 0}, None, True), (2, 64, 48, (2, 2), {0: 0, 2: 1}, None, False)],
}


def _vit(h, w):
    torch.manual_seed(0)  # the same initial parameters on every rank
    return ViT2d((h, w), patch=8, dim=16, heads=2, depth=2).double()


@functools.cache
def _vit_reference(b, h, w):
    return reference(functools.partial(_vit, h, w), *_field((b, 1, h, w), h), STEPS)


@pytest.mark.parametrize("case", VIT_CASES.get(SIZE, []), ids=lambda c: "-".join(map(str, c)))
def test_vit_training_matches_one_process(case):
    b, h, w, dims, shard, hsizes, wrapped = case
    grid = dp.ProcessGrid(dims)
    sizes = {2: hsizes} if hsizes else None
    x, target = _field((b, 1, h, w), h)
    xs, ts = shard_like(x, grid, shard, sizes), shard_like(target, grid, shard, sizes)
    model = _vit(h, w)
    trained = dp.DomainParallel(model, grid) if wrapped else model
    losses = train(trained, xs, ts, trained.parameters(), STEPS)
    assert_same_state(model, losses, _vit_reference(b, h, w))


@pytest.mark.parametrize("spatial", [(40, 24), (20, 8, 12)], ids=["2d", "3d"])
def test_tokens_of_a_sharded_field_keep_a_correct_sharding(spatial):
    """patchify (strided conv) -> flatten -> transpose, of a 2-D or 3-D field
    sharded on its first spatial dim: the token dim is sharded with each rank
    holding whole slabs of patches, in order (a patch goes to the rank holding its
    centre row), and the values and gradients are one process's."""
    patch = 4
    grid = dp.ProcessGrid((SIZE,))
    n = spatial[0]
    sizes = {2: [0] + [n // (SIZE - 1)] * (SIZE - 2) + [n - n // (SIZE - 1) * (SIZE - 2)]} \
        if SIZE > 2 else None
    torch.manual_seed(0)
    conv = (torch.nn.Conv2d, torch.nn.Conv3d)[len(spatial) - 2]
    embed = conv(3, 8, patch, stride=patch).double()

    def tokens(x):
        return embed(x).flatten(2).transpose(1, 2)

    x = _field((2, 3, *spatial), 1)[0]
    assert_matches_single_process(tokens, x, grid, {2: 0}, sizes=sizes)
    t = tokens(shard_like(x, grid, {2: 0}, sizes))
    assert t.decomposition.shard == {1: 0}
    rows = shard_like(x, grid, {2: 0}, sizes).decomposition.block_sizes(2)
    centre = (patch - 1) // 2
    starts = [max(0, -(-(o - centre) // patch))
              for o in (0, *[sum(rows[:i + 1]) for i in range(SIZE)])]
    per_slab = math.prod(s // patch for s in spatial[1:])
    assert list(t.decomposition.block_sizes(1)) == [(b - a) * per_slab
                                                    for a, b in zip(starts, starts[1:])]


# -- FNO ---------------------------------------------------------------------------------------
# (grid dims, shard {dim: axis}, block sizes or None, DomainParallel)
FNO_CASES = {
    1: [((1,), {2: 0}, None, False)],
    2: [((2,), {2: 0}, None, False), ((2,), {3: 0}, {3: [50, 78]}, True)],
    3: [((3,), {2: 0}, None, True)],
    4: [((4,), {2: 0}, {2: [20, 40, 30, 38]}, True), ((2, 2), {2: 0, 3: 1}, None, False)],
}
FNO_SHAPE = (1, 1, 128, 128)


def _fno():
    torch.manual_seed(0)
    return FNO2d(width=8, modes=12, layers=4).double()


@functools.cache
def _fno_reference():
    return reference(_fno, *_field(FNO_SHAPE, 7), STEPS)


@pytest.mark.parametrize("case", FNO_CASES.get(SIZE, []), ids=lambda c: "-".join(map(str, c)))
def test_fno_training_matches_one_process(case):
    dims, shard, sizes, wrapped = case
    grid = dp.ProcessGrid(dims)
    x, target = _field(FNO_SHAPE, 7)
    xs, ts = shard_like(x, grid, shard, sizes), shard_like(target, grid, shard, sizes)
    model = _fno()
    trained = dp.DomainParallel(model, grid) if wrapped else model
    losses = train(trained, xs, ts, trained.parameters(), STEPS)
    assert_same_state(model, losses, _fno_reference())


def test_every_rank_count_has_a_case():
    assert SIZE not in (1, 2, 3, 4) or (VIT_CASES[SIZE] and FNO_CASES[SIZE])
