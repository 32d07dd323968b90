"""Halo fusion (domainpar/nn/fusion.py): a chain of convs and pointwise ops with
one halo exchange, fused and unfused, each against one process (output, input
gradient, parameter gradients, float64 to 1e-10), on even, uneven and zero-size
blocks, periodic grids, 1-, 2- and 3-D grids, reaches wider than a neighbour's
block; fewer exchanges than unfused; refusals on every rank."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn

import domainpar as dp
from domainpar import UnsupportedOpError
from domainpar.comm import clock
from domainpar.nn.fusion import fused
from domainpar.testing import assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import SIZE, global_tensor, layout

pytestmark = pytest.mark.mpi

CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
SHAPES = {1: (2, 3, 17), 2: (1, 3, 11, 9), 3: (1, 2, 7, 6, 5)}


class Residual(nn.Module):
    """A ResNet block without norm: relu(x + conv(relu(conv(x))))."""

    def __init__(self, nsp: int, c: int, mode: str = "zeros", dilation: int = 1):
        super().__init__()
        self.a = CONVS[nsp](c, c, 3, padding=dilation, dilation=dilation, padding_mode=mode)
        self.b = CONVS[nsp](c, c, 3, padding=1, padding_mode=mode)

    def forward(self, x):
        return torch.relu(x + self.b(nn.functional.relu(self.a(x))))


def _model(name: str, nsp: int, c: int, periodic: bool) -> nn.Module:
    mode = "circular" if periodic else "zeros"
    conv = CONVS[nsp]
    if name == "conv-relu-conv":
        return nn.Sequential(conv(c, 4, 3, padding=1, padding_mode=mode), nn.ReLU(),
                             conv(4, c, 3, padding=1, padding_mode=mode))
    if name == "dilated":  # conv-conv-conv, dilation, groups, an even 'same' kernel
        return nn.Sequential(conv(c, 4, 3, padding=2, dilation=2, padding_mode=mode),
                             conv(4, 4, 3, padding=3, dilation=3, groups=2, padding_mode=mode),
                             nn.Sigmoid(),
                             conv(4, 2, 1) if periodic else conv(4, 2, 2, padding="same"))
    return Residual(nsp, c, mode, dilation=2)


def _cases():
    """Every model on 1-, 2- and 3-D convs, each on every layout kind, the grid's
    number of axes rotating through 1, 2, 3."""
    out = []
    for i, name in enumerate(("conv-relu-conv", "dilated", "residual")):
        for nsp in (1, 2, 3):
            for j, kind in enumerate(("even", "uneven", "zero", "periodic")):
                out.append((name, nsp, 1 + (i + nsp + j) % 3, kind))
    return out


def _check(model, shape, dims, grid_ndim, kind, wrap, seed=0):
    periodic = kind == "periodic"
    grid, shard, sizes = layout(shape, dims, grid_ndim, kind, seed=seed, periodic=periodic)
    return assert_matches_single_process(model, global_tensor(shape, seed=seed), grid, shard,
                                         sizes=sizes, rtol=1e-10, wrap=wrap)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: "-".join(map(str, c)))
def test_fused_and_unfused_match_one_process(case):
    name, nsp, grid_ndim, kind = case
    shape = SHAPES[nsp]
    torch.manual_seed(nsp + grid_ndim)
    model = _model(name, nsp, shape[1], kind == "periodic").double()
    dims = tuple(range(2, 2 + nsp))[::-1] if grid_ndim % 2 else tuple(range(2, 2 + nsp))
    _check(model, shape, dims, grid_ndim, kind, wrap=None)
    _check(model, shape, dims, grid_ndim, kind, wrap=fused)


@pytest.mark.parametrize("kind, n", [("even", 10), ("zero", 10), ("periodic", 10),
                                     ("periodic", 5)])
def test_reach_wider_than_a_neighbours_block(kind, n):
    # 4 convs of reach 4 (k=5): 8 ghost cells per side, blocks of ~1-5 cells
    # (and, periodic on 5 cells, a halo wider than the whole domain)
    mode = "circular" if kind == "periodic" else "zeros"
    torch.manual_seed(3)
    model = nn.Sequential(*[nn.Conv1d(2, 2, 5, padding=2, padding_mode=mode) for _ in range(4)])
    _check(model.double(), (1, 2, n), (2,), 1, kind, wrap=fused)


def test_zero_padding_on_a_periodic_grid_and_float32():
    # zero padding on a periodic grid does not wrap; float32 judged as one process is
    torch.manual_seed(8)
    model = _model("residual", 2, 3, periodic=False)
    grid, shard, sizes = layout(SHAPES[2], (3, 2), 2, "periodic", periodic=True)
    for dtype in (torch.float64, torch.float32):
        assert_matches_single_process(model.to(dtype), global_tensor(SHAPES[2], dtype), grid,
                                      shard, sizes=sizes, rtol=1e-10 if dtype == torch.float64
                                      else None, wrap=fused)


def test_batch_sharded_and_whole_dims_padded_their_own_way():
    # dim 0 and 2 sharded; dim 3 whole, padded by reflect (and reach 0 along dim 2)
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 3, (1, 3), padding=(0, 1), padding_mode="reflect"),
                          nn.GELU(), nn.Conv2d(3, 3, 3, padding=1), nn.Identity(),
                          nn.Conv2d(3, 3, (3, 1), padding=(1, 0)))
    _check(model.double(), (2, 3, 9, 6), (0, 2), 2, "uneven", wrap=fused)


def test_domain_parallel_fuses_eligible_chains(monkeypatch):
    torch.manual_seed(5)
    body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 3, padding=1))
    model = nn.Sequential(body, nn.GroupNorm(1, 3), nn.Conv2d(3, 3, 3, padding=1)).double()
    grid = dp.ProcessGrid(dims=(SIZE,))
    wrap = lambda m: dp.DomainParallel(m, grid, fuse_halos=True)  # noqa: E731
    assert wrap(copy.deepcopy(model)).fused_chains == ["0"]
    _check(model, SHAPES[2], (2, 3), 2, "uneven", wrap=wrap)
    blocks = nn.Sequential(Residual(2, 3), nn.GroupNorm(1, 3), Residual(2, 3)).double()
    assert wrap(copy.deepcopy(blocks)).fused_chains == ["0", "2"]
    _check(blocks, SHAPES[2], (2, 3), 2, "zero", wrap=wrap)
    for value, chains in (("1", ["0"]), ("0", []), (None, [])):
        if value is None:
            monkeypatch.delenv("DOMAINPAR_FUSE_HALOS", raising=False)
        else:
            monkeypatch.setenv("DOMAINPAR_FUSE_HALOS", value)
        assert dp.DomainParallel(copy.deepcopy(model), grid).fused_chains == chains
    monkeypatch.setenv("DOMAINPAR_FUSE_HALOS", "yes")
    raises_on_every_rank(dp.DomainparError, "DOMAINPAR_FUSE_HALOS='yes'",
                         lambda: dp.DomainParallel(copy.deepcopy(model), grid))


def _fills(model, x) -> int:
    names = []

    @contextlib.contextmanager
    def observer(name):
        names.append(name)
        yield

    with clock.observing(observer):
        model(x).sum().backward()
    return names.count("HaloExchange.fill"), names.count("HaloExchange.accumulate")


def test_fused_forward_exchanges_once():
    torch.manual_seed(6)
    make = lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(),  # noqa: E731
                                 nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(2, 2, 3, padding=1)).double()
    grid = dp.ProcessGrid(dims=(SIZE,))
    x = shard_like(global_tensor((1, 2, 12, 5)), grid, {2: 0}, requires_grad=True)
    plain, one = make(), fused(make())
    assert _fills(plain, x) == (3, 3)
    assert _fills(one, x) == (1, 1)


def _sharded(shape=(1, 2, 8, 6)):
    grid = dp.ProcessGrid(dims=(SIZE,))
    return shard_like(global_tensor(shape), grid, {2: 0})


@pytest.mark.parametrize("make, match", [
    (lambda: nn.Sequential(nn.Conv2d(2, 2, 3, stride=2), nn.ReLU()), "stride"),
    (lambda: nn.Sequential(nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2)), "BatchNorm2d"),
    (lambda: nn.Sequential(nn.Conv2d(2, 2, 3), nn.MaxPool2d(2)), "MaxPool2d"),
])
def test_refused_modules(make, match):
    raises_on_every_rank(UnsupportedOpError, match, lambda: fused(make()))


@pytest.mark.parametrize("make, match", [
    (lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect")), "reflect"),
    (lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=0)), "does not keep its size"),
    (lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"),
                           nn.Conv2d(2, 2, 3, padding=1)), "both with zeros and circularly"),
    (lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.Dropout(0.5)), "training mode"),
])
def test_refused_on_the_input(make, match):
    model = fused(make().double())
    x = _sharded()
    raises_on_every_rank(UnsupportedOpError, match, lambda: model(x))


def test_unfusable_input_runs_unfused_in_domain_parallel():
    # a valid conv shrinks the sharded dim: marked by DomainParallel, run unfused
    torch.manual_seed(7)
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=(0, 1)), nn.ReLU(),
                          nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)).double()
    wrap = lambda m: dp.DomainParallel(m, dp.ProcessGrid(dims=(SIZE,)),  # noqa: E731
                                       fuse_halos=True)
    _check(model, (1, 2, 9, 6), (2,), 1, "uneven", wrap=wrap)
    grid = dp.ProcessGrid(dims=(SIZE,))
    x = shard_like(global_tensor((1, 2, 9, 6)), grid, {2: 0}, requires_grad=True)
    unfused = dp.DomainParallel(copy.deepcopy(model), grid, fuse_halos=False)
    assert wrap(copy.deepcopy(model)).fused_chains == [""]
    assert _fills(wrap(copy.deepcopy(model)), x) == _fills(unfused, x) != (1, 1)
    assert _fills(wrap(copy.deepcopy(model)), shard_like(global_tensor((1, 2, 9, 6)), grid, {3: 0})) == (1, 0)
