"""dp.Balancer on 1-4 ranks: training on rebalanced (uneven) layouts gives one
process's numbers in float64; every rank agrees on the sizes; hysteresis keeps
noisy throughputs from moving the layout back and forth; bad figures raise on
every rank; comm/clock counts blocked time once per outermost call.

Throughputs are injected (``step(compute_seconds=...)`` from a chosen speed
per rank and seeded noise), so nothing here depends on the machine's timing.
"""
import copy

import numpy as np
import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.comm import clock
from domainpar.testing import (
    assert_matches_single_process,
    check_on_every_rank,
    layout,
    raises_on_every_rank,
    shard_like,
)
from tensor_cases import RANK, SIZE, global_tensor

pytestmark = pytest.mark.mpi


def speed(rank: int) -> float:
    """The injected throughput of ``rank`` (cells per second): rank r is r + 1 times rank 0's."""
    return 1.0 + rank


def injected(balancer, step: int = 0, noise: float = 0.0) -> float:
    """This rank's compute seconds for its current block at ``speed``, times
    (1 + uniform noise in [-noise, noise]) drawn from (step, rank)."""
    cells = np.prod(balancer.decomposition.local_shape())
    jitter = np.random.default_rng(1000 * step + RANK).uniform(-noise, noise)
    return float(cells / speed(RANK) * (1 + jitter))


def agreed(value) -> bool:
    """Whether ``value`` (its repr) is the same on every rank."""
    return len(set(MPI.COMM_WORLD.allgather(repr(value)))) == 1


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.c2 = torch.nn.Conv2d(4, 1, 3, padding=1, padding_mode="circular")

    def forward(self, x):
        return self.c2(torch.tanh(self.c1(x)))


def rebalanced(grid, shard, shape, steps=3):
    """A Balancer on ``shape`` that has moved to the injected speeds."""
    balancer = dp.Balancer(dp.Decomposition(shape, grid, shard), warmup=0)
    for i in range(steps):
        balancer.step(compute_seconds=injected(balancer, i))
    return balancer


@pytest.mark.parametrize("grid_ndim", [1, 2, 3])
def test_model_on_rebalanced_layout_matches_one_process(grid_ndim):
    shape = (2, 2, 13, 11)
    grid, shard, _ = layout(shape, (2, 3), grid_ndim, "even")
    balancer = rebalanced(grid, shard, shape)
    if SIZE > 1 and grid_ndim == 1:
        assert balancer.history[0]["moved"]
        assert len(set(balancer.sizes[2])) > 1  # uneven after balancing
    check_on_every_rank(agreed(balancer.sizes), f"sizes {balancer.sizes}")
    torch.manual_seed(0)
    model = ConvNet().double()
    x = global_tensor(shape, torch.float64, seed=4)
    assert_matches_single_process(model, x, grid, shard, sizes=balancer.sizes,
                                  wrap=lambda m: dp.DomainParallel(m, grid))


def train(model, batches, targets, balancer=None, inject=True):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(zip(batches, targets)):
        if balancer is not None:
            x, y = balancer.layout(x), balancer.layout(y)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        if balancer is not None:
            balancer.step(compute_seconds=injected(balancer, i) if inject else None)
    return model


def test_training_while_rebalancing_matches_one_process():
    """Four SGD steps, the layout moving between them; targets have other channels."""
    grid = dp.ProcessGrid((SIZE,), periodic=True)
    torch.manual_seed(0)
    model = ConvNet().double()
    xs = [global_tensor((2, 2, 17, 6), torch.float64, seed=10 + i) for i in range(4)]
    ys = [global_tensor((2, 1, 17, 6), torch.float64, seed=20 + i) for i in range(4)]
    reference = train(copy.deepcopy(model), xs, ys)
    balancer = dp.Balancer(dp.Decomposition(xs[0].shape, grid, {2: 0}), warmup=0)
    sharded = dp.DomainParallel(copy.deepcopy(model), grid)
    train(sharded, [shard_like(x, grid, {2: 0}) for x in xs],
          [shard_like(y, grid, {2: 0}) for y in ys], balancer)
    if SIZE > 1:
        assert any(h["moved"] for h in balancer.history)
    got = dict(sharded.module.named_parameters())
    for name, want in reference.named_parameters():
        torch.testing.assert_close(got[name].detach(), want.detach(), rtol=1e-10, atol=1e-12)


