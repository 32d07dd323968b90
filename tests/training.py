"""Training parity for the model tests: a few optimizer steps on sharded data
must end with the parameters (and buffers) one process gets on the whole
tensors. The one-process run is made on rank 0 and broadcast."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

COMM = MPI.COMM_WORLD


def train(model, x, target, params, steps: int, lr: float = 0.05,
          optimizer: Callable | None = None) -> list[float]:
    """``steps`` on the mean squared error, by ``optimizer(params)`` (default:
    SGD with momentum at ``lr``); the losses."""
    opt = (optimizer or (lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9)))(params)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def reference(make_model: Callable, x, target, steps: int, lr: float = 0.05):
    """Collective. One process's final state_dict and losses (run on rank 0)."""
    result = None
    if COMM.Get_rank() == 0:
        model = make_model()
        losses = train(model, x, target, model.parameters(), steps, lr)
        result = ({k: v.detach().clone() for k, v in model.state_dict().items()}, losses)
    return COMM.bcast(result, root=0)


def assert_same_state(model, losses, want, rtol: float = 1e-10, atol: float = 1e-12):
    """Collective. ``model``'s state and ``losses`` equal ``want`` (from ``reference``)
    on every rank; a difference on any rank fails every rank."""
    want_state, want_losses = want
    assert losses == pytest.approx(want_losses, rel=rtol)
    problems = []
    for name, got in model.state_dict().items():
        ref = want_state[name]
        if got.is_floating_point() or got.is_complex():
            if not torch.allclose(got, ref, rtol=rtol, atol=atol):
                problems.append(f"{name}: max abs difference {float((got - ref).abs().max()):.3e}")
        elif not torch.equal(got, ref):
            problems.append(f"{name}: {got} != {ref}")
    stories = COMM.allgather(problems)
    assert not any(stories), stories
