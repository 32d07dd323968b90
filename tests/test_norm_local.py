"""Normalization whose statistics are the block's own: no reduced dim is cut over
more than one process (a one-rank grid; a grid that cuts only the batch dim, the
spatial dims sharded on grid axes of one process). torch's kernel runs on the
block; output, input gradient and weight/bias gradients match one process, and
no per-block moments are taken (the sharded-statistics path is not entered)."""
import copy

import pytest
import torch
import torch.nn as nn
from mpi4py import MPI

import domainpar as dp
from domainpar.ops import norm
from domainpar.testing import assert_matches_single_process, shard_like
from tensor_cases import SIZE, global_tensor

pytestmark = pytest.mark.mpi

C = 4
SHAPE = (3, C, 7, 6)  # (N, C, H, W): 3 samples, so 4 ranks give a zero-size batch block
INPUT_SEED = 3


def _affine(m):
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5 + 1.0)
    return m


def one_rank():
    """Each rank's own one-rank grid, H and W sharded on its axes of one process."""
    return dp.ProcessGrid((1, 1), comm=MPI.COMM_SELF), {2: 0, 3: 1}


def batch_cut():
    """The batch dim cut over every rank, H and W sharded on grid axes of one process."""
    return dp.ProcessGrid((SIZE, 1, 1)), {0: 0, 2: 1, 3: 2}


# Per-sample statistics: local on both layouts.
PER_SAMPLE = {
    "GroupNorm(2)": lambda: _affine(nn.GroupNorm(2, C)),
    "GroupNorm(4) no affine": lambda: nn.GroupNorm(4, C, affine=False),
    "LayerNorm(H, W)": lambda: _affine(nn.LayerNorm((7, 6))),
    "InstanceNorm2d affine": lambda: _affine(nn.InstanceNorm2d(C, affine=True)),
}
# Statistics over the batch, or running statistics: local on a one-rank grid only.
WHOLE_BATCH = {
    "BatchNorm2d": lambda: _affine(nn.BatchNorm2d(C)),
    "InstanceNorm2d stats": lambda: _affine(nn.InstanceNorm2d(C, affine=True,
                                                               track_running_stats=True)),
}
CASES = ([(n, f, one_rank) for n, f in {**PER_SAMPLE, **WHOLE_BATCH}.items()]
         + [(n, f, batch_cut) for n, f in PER_SAMPLE.items()])
IDS = [f"{n}-{where.__name__}" for n, _, where in CASES]


@pytest.fixture
def no_moments(monkeypatch):
    """The sharded-statistics paths refused: their per-block moments raise (on
    every rank alike, before any message), ``norm.moments`` and the group norm's
    in C (``GroupNormRows``)."""
    def refused(*args, **kwargs):
        raise AssertionError("norm.moments called: the sharded-statistics path was taken")

    class Refused:
        @staticmethod
        def apply(*args, **kwargs):
            raise AssertionError("GroupNormRows called: the sharded-statistics path was taken")
    monkeypatch.setattr(norm, "moments", refused)
    monkeypatch.setattr(norm, "GroupNormRows", Refused)


@pytest.mark.parametrize("name,make,where", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_statistics_match_one_process(name, make, where, dtype, no_moments):
    grid, shard = where()
    assert_matches_single_process(make().to(dtype), global_tensor(SHAPE, dtype, INPUT_SEED),
                                  grid, shard)


@pytest.mark.parametrize("name", list(WHOLE_BATCH))
def test_running_statistics_on_a_one_rank_grid(name, no_moments):
    """torch's kernel updates the running statistics from the block, which is the
    whole tensor: the same numbers as one process after two steps."""
    ref = WHOLE_BATCH[name]().double()
    mine = copy.deepcopy(ref)
    grid, shard = one_rank()
    for seed in (INPUT_SEED, INPUT_SEED + 1):
        x = global_tensor(SHAPE, seed=seed)
        ref(x)
        mine(shard_like(x, grid, shard))
    for a, b in zip(ref.buffers(), mine.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)


def test_a_cut_spatial_dim_takes_the_sharded_path(no_moments):
    """The refusal in ``no_moments`` can fail: a spatial dim cut over two or more
    processes needs the statistics of every block."""
    if SIZE == 1:
        pytest.skip("needs 2 ranks to cut a spatial dim")
    grid = dp.ProcessGrid((SIZE,))
    x = shard_like(global_tensor(SHAPE), grid, {2: 0})
    with pytest.raises(AssertionError, match="sharded-statistics path"):
        nn.GroupNorm(2, C).double()(x)
