"""Block sizes from per-rank throughputs: the balancer's arithmetic (numpy only).

Local, and deterministic: every rank that passes the same numbers gets the same
sizes, bit for bit, which is how the ranks agree without a second message.

The model: rank ``r`` computes its block at ``throughput[r]`` cells per second,
so its step takes ``cells_r / throughput[r]`` and the step takes the slowest
rank's time. Blocks are a tensor product (each sharded dim is cut once, along
its grid axis), so per-rank throughputs are fitted as a product of one speed
per grid coordinate of each sharded dim (the geometric mean of the ranks at
that coordinate; exact when the throughputs are such a product, as on a 1-D
grid). Each dim's rows are then shared in proportion to its speeds, in whole
``unit`` rows, at least ``min_size`` rows each, rounded so that the predicted
step time is least.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

# Per-rank throughputs or per-coordinate speeds: a list or a numpy array.
Floats: TypeAlias = Sequence[float] | npt.NDArray[Any]


def rank_cells(sizes: Mapping[int, Sequence[int]], shard: Mapping[int, int],
               coords: Sequence[Sequence[int]], rest: int = 1) -> np.ndarray:
    """Local. Each rank's cells with ``sizes`` ({dim: per-coordinate sizes}), in
    rank order; ``rest`` cells per element of the sharded dims (the unsharded
    dims' product)."""
    cells = np.full(len(coords), float(rest))
    for d, a in shard.items():
        cells *= np.asarray(sizes[d], dtype=float)[[c[a] for c in coords]]
    return cells


def predicted_time(sizes: Mapping[int, Sequence[int]], shard: Mapping[int, int],
                   coords: Sequence[Sequence[int]], throughput: Floats) -> float:
    """Local. The slowest rank's time (seconds per cell of the unsharded dims)
    with ``sizes`` ({dim: per-coordinate sizes}) at ``throughput`` (per rank)."""
    times = rank_cells(sizes, shard, coords) / np.asarray(throughput, dtype=float)
    return float(times.max(initial=0.0))


def axis_speeds(throughput: Floats, coords: Sequence[Sequence[int]], axis: int,
                parts: int) -> np.ndarray:
    """Local. One speed per coordinate along grid ``axis``: the geometric mean of
    the throughputs of the ranks at that coordinate, normalised to sum 1."""
    logs = np.zeros(parts)
    counts = np.zeros(parts)
    for r, c in enumerate(coords):
        logs[c[axis]] += math.log(throughput[r])
        counts[c[axis]] += 1
    speeds = np.exp(logs / counts - (logs / counts).max())
    return speeds / speeds.sum()


def proportional_sizes(n: int, speeds: Floats, min_size: int = 1,
                       unit: int = 1) -> tuple[int, ...]:
    """Local. ``n`` rows in ``len(speeds)`` blocks, as near ``n * speed`` each as
    whole ``unit``s allow (the rows ``n % unit`` left over go to the last block),
    none under ``min_size`` rows when ``n`` has room, the largest ratio
    ``size / speed`` as small as it can be (ties: the lowest coordinate first)."""
    parts = len(speeds)
    units = n // unit
    floor = min(-(-min_size // unit), units // parts)  # min_size in units, if there is room
    w = np.asarray(speeds, dtype=float)
    got = np.maximum(floor, np.floor(units * w / w.sum())).astype(np.int64)
    while got.sum() < units:  # add where the time after adding is least
        got[int(np.argmin((got + 1) / w))] += 1
    while got.sum() > units:  # take from the slowest that can give
        ratios = np.where(got > floor, got / w, -np.inf)
        got[int(np.argmax(ratios))] -= 1
    sizes = [int(g) * unit for g in got]
    sizes[-1] += n - units * unit
    return tuple(sizes)


def balanced_plan(global_shape: Sequence[int], shard: Mapping[int, int],
                  grid_dims: Sequence[int], coords: Sequence[Sequence[int]],
                  throughput: Floats, dims: Sequence[int],
                  min_size: int = 1, unit: Mapping[int, int] | None = None
                  ) -> dict[int, tuple[int, ...]]:
    """Local. New sizes for each dim in ``dims`` (sharded dims) that equalise the
    predicted step times at ``throughput`` (one per rank, in rank order)."""
    unit = unit or {}
    plan = {}
    for d in dims:
        axis = shard[d]
        speeds = axis_speeds(throughput, coords, axis, grid_dims[axis])
        plan[d] = proportional_sizes(global_shape[d], speeds, min_size, unit.get(d, 1))
    return plan


def gain(current: Mapping[int, Sequence[int]], proposed: Mapping[int, Sequence[int]],
         shard: Mapping[int, int], coords: Sequence[Sequence[int]],
         throughput: Floats) -> float:
    """Local. The predicted fraction of the step time saved by moving from
    ``current`` to ``proposed`` sizes (0 when nothing is saved)."""
    before = predicted_time(current, shard, coords, throughput)
    after = predicted_time({**current, **proposed}, shard, coords, throughput)
    return max(0.0, 1.0 - after / before) if before > 0 else 0.0


def affine_fit(before: tuple[Floats, Floats], now: tuple[Floats, Floats],
               prior: Floats | None = None, spread: float = 0.1,
               noise: Floats | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Local. Per rank, a step's time as ``fixed + per_cell * cells`` from two
    layouts' measurements (``(cells, seconds)`` per rank, before and now): the
    line through the two points where the cells differ by more than ``spread``
    of the larger, the seconds per cell differ by more than ``noise`` (per
    rank, relative; none by default) and the line is a cost (per_cell > 0) whose
    fixed part is no less than minus half the time now (a negative one: a
    cost that grows faster than the cells, e.g. as a block outgrows a cache);
    otherwise
    the ``prior`` fixed part (an earlier fit; none by default) where it is less
    than the time now, the rest per cell. NaN seconds (not measured) give NaN."""
    x0, t0 = (np.asarray(v, dtype=float) for v in before)
    x1, t1 = (np.asarray(v, dtype=float) for v in now)
    old = np.zeros_like(x1) if prior is None else np.asarray(prior, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = (t1 - t0) / (x1 - x0)
        fixed = t1 - slope * x1
        apart = np.abs(x1 - x0) > spread * np.maximum(x0, x1)
        moved = np.abs(np.log((t1 / x1) / (t0 / x0))) > (0.0 if noise is None else noise)
        line = apart & moved & (slope > 0) & (fixed >= -t1 / 2) & np.isfinite(t0)
        old = np.where((old >= -t1 / 2) & (old < t1), old, 0.0)
        fixed = np.where(line, fixed, np.where(np.isnan(t1), np.nan, old))
        per_cell = np.where(line, slope, (t1 - fixed) / x1)
    return fixed, per_cell


def affine_times(sizes: Mapping[int, Sequence[int]], shard: Mapping[int, int],
                 coords: Sequence[Sequence[int]], rest: int, fixed: Floats,
                 per_cell: Floats) -> np.ndarray:
    """Local. Each rank's predicted step seconds, ``fixed + per_cell * cells``,
    with ``sizes`` ({dim: per-coordinate sizes}); ``rest`` cells per element of
    the sharded dims (the unsharded dims' product); a negative fixed part takes off at most half
    the part per cell (the line is fitted near the cells measured)."""
    varying = np.asarray(per_cell) * rank_cells(sizes, shard, coords, rest)
    return np.maximum(np.asarray(fixed) + varying, varying / 2)


def affine_plan(global_shape: Sequence[int], shard: Mapping[int, int],
                grid_dims: Sequence[int], coords: Sequence[Sequence[int]],
                current: Mapping[int, Sequence[int]], fixed: Floats, per_cell: Floats,
                dims: Sequence[int], min_size: int = 1,
                unit: Mapping[int, int] | None = None, rounds: int = 8
                ) -> dict[int, tuple[int, ...]]:
    """Local. New sizes for ``dims`` that equalise the predicted step times
    ``fixed + per_cell * cells``: ``balanced_plan`` at the throughputs each
    rank would have with the sizes of the round before (from ``current``), for
    ``rounds`` rounds; the proposal with the least slowest time wins (the
    earliest on a tie). With no fixed part the first round is the answer."""
    rest = math.prod(n for d, n in enumerate(global_shape) if d not in shard)
    every = {d: tuple(s) for d, s in current.items()}
    best: dict[int, tuple[int, ...]] = {}
    best_time = math.inf
    fixed = np.asarray(fixed, dtype=float)
    for _ in range(rounds if fixed.any() else 1):
        cells = np.maximum(rank_cells(every, shard, coords, rest), 1.0)
        throughput = cells / (fixed + np.asarray(per_cell) * cells)
        proposal = balanced_plan(global_shape, shard, grid_dims, coords, throughput, dims,
                                 min_size, unit)
        if every == {**every, **proposal}:  # a fixed point: later rounds repeat it
            break
        every = {**every, **proposal}
        worst = float(affine_times(every, shard, coords, rest, fixed, per_cell).max())
        if worst < best_time:
            best, best_time = proposal, worst
    return best


def damped(previous: Sequence[int], current: Sequence[int], proposed: Sequence[int],
           unit: int = 1) -> tuple[int, ...]:
    """Local. ``proposed`` sizes of one dim, or, when they undo the last move
    (from ``previous`` to ``current``: the block boundaries move back), sizes
    halfway from ``current`` to ``proposed`` (boundaries at the midpoints, in
    whole ``unit`` rows), so that a layout that alternates between two
    proposals (a cost the fit does not capture) closes in, by halves, on a
    point between them. Unchanged when halfway is a layout already held."""
    old, now, new = (np.cumsum(s)[:-1] for s in (previous, current, proposed))
    if float(np.dot(new - now, now - old)) >= 0:
        return tuple(proposed)
    mid = now + np.trunc((new - now) / (2 * unit)).astype(np.int64) * unit  # towards now
    sizes = tuple(int(v) for v in np.diff(np.concatenate([[0], mid, [sum(current)]])))
    if min(sizes) < min(min(current), min(proposed)) or sizes == tuple(current):
        return tuple(proposed)
    return sizes