def test_sizes_follow_throughputs_and_every_rank_agrees():
    grid = dp.ProcessGrid((SIZE,))
    balancer = rebalanced(grid, {0: 0}, (120, 3), steps=4)
    want = np.array([speed(r) for r in range(SIZE)])
    share = np.array(balancer.sizes[0]) / 120
    assert np.abs(share - want / want.sum()).max() < 0.02
    np.testing.assert_allclose(balancer.throughput_estimate(), want)
    np.testing.assert_allclose(balancer.shares(), share)  # the layout chosen
    assert balancer.predicted_step() == pytest.approx(balancer.ideal_step(), rel=0.05)
    check_on_every_rank(agreed((balancer.sizes, balancer.history)), "history differs")


def test_fixed_cost_per_step_is_fitted_and_balanced():
    """Each rank's step takes fixed[r] + cells / speed[r] (the last rank has a
    large fixed cost): after the first move the Balancer fits the fixed part
    from the two layouts and the second move equalises the times, to within a
    few percent of the best continuous split; every rank agrees."""
    grid = dp.ProcessGrid((SIZE,))
    fixed = [60.0] + [0.0] * (SIZE - 1)  # on the slowest rank, whose block shrinks most
    balancer = dp.Balancer(dp.Decomposition((240, 3), grid, {0: 0}), warmup=0, threshold=0.02)

    def times():
        rows = balancer.sizes[0]
        return [fixed[r] + 3 * rows[r] / speed(r) for r in range(SIZE)]
    for _ in range(12):
        balancer.step(compute_seconds=times()[RANK])
    check_on_every_rank(agreed(balancer.history), "histories differ")
    if SIZE == 1:
        assert not balancer.history or not any(h["moved"] for h in balancer.history)
        return
    rate = np.array([3 / speed(r) for r in range(SIZE)])  # seconds per row
    best = (240 + sum(f / c for f, c in zip(fixed, rate))) / sum(1 / rate)  # equal times
    assert max(times()) <= best * 1.05, (times(), best, balancer.history)
    np.testing.assert_allclose(balancer.fixed_seconds(), fixed, atol=1e-6)


def moves(threshold, smoothing, steps=40, noise=0.03, noise_margin=3.0):
    grid = dp.ProcessGrid((SIZE,))
    balancer = dp.Balancer(dp.Decomposition((60, 4), grid, {0: 0}), threshold=threshold,
                           smoothing=smoothing, noise_margin=noise_margin)
    seen = [balancer.sizes]
    for i in range(steps):
        if balancer.step(compute_seconds=injected(balancer, i, noise)):
            seen.append(balancer.sizes)
    check_on_every_rank(agreed(seen), f"sizes seen {seen}")
    return seen


def test_hysteresis_stops_oscillation_under_noise():
    """+-3% noise: with the default threshold (5%) the layout moves once (or
    twice) and stays; with no threshold, no noise margin and no smoothing it
    keeps moving."""
    steady = moves(threshold=0.05, smoothing=0.5)
    if SIZE == 1:
        assert len(steady) == 1
        return
    assert 2 <= len(steady) <= 3, steady
    final = np.array(steady[-1][0]) / 60
    want = np.array([speed(r) for r in range(SIZE)])
    assert np.abs(final - want / want.sum()).max() < 0.05
    jumpy = moves(threshold=0.0, smoothing=1.0, noise_margin=0.0)
    assert len(jumpy) > len(steady) + 3, jumpy


def test_noise_margin_keeps_jitter_from_moving_blocks():
    """Equal ranks measured with +-30% jitter: the margin grows past the
    threshold and the blocks stay; the same jitter on unequal ranks still moves
    them once, towards the true speeds."""
    grid = dp.ProcessGrid((SIZE,))
    for unequal in (False, True):
        balancer = dp.Balancer(dp.Decomposition((60, 4), grid, {0: 0}))
        for i in range(30):
            cells = np.prod(balancer.decomposition.local_shape())
            jitter = np.random.default_rng(1000 * i + RANK).uniform(-0.3, 0.3)
            rate = speed(RANK) if unequal else 1.0
            balancer.step(compute_seconds=float(cells / rate * (1 + jitter)))
        moves = sum(h["moved"] for h in balancer.history)
        check_on_every_rank(agreed(balancer.history), "histories differ")
        if SIZE == 1:
            continue
        assert balancer.margin() > 0.1
        assert moves == (1 if unequal else 0), balancer.history


