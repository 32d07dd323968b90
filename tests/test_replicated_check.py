"""Replicated tensors (parameters, masks, fields) must hold the same values on
every rank; domainpar checks each once, when it first enters an op on
DomainTensors, and raises the same error on every rank when they differ."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from mpi4py import MPI

import domainpar as dp
from domainpar.testing import raises_on_every_rank, shard_like
from tensor_cases import SIZE, global_tensor

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD


def _x():
    grid = dp.ProcessGrid((SIZE,))
    return grid, shard_like(global_tensor((1, 2, 8, 6)), grid, {2: 0}, requires_grad=True)


def _per_rank_conv():
    torch.manual_seed(100 + COMM.Get_rank())  # a different model on every rank
    return nn.Conv2d(2, 2, 3, padding=1).double()


def test_parameters_that_differ_between_ranks_raise_on_every_rank():
    _, x = _x()
    conv = _per_rank_conv()
    if SIZE == 1:
        conv(x)
    else:
        raises_on_every_rank(dp.MismatchError, ["differ between ranks", "DomainParallel"],
                             lambda: conv(x))


def test_a_mask_that_differs_between_ranks_raises():
    _, x = _x()
    mask = torch.full((6,), float(COMM.Get_rank()), dtype=torch.float64)
    if SIZE == 1:
        x * mask
    else:
        raises_on_every_rank(dp.MismatchError, "differ between ranks", lambda: x * mask)


def test_domain_parallel_makes_them_equal():
    grid, x = _x()
    model = dp.DomainParallel(_per_rank_conv(), grid)  # broadcasts rank 0's parameters
    model(x).sum().backward()
    weight = model.module.weight if hasattr(model, "module") else model.weight
    assert all(torch.equal(weight, w) for w in COMM.allgather(weight.detach()))


def test_equal_values_pass_and_are_checked_once(monkeypatch):
    _, x = _x()
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 2, 3, padding=1).double()
    conv(x)
    from domainpar.tensor import params
    calls = []
    monkeypatch.setattr(params, "agree", lambda *a, **k: calls.append(a))
    conv(x)
    assert calls == []  # the weight and bias were checked on the first call
