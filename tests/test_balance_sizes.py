"""The balancer's arithmetic (domainpar.balance.sizes), serial: rounding that
minimises the slowest block's time (checked against every composition of small
sizes), minimum sizes and units, the separable fit on 2-D grids, and the
predicted saving; the fit of a fixed cost per step and the plan that
equalises times with it."""
import itertools
import math

import numpy as np
import pytest

from domainpar.balance import (
    affine_fit,
    affine_plan,
    affine_times,
    balanced_plan,
    damped,
    gain,
    predicted_time,
    proportional_sizes,
)


def compositions(n, parts):
    for cuts in itertools.combinations_with_replacement(range(n + 1), parts - 1):
        edges = (0, *cuts, n)
        yield tuple(b - a for a, b in zip(edges, edges[1:]))


@pytest.mark.parametrize("n", [0, 1, 5, 11])
@pytest.mark.parametrize("speeds", [(1, 1), (1, 3), (0.2, 1, 2.5), (3, 1, 1, 0.5)])
@pytest.mark.parametrize("min_size", [0, 1, 2])
def test_rounding_is_the_best_composition(n, speeds, min_size):
    got = proportional_sizes(n, speeds, min_size)
    assert sum(got) == n
    floor = min(min_size, n // len(speeds))
    allowed = [c for c in compositions(n, len(speeds)) if min(c) >= floor]
    best = min(max(s / w for s, w in zip(c, speeds)) for c in allowed)
    assert min(got) >= floor
    assert max(s / w for s, w in zip(got, speeds)) == pytest.approx(best)


def test_proportional_to_speed():
    assert proportional_sizes(100, [1, 3]) == (25, 75)
    assert proportional_sizes(90, [1, 2, 3, 3]) == (10, 20, 30, 30)
    assert proportional_sizes(10, [0.001, 1, 1], min_size=2) == (2, 4, 4)


def test_units_keep_whole_rows_and_the_remainder_goes_last():
    got = proportional_sizes(35, [1, 2, 1], unit=4)
    assert sum(got) == 35 and all(s % 4 == 0 for s in got[:-1]) and got[-1] % 4 == 3
    assert got[:2] == (8, 16)


def test_separable_throughputs_are_balanced_exactly_on_a_2d_grid():
    dims = (2, 3)
    coords = list(itertools.product(range(2), range(3)))
    s0, s1 = (1.0, 3.0), (1.0, 2.0, 1.0)
    throughput = [s0[a] * s1[b] for a, b in coords]
    shard = {1: 0, 2: 1}
    plan = balanced_plan((1, 40, 48), shard, dims, coords, throughput, dims=(1, 2))
    assert plan == {1: (10, 30), 2: (12, 24, 12)}
    times = [plan[1][a] * plan[2][b] / t for (a, b), t in zip(coords, throughput)]
    assert max(times) == pytest.approx(min(times))
    even = {1: (20, 20), 2: (16, 16, 16)}
    assert predicted_time(even, shard, coords, throughput) == pytest.approx(320)
    assert gain(even, plan, shard, coords, throughput) == pytest.approx(1 - 120 / 320)


def test_only_the_named_dims_move():
    coords = [(0,), (1,)]
    plan = balanced_plan((30, 8), {0: 0}, (2,), coords, [1.0, 2.0], dims=(0,))
    assert plan == {0: (10, 20)}
    assert gain({0: (10, 20)}, plan, {0: 0}, coords, [1.0, 2.0]) == 0.0


def test_no_saving_is_zero_not_negative():
    coords = [(0,), (1,)]
    assert gain({0: (10, 20)}, {0: (20, 10)}, {0: 0}, coords, [1.0, 2.0]) == 0.0
    assert math.isclose(gain({0: (20, 10)}, {0: (10, 20)}, {0: 0}, coords, [1.0, 2.0]), 0.5)
    assert np.isfinite(predicted_time({0: (0, 30)}, {0: 0}, coords, [1.0, 2.0]))


def test_affine_fit_recovers_a_line_and_falls_back_to_per_cell():
    fixed, per_cell = np.array([0.5, 0.0, 2.0, 1.0]), np.array([0.01, 0.02, 0.01, 0.01])
    before = np.array([100.0, 100.0, 100.0, 100.0])
    now = np.array([150.0, 50.0, 105.0, 100.0])
    got = affine_fit((before, fixed + per_cell * before), (now, fixed + per_cell * now))
    np.testing.assert_allclose(got[0][:2], fixed[:2])
    np.testing.assert_allclose(got[1][:2], per_cell[:2])
    # cells too close (5%) or equal: no line, seconds per cell now
    np.testing.assert_allclose(got[0][2:], 0.0)
    np.testing.assert_allclose(got[1][2:], (fixed + per_cell * now)[2:] / now[2:])
    # a line that is no cost (faster with more cells) falls back too; NaN stays NaN
    fx, pc = affine_fit(([100.0, 100.0], [3.0, 1.0]), ([150.0, 150.0], [2.0, np.nan]))
    assert fx[0] == 0.0 and pc[0] == pytest.approx(2.0 / 150)
    assert np.isnan(fx[1]) and np.isnan(pc[1])
    # a cost growing faster than the cells (a block outgrowing a cache): a
    # negative fixed part, down to minus half the time now; times stay positive
    fx, pc = affine_fit(([100.0, 100.0], [1.0, 1.0]), ([150.0, 120.0], [1.8, 2.4]))
    assert fx[0] == pytest.approx(-0.6) and pc[0] == pytest.approx(0.016)
    assert fx[1] == 0.0 and pc[1] == pytest.approx(2.4 / 120)  # -4.6: too far below 0
    t = affine_times({0: (150, 10)}, {0: 0}, [(0,), (1,)], 1, [-0.6, -0.6], [0.016, 0.016])
    np.testing.assert_allclose(t, [1.8, 0.08])
    # seconds per cell within the noise of each other: no line
    line = ([100.0, 100.0], [1.0, 1.0]), ([150.0, 150.0], [1.4, 1.4])
    fx, pc = affine_fit(*line, noise=[0.01, 0.2])
    assert fx[0] == pytest.approx(0.2) and fx[1] == 0.0 and pc[1] == pytest.approx(1.4 / 150)
    # never measured before (the first layout): no fixed part
    fx, pc = affine_fit(([np.nan], [np.nan]), ([80.0], [4.0]))
    assert fx[0] == 0.0 and pc[0] == pytest.approx(0.05)
    # no line now, but an earlier fit's fixed part (kept when less than the time now)
    fx, pc = affine_fit(([100.0, 100.0], [3.0, 3.0]), ([100.0, 100.0], [3.0, 3.0]), [1.0, 5.0])
    np.testing.assert_allclose(fx, [1.0, 0.0])
    np.testing.assert_allclose(pc, [0.02, 0.03])


@pytest.mark.parametrize("fixed", [(0.0, 0.0), (0.5, 0.0), (0.0, 0.9), (0.3, 0.1, 0.0)])
@pytest.mark.parametrize("n", [7, 40])
def test_affine_plan_is_the_best_composition(fixed, n):
    parts = len(fixed)
    per_cell = np.array([0.01, 0.03, 0.02][:parts])
    coords = [(r,) for r in range(parts)]
    current = {0: tuple(proportional_sizes(n, [1.0] * parts))}
    got = affine_plan((n, 2), {0: 0}, (parts,), coords, current, fixed, per_cell, [0], 1)
    assert sum(got[0]) == n and min(got[0]) >= 1

    def worst(sizes):
        return affine_times({0: sizes}, {0: 0}, coords, 2, fixed, per_cell).max()
    best = min(worst(c) for c in compositions(n, parts) if min(c) >= 1)
    assert worst(got[0]) == pytest.approx(best)


def test_a_move_back_goes_halfway():
    # forward on: as proposed; back: boundaries halfway, in whole units
    assert damped((200, 200), (285, 115), (300, 100)) == (300, 100)
    assert damped((200, 200), (285, 115), (238, 162)) == (262, 138)
    assert damped((285, 115), (262, 138), (284, 116)) == (273, 127)
    assert damped((10, 10, 10), (14, 10, 6), (8, 12, 10)) == (11, 11, 8)
    assert damped((8, 8), (12, 4), (2, 14), unit=2) == (8, 8)  # 7 rows: towards now
    # halfway is where it is already (or too small a block): as proposed
    assert damped((10, 10), (12, 8), (11, 9)) == (11, 9)
    assert damped((1, 1, 1), (1, 1, 1), (2, 0, 1)) == (2, 0, 1)