def test_every_and_warmup_delay_the_first_move():
    grid = dp.ProcessGrid((SIZE,))
    balancer = dp.Balancer(dp.Decomposition((40, 2), grid, {0: 0}), every=3, warmup=1)
    moved = [balancer.step(compute_seconds=injected(balancer, i)) for i in range(3)]
    assert moved == [False, False, SIZE > 1]


def test_bad_figures_and_options_raise_on_every_rank():
    grid = dp.ProcessGrid((SIZE,))
    dec = dp.Decomposition((8, 3), grid, {0: 0})
    balancer = dp.Balancer(dec)
    bad = float("nan") if RANK == SIZE - 1 else 1.0
    raises_on_every_rank(dp.LayoutError, ["finite number >= 0", f"rank(s) [{SIZE - 1}]"],
                         lambda: balancer.step(compute_seconds=bad))
    threshold = 0.05 if RANK else 2.0
    raises_on_every_rank(dp.DomainparError, "threshold",
                         lambda: dp.Balancer(dec, threshold=threshold))
    raises_on_every_rank(dp.LayoutError, "must name sharded dims",
                         lambda: dp.Balancer(dec, dims=[1]))
    raises_on_every_rank(dp.LayoutError, "clock must be 'wall' or 'cpu'",
                         lambda: dp.Balancer(dec, clock="gpu"))
    raises_on_every_rank(dp.LayoutError, "noise_margin must be a number >= 0",
                         lambda: dp.Balancer(dec, noise_margin=-1 if RANK == 0 else 3))
    other = shard_like(torch.zeros(9, 3), grid, {0: 0})
    raises_on_every_rank(dp.LayoutError, "does not match the balanced layout",
                         lambda: balancer.layout(other))


def test_adopt_takes_another_partitioners_layout():
    grid = dp.ProcessGrid((SIZE,))
    balancer = dp.Balancer(dp.Decomposition((30, 2), grid, {0: 0}), warmup=0)
    sizes = [0] * (SIZE - 1) + [30]  # every point on the last rank, as a partitioner might
    balancer.adopt(dp.Decomposition((30, 2), grid, {0: 0}, {0: sizes}))
    assert balancer.sizes == {0: tuple(sizes)}
    balancer.step(compute_seconds=injected(balancer))
    moved = balancer.step(compute_seconds=injected(balancer, 1))
    assert moved == (SIZE > 1) and min(balancer.sizes[0]) >= 1
    raises_on_every_rank(dp.LayoutError, "is not a layout of the balanced shape",
                         lambda: balancer.adopt(dp.Decomposition((31, 2), grid, {0: 0})))


@pytest.mark.parametrize("clock_kind", ["wall", "cpu"])
def test_measured_step_without_injection_runs_and_agrees(clock_kind):
    """The measured path: real timing, so only agreement and sanity are checked."""
    grid = dp.ProcessGrid((SIZE,))
    torch.manual_seed(0)
    model = dp.DomainParallel(ConvNet().double(), grid)
    xs = [shard_like(global_tensor((1, 2, 16, 8), torch.float64, seed=i), grid, {2: 0})
          for i in range(3)]
    ys = [shard_like(global_tensor((1, 1, 16, 8), torch.float64, seed=9), grid, {2: 0})] * 3
    balancer = dp.Balancer(xs[0].decomposition, warmup=1, clock=clock_kind)
    train(model, xs, ys, balancer, inject=False)
    estimate = balancer.throughput_estimate()
    assert estimate is not None and np.all(estimate > 0)
    check_on_every_rank(agreed((balancer.sizes, estimate.tolist())), "estimates differ")


def test_clock_counts_outermost_calls_once():
    grid = dp.ProcessGrid((SIZE,))
    dec = dp.Decomposition((8, 3), grid, {0: 0})
    halo = dp.HaloExchange(dec, {0: 1})
    seconds, calls = clock.blocked_seconds(), clock.blocking_calls()
    halo.fill(np.zeros((dec.local_shape()[0] + 2, 3)))  # checks agree inside: still one call
    assert clock.blocking_calls() == calls + 1
    assert clock.blocked_seconds() > seconds
    assert clock.blocked_seconds(cpu=True) >= 0 and clock.now(cpu=True) > 0
