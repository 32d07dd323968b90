"""Activation checkpointing on a sharded UNet (issue 17, item 1).

Every block of a small UNet3d is wrapped in ``torch.utils.checkpoint``, in both
of its forms: the reentrant one (``use_reentrant=True``, an autograd.Function
that recomputes its block inside backward) and the non-reentrant one (saved
tensor hooks). The loss, the input gradient and every parameter gradient equal
one process's run of the same checkpointed model on the whole tensor (float64,
1e-10), with the model as it is and wrapped in DomainParallel (whose deferred
gradient reduction must also see the gradients of blocks recomputed in backward).
Before the fix the reentrant form cut the graph on DomainTensors: the forward was
right, every gradient upstream of a checkpointed block was None.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from mpi4py import MPI
from torch.utils.checkpoint import checkpoint

import domainpar as dp
from domainpar.testing import assert_matches_single_process
from domainpar.testing.models import UNet3d

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]
SIZE = MPI.COMM_WORLD.Get_size()
N = 12  # 12 -> 6 -> 3 cells through two stride-2 levels: seconds on 1-4 ranks


class Checkpointed(nn.Module):
    """``inner`` run under ``torch.utils.checkpoint`` in the given form."""

    def __init__(self, inner: nn.Module, reentrant: bool):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


def _checkpointed_unet(reentrant: bool) -> nn.Module:
    torch.manual_seed(0)  # the same parameters on every rank
    model = UNet3d(in_channels=2, out_channels=2, width=2, levels=3).double()
    model.enter = Checkpointed(model.enter, reentrant)
    for blocks in (model.encode, model.decode):
        for i in range(len(blocks)):
            blocks[i] = Checkpointed(blocks[i], reentrant)
    model.head = Checkpointed(model.head, reentrant)
    return model


def _grid_and_shard():
    if SIZE == 4:
        return dp.ProcessGrid((2, 2)), {2: 0, 3: 1}
    return dp.ProcessGrid((SIZE,)), {2: 0}


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "DomainParallel"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_unet_matches_one_process(reentrant, wrapped):
    grid, shard = _grid_and_shard()
    x = torch.randn((1, 2, N, N, N), generator=torch.Generator().manual_seed(3),
                    dtype=torch.float64)
    wrap = (lambda m: dp.DomainParallel(m, grid)) if wrapped else None
    errors = assert_matches_single_process(_checkpointed_unet(reentrant), x, grid, shard,
                                           wrap=wrap)
    # The gradients were checked, not skipped: the input's and the first block's exist.
    assert "input 0 gradient" in errors
    assert "gradient of enter.inner.conv.weight" in errors
