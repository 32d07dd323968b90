"""DomainParallel when the ranks' graphs differ (issue 17, item 4).

- A model whose architecture differs between ranks is refused at wrap time with
  the same MismatchError on every rank (it used to hang or truncate in the
  parameter broadcast).
- A parameter used on some ranks only (a learned boundary term that only the
  ranks holding the boundary apply) gets one process's gradient: a rank that did
  not use it contributes zero, whether or not it used any other parameter (the
  buckets used to differ between ranks and hang).
- A backward that raised leaves no half-finished reducer state: the next step's
  gradients are one process's (the engine callback used to stay "queued" forever,
  so .grad was never written again).
Each runs on every rank count; the cases that need two ranks say so.
"""
import copy

import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.comm.errors import MismatchError
from domainpar.testing import raises_on_every_rank, shard_like
from tensor_cases import SIZE, global_tensor

pytestmark = pytest.mark.mpi

RANK = MPI.COMM_WORLD.Get_rank()
SHAPE = (2, 3, 9, 4)  # (batch, channels, x, y): x sharded over every rank
SHARD = {2: 0}


class BoundaryModel(torch.nn.Module):
    """conv (optional), then a learned gain on the x = 0 boundary row, applied only
    where the block holds that row (``edge`` is the row's indicator field)."""

    def __init__(self, with_conv: bool):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1) if with_conv else None
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3).view(3, 1, 1))
        self.edge = None  # set per test: a DomainTensor, or the global tensor

    def forward(self, x):
        y = self.conv(x) if self.conv is not None else x * 1.0
        local = self.edge.to_local() if hasattr(self.edge, "to_local") else self.edge
        if bool(local.any()):  # only the ranks holding the boundary
            y = y + self.gain * self.edge * y
        return y


def edge_field():
    e = torch.zeros(SHAPE, dtype=torch.float64)
    e[:, :, 0, :] = 1.0
    return e


def one_process_grads(model, x):
    ref = copy.deepcopy(model)
    ref.edge = edge_field()
    ref(x).pow(2).sum().backward()
    return {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("overlap", [True, False], ids=["nonblocking", "blocking"])
@pytest.mark.parametrize("with_conv", [True, False], ids=["conv", "gain-only"])
def test_parameter_used_on_some_ranks_only(with_conv, overlap):
    torch.manual_seed(0)
    model = BoundaryModel(with_conv).double()
    x = global_tensor(SHAPE, torch.float64, seed=5)
    want = one_process_grads(model, x)
    grid = dp.ProcessGrid((SIZE,))
    wrapped = dp.DomainParallel(copy.deepcopy(model), grid, bucket_cap_mb=1e-5, overlap=overlap)
    wrapped.module.edge = shard_like(edge_field(), grid, SHARD)
    xs = shard_like(x, grid, SHARD, requires_grad=True)  # a graph on every rank
    for _ in range(2):  # and a second step: no state left over from the first
        wrapped.zero_grad(set_to_none=True)
        wrapped(xs).pow(2).sum().backward()
        for name, p in wrapped.module.named_parameters():
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-12, msg=name)


def test_architecture_differing_between_ranks_is_an_error():
    if SIZE < 2:
        pytest.skip("needs 2 ranks (an architecture that differs between ranks)")
    grid = dp.ProcessGrid((SIZE,))
    layers = [torch.nn.Conv2d(3, 3, 3)] + ([torch.nn.Conv2d(3, 3, 1)] if RANK == SIZE - 1 else [])
    raises_on_every_rank(MismatchError, ["parameters and buffers", f"rank {SIZE - 1}"],
                         lambda: dp.DomainParallel(torch.nn.Sequential(*layers), grid))


ARMED = {"fail": False}


def maybe_fail(g):
    """A gradient hook that raises while armed."""
    if ARMED["fail"]:
        raise RuntimeError("backward failing on purpose")
    return g


class TwoConvs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.b = torch.nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        h = self.a(x)
        h.register_hook(maybe_fail)  # after b's gradients
        return self.b(h)


@pytest.mark.parametrize("overlap", [True, False], ids=["nonblocking", "blocking"])
def test_step_after_a_failed_backward_is_exact(overlap):
    torch.manual_seed(3)
    model = TwoConvs().double()
    x = global_tensor(SHAPE, torch.float64, seed=6)
    ref = copy.deepcopy(model)
    ref(x).pow(2).sum().backward()
    grid = dp.ProcessGrid((SIZE,))
    wrapped = dp.DomainParallel(copy.deepcopy(model), grid, bucket_cap_mb=1e-5, overlap=overlap)
    xs = shard_like(x, grid, SHARD)
    ARMED["fail"] = True
    try:
        with pytest.raises(RuntimeError, match="on purpose"):
            wrapped(xs).pow(2).sum().backward()
    finally:
        ARMED["fail"] = False
    wrapped.zero_grad(set_to_none=True)
    wrapped(xs).pow(2).sum().backward()
    for (name, p), q in zip(wrapped.module.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
