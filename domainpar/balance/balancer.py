"""Balancer: measured per-rank compute -> new block sizes along the sharded dims.

Each ``step()`` ends a measured span: this rank's compute time is the span's
wall time less the time it spent blocked in domainpar's communication
(``comm.clock``), its throughput the cells of its block over that time. One
allreduce gives every rank every rank's measurement; each rank then smooths
them the same way (an exponential moving average of the seconds per cell) and
computes the same new sizes from the same numbers, so they agree without a
decision message (the new Decomposition's construction checks it). After a
move, each rank's step is fitted as a fixed part plus a part per cell through
its two layouts' times (``sizes.affine_fit``), and the next sizes equalise
those predicted times. The layout
moves only when the predicted step time drops by more than ``threshold`` and
by more than the measurements' own noise allows (``margin``: hysteresis, so
noisy measurements do not make it oscillate). The data follow
with ``layout(x)`` (a repartition); the model's parameters are replicated and
are not touched.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np

from ..comm import clock as comm_clock
from ..comm import collectives
from ..comm.decomposition import Decomposition
from ..comm.errors import LayoutError, agree
from ..tensor import DomainTensor
from . import sizes as plan

_WINDOW = 8  # raw measurements per rank kept for the noise margin
_SETTLED = 4  # measurements on a layout before its own spread alone sets the noise
_HISTORY = 1000  # decisions kept in Balancer.history (a long run does not grow it)


class Balancer:
    """Collective (a consistency check). Dynamic load balancing of the blocks of
    ``decomposition`` (the data's reference layout) along its sharded dims, or
    along ``dims`` only.

    Call ``step()`` on every rank once per training step (after the optimizer
    step, say), and pass each step's data through ``layout(x)`` before the
    model.

    Parameters
    ----------
    decomposition : Decomposition
        The data's reference layout.
    dims : sequence of int, optional
        The sharded dims to balance; all of them by default.
    threshold : float, default 0.05
        The least predicted saving of step time that moves the layout (5%);
        more when the measurements are noisier (``margin()``).
    smoothing : float, default 0.5
        The weight of a new measurement in the moving average (1: only the
        newest counts).
    every : int, default 1
        Consider moving every this many steps.
    warmup : int, default 1
        Steps not measured at the start and after each move (first-call
        costs: kernel selection, halo plans).
    min_size : int, default 1
        Fewest rows a block keeps, so every rank goes on measuring.
    unit : mapping, optional
        ``{dim: k}``: blocks in whole ``k`` rows (``Decomposition``'s align).
    clock : {"wall", "cpu"}, default "wall"
        What a rank's compute is measured in: wall time (a rank that shares
        its core runs slower and gets less) or the process's CPU time (the
        per-cell cost alone: steady where other load blurs the wall clock,
        blind to a rank's share of its core).
    noise_margin : float, default 3
        Also require a saving of this many standard deviations of the
        noisiest rank's smoothed measurement (from its last 8 measurements;
        ``margin()``); 0 leaves ``threshold`` alone.
    """

    def __init__(self, decomposition: Decomposition, *, dims: Sequence[int] | None = None,
                 threshold: float = 0.05, smoothing: float = 0.5, every: int = 1,
                 warmup: int = 1, min_size: int = 1, unit: Mapping[int, int] | None = None,
                 clock: str = "wall", noise_margin: float = 3.0):
        dec = decomposition
        self.grid, self._comm = dec.grid, dec.grid.comm
        problem = _check_options(dec, dims, threshold, smoothing, every, warmup, min_size, unit,
                                 clock) or _check_margin(noise_margin)
        agree(self._comm, problem, what="Balancer options",
              described=(dims, threshold, smoothing, every, warmup, min_size, unit, clock,
                        noise_margin))
        self.noise_margin = float(noise_margin)
        self._cpu = clock == "cpu"
        self.dims = tuple(sorted(d % len(dec.global_shape) for d in dims)) if dims is not None \
            else tuple(dec.shard)
        self.threshold, self.smoothing, self.every = float(threshold), float(smoothing), every
        self.warmup, self.min_size, self.unit = warmup, min_size, dict(unit or {})
        self.decomposition = dec
        self._coords = [self.grid.coords_of(r) for r in range(self._comm.Get_size())]
        self._cost = np.full(self._comm.Get_size(), np.nan)  # smoothed seconds per cell
        self._recent = np.full((self._comm.Get_size(), _WINDOW), np.nan)  # raw, for the noise
        self._samples = np.zeros(self._comm.Get_size(), dtype=np.int64)
        nan = np.full(self._comm.Get_size(), np.nan)
        self._before = (nan, nan, nan)  # (cells, seconds, noise) per rank, the layout left
        self._fixed = np.zeros(self._comm.Get_size())  # fitted fixed seconds per step
        self._per_cell = nan  # fitted seconds per cell (NaN: 1 / throughput)
        self._left: dict[int, tuple[int, ...]] = {}  # the sizes before the last move
        self._steps, self._skip = 0, warmup
        self.history: deque[dict] = deque(maxlen=_HISTORY)  # the last decisions
        self.start()

    # -- the data's layout ---------------------------------------------------------------
    @property
    def sizes(self) -> dict[int, tuple[int, ...]]:
        """Local. The current block sizes of the balanced dims."""
        return {d: self.decomposition.block_sizes(d) for d in self.dims}

    def decomposition_for(self, global_shape: Sequence[int],
                          shard: Mapping[int, int] | None = None) -> Decomposition:
        """Collective (a consistency check). The current layout for another
        tensor of the data stream (a target with other channels).

        Parameters
        ----------
        global_shape : sequence of int
            The tensor's shape; its balanced dims must have the reference's
            lengths.
        shard : mapping, optional
            Its shard map (default: the reference's), with the reference's grid
            axes on the balanced dims.

        Returns
        -------
        Decomposition
            ``shard`` with the current sizes along the balanced dims.
        """
        shard = dict(self.decomposition.shard if shard is None else shard)
        shard = {d % len(global_shape): a for d, a in shard.items()}
        return Decomposition(global_shape, self.grid, shard, self._sizes_for(global_shape, shard))

    def layout(self, x: DomainTensor) -> DomainTensor:
        """Collective when it moves data. ``x`` laid out with the current sizes
        along the balanced dims; its other sharded dims keep their sizes.

        Parameters
        ----------
        x : DomainTensor
            A tensor of the data stream, on the balancer's grid.

        Returns
        -------
        DomainTensor
            ``x`` itself when it is laid out so already; otherwise its
            redistribution (an alltoallv, differentiable).
        """
        if not isinstance(x, DomainTensor):
            raise LayoutError(f"Balancer.layout takes a DomainTensor, got {type(x).__name__}")
        dec = x.decomposition
        if dec.grid is not self.grid and dec.grid.comm != self._comm:
            raise LayoutError("Balancer.layout: the tensor lives on another grid")
        wanted = self._sizes_for(dec.global_shape, dec.shard)
        if all(dec.block_sizes(d) == s for d, s in wanted.items()):
            return x
        return x.redistribute(dec.shard, {**{d: dec.block_sizes(d) for d in dec.shard},
                                          **wanted})

    def adopt(self, decomposition: Decomposition) -> None:
        """Local. Take ``decomposition`` (the reference's global shape and shard
        map) as the current layout: the data were laid out by another
        partitioner, e.g. ``dp.points.partition(coords, capacity=balancer.shares())``
        after ``step()`` returned True. Measurements go on from it."""
        ref = self.decomposition
        if tuple(decomposition.global_shape) != tuple(ref.global_shape) or \
                decomposition.shard != ref.shard or decomposition.grid.comm != self._comm:
            raise LayoutError(f"Balancer.adopt: {decomposition!r} is not a layout of the "
                              f"balanced shape {ref.global_shape} with shard {ref.shard}")
        self.decomposition = decomposition

    def _sizes_for(self, global_shape, shard) -> dict[int, tuple[int, ...]]:
        """Local. The current sizes of the balanced dims that ``shard`` cuts, after
        checking that they match the reference layout (metadata alike on every
        rank: a mismatch raises on every rank)."""
        ref = self.decomposition
        out = {}
        for d, s in self.sizes.items():
            if d not in shard:
                continue
            if shard[d] != ref.shard[d] or global_shape[d] != ref.global_shape[d]:
                raise LayoutError(
                    f"Balancer: dim {d} of shape {tuple(global_shape)} on grid axis "
                    f"{shard[d]} does not match the balanced layout's dim {d} (length "
                    f"{ref.global_shape[d]}, grid axis {ref.shard[d]})")
            out[d] = s
        return out

    # -- measuring and deciding ------------------------------------------------------------
    def start(self) -> None:
        """Local. Begin a measured span now (``step()`` begins the next one itself)."""
        self._t0, self._b0 = comm_clock.now(self._cpu), comm_clock.blocked_seconds(self._cpu)

    def step(self, compute_seconds: float | None = None) -> bool:
        """Collective (one allreduce over the grid, and a layout check when it
        moves). End the span begun by the last ``step()``: measure every rank,
        agree, and choose new sizes when the predicted saving exceeds
        ``margin()``.

        Parameters
        ----------
        compute_seconds : float, optional
            This rank's compute time in the span, in place of the measured one
            (a user's own timer; tests inject figures).

        Returns
        -------
        bool
            True when the layout moved: pass the next data through ``layout``.
        """
        span = comm_clock.now(self._cpu) - self._t0
        seconds = span - (comm_clock.blocked_seconds(self._cpu) - self._b0) \
            if compute_seconds is None else compute_seconds
        costs = self._gather(seconds, math.prod(self.decomposition.local_shape()))
        self._steps += 1
        moved = False
        if self._skip:
            self._skip -= 1
        else:
            self._smooth(costs)
            if self._steps % self.every == 0:
                moved = self._consider()
        self.start()
        return moved

    def _gather(self, seconds, cells: int) -> np.ndarray:
        """Collective. Every rank's seconds per cell (NaN: no measurement, a rank
        with no cells or no compute time); a bad figure raises on every rank."""
        size, rank = self._comm.Get_size(), self._comm.Get_rank()
        v = np.zeros(3 * size)
        try:
            seconds = float(seconds)
            bad = not math.isfinite(seconds) or seconds < 0
        except (TypeError, ValueError):
            seconds, bad = 0.0, True
        if bad:
            v[2 * size + rank] = 1
        elif cells > 0 and seconds > 0:
            v[rank], v[size + rank] = seconds / cells, 1
        collectives.allreduce(v, self._comm, check=False)
        wrong = [r for r in range(size) if v[2 * size + r]]
        if wrong:
            raise LayoutError(f"Balancer.step: compute_seconds must be a finite number >= 0 "
                              f"(not on rank(s) {wrong})")
        return np.where(v[size:2 * size] > 0, v[:size], np.nan)

    def _smooth(self, costs: np.ndarray) -> None:
        """Local. The moving average of the seconds per cell, rank by rank, and
        the last ``_WINDOW`` raw measurements (for ``margin``); the first
        measurement on a new layout replaces the old layout's average."""
        fresh = ~np.isnan(costs)
        old = np.where(self._samples > 0, self._cost, np.nan)
        mixed = np.where(np.isnan(old), costs, (1 - self.smoothing) * old + self.smoothing * costs)
        self._cost = np.where(fresh, mixed, self._cost)
        for r in np.flatnonzero(fresh):
            self._recent[r, self._samples[r] % _WINDOW] = costs[r]
        self._samples += fresh

    def margin(self) -> float:
        """Local (alike on every rank). The least predicted saving that moves the
        layout: ``threshold``, or ``noise_margin`` standard deviations of the
        smoothed estimate of the noisiest rank when that is more (from the relative
        spread of its last measurements), so that a crowded machine's jitter
        does not move blocks about."""
        noise = self._noise()
        if np.isnan(noise).all():
            return self.threshold
        return max(self.threshold, self.noise_margin * float(np.nanmax(noise)))

    def _noise(self) -> np.ndarray:
        """Local. Per rank, the relative standard deviation of its smoothed
        estimate on this layout (from the spread of its last measurements; NaN
        with fewer than two). While a rank has fewer than ``_SETTLED``
        measurements on this layout, no less than on the layout before (the
        machine's jitter does not change with the blocks; two or three samples
        can show little of it by chance)."""
        out = np.full(len(self._recent), np.nan)
        for r, row in enumerate(self._recent):
            v = row[~np.isnan(row)]
            if len(v) > 1:
                out[r] = np.std(v, ddof=1) / np.mean(v)
        out *= np.sqrt(self.smoothing / (2 - self.smoothing))
        young = (self._samples < _SETTLED) & ~np.isnan(self._before[2])
        return np.where(young, np.fmax(out, self._before[2]), out)

    def _consider(self) -> bool:
        """Collective when it moves (the new Decomposition's agreement check).
        Move to the proposed sizes when they save more than ``margin()``; not
        before every measured rank has two measurements on this layout."""
        throughput = self.throughput_estimate()
        seen = self._samples[self._samples > 0]
        if throughput is None or seen.size == 0 or seen.min() < 2:  # no spread from one
            return False
        ref = self.decomposition
        current = {d: ref.block_sizes(d) for d in ref.shard}
        cells = self._cells(current)
        noise = np.nan_to_num(np.hypot(self._before[2], self._noise()), nan=np.inf)
        fixed, per_cell = plan.affine_fit(self._before[:2], (cells, cells / throughput),
                                          self._fixed, noise=self.noise_margin * noise)
        self._fixed, self._per_cell = np.nan_to_num(fixed), per_cell
        per_cell = self._fit()[1]
        rest = math.prod(n for d, n in enumerate(ref.global_shape) if d not in ref.shard)
        proposal = plan.affine_plan(ref.global_shape, ref.shard, self.grid.dims, self._coords,
                                    current, self._fixed, per_cell, self.dims, self.min_size,
                                    self.unit)
        proposal = {d: plan.damped(self._left.get(d, current[d]), current[d], s,
                                   self.unit.get(d, 1)) for d, s in proposal.items()}
        before, after = (float(plan.affine_times(s, ref.shard, self._coords, rest,
                                                 self._fixed, per_cell).max())
                         for s in (current, {**current, **proposal}))
        saving = max(0.0, 1.0 - after / before) if before > 0 else 0.0
        needed = self.margin()
        moved = bool(saving > needed) and any(proposal[d] != current[d] for d in proposal)
        self.history.append({"step": self._steps, "throughput": throughput.tolist(),
                             "fixed_s": self._fixed.tolist(),
                             "sizes": {d: list(s) for d, s in current.items()},
                             "proposed": {d: list(s) for d, s in proposal.items()},
                             "predicted_saving": saving, "needed": needed, "moved": moved})
        if moved:
            self.decomposition = Decomposition(ref.global_shape, self.grid, ref.shard,
                                               {**current, **proposal})
            self._left = current
            self._moved(cells, cells / throughput)
        return moved

    def _cells(self, sizes: Mapping[int, Sequence[int]]) -> np.ndarray:
        """Local. Each rank's cells with ``sizes`` of the sharded dims."""
        ref = self.decomposition
        rest = math.prod(n for d, n in enumerate(ref.global_shape) if d not in ref.shard)
        return plan.affine_times(sizes, ref.shard, self._coords, rest,
                                 np.zeros(len(self._coords)), np.ones(len(self._coords)))

    def _moved(self, cells: np.ndarray, seconds: np.ndarray) -> None:
        """Local. After a move: keep the layout left (``cells``, ``seconds`` per
        rank) for the fit of each rank's fixed cost; measure afresh (warm-up, a
        new noise window: times on another layout are not noise)."""
        self._before = (cells, seconds, self._noise())
        self._recent[:] = np.nan
        self._samples[:] = 0
        self._skip = self.warmup

    # -- what it knows ---------------------------------------------------------------------
    def throughput_estimate(self) -> np.ndarray | None:
        """Local (alike on every rank). The smoothed throughput per rank, cells
        per second; a rank never measured gets the mean seconds per cell of the
        others; None before any rank has been measured."""
        if np.isnan(self._cost).all():
            return None
        missing = np.isnan(self._cost)
        cost = np.where(missing, np.mean(self._cost[~missing]), self._cost) if missing.any() \
            else self._cost
        return 1.0 / cost

    def predicted_step(self, sizes: Mapping[int, Sequence[int]] | None = None) -> float | None:
        """Local. The slowest rank's predicted compute seconds with ``sizes``
        (default: the current ones) at the fitted costs (``fixed_seconds`` plus
        the estimated seconds per cell)."""
        if self.throughput_estimate() is None:
            return None
        ref = self.decomposition
        every = {**{d: ref.block_sizes(d) for d in ref.shard}, **(sizes or {})}
        rest = math.prod(n for d, n in enumerate(ref.global_shape) if d not in ref.shard)
        return float(plan.affine_times(every, ref.shard, self._coords, rest,
                                       *self._fit()).max())

    def ideal_step(self) -> float | None:
        """Local. Total work over total throughput: the step time of a perfect
        balance, in seconds (replicated axes count each copy of the data once
        per rank holding it)."""
        throughput = self.throughput_estimate()
        if throughput is None:
            return None
        cells = math.prod(self.decomposition.global_shape)
        copies = math.prod(self.grid.dims[a] for a in self.decomposition.replicated_axes)
        return cells * copies / float(throughput.sum())

    def shares(self) -> np.ndarray | None:
        """Local. Each rank's share of the work (sums to 1): the per-rank
        capacities of a partition that is not a block layout (points). After a
        move, the fractions of the cells in the layout just chosen (fixed costs
        and damping included); before any, each rank's fraction of the total
        throughput."""
        throughput = self.throughput_estimate()
        if throughput is None:
            return None
        if not self._left:
            return throughput / throughput.sum()
        cells = self._cells({d: self.decomposition.block_sizes(d)
                             for d in self.decomposition.shard})
        return cells / cells.sum()

    def _fit(self) -> tuple[np.ndarray, np.ndarray]:
        """Local. Each rank's (fixed seconds, seconds per cell); per cell from the
        throughput where the fit has none. Call only when there is a throughput."""
        throughput = self.throughput_estimate()
        assert throughput is not None
        return self._fixed, np.where(np.isnan(self._per_cell), 1 / throughput, self._per_cell)

    def fixed_seconds(self) -> np.ndarray:
        """Local (alike on every rank). Each rank's fitted step time that does not
        grow with its block (seconds; zeros until two layouts were measured)."""
        return self._fixed.copy()


def _check_margin(noise_margin) -> str | None:
    """Local. What is wrong with ``noise_margin``, or None."""
    if isinstance(noise_margin, bool) or not isinstance(noise_margin, (int, float)) \
            or not noise_margin >= 0:
        return f"Balancer: noise_margin must be a number >= 0, got {noise_margin!r}"
    return None


def _check_options(dec, dims, threshold, smoothing, every, warmup, min_size, unit,
                   clock) -> str | None:
    """Local. What is wrong with the Balancer's arguments, or None."""
    if not isinstance(dec, Decomposition):
        return f"Balancer takes a Decomposition, got {type(dec).__name__}"
    multi = getattr(dec, "_multi", ())
    if multi:
        return f"Balancer: dim {multi[0]} is cut over several grid axes; not balanced"
    if clock not in ("wall", "cpu"):
        return f"Balancer: clock must be 'wall' or 'cpu', got {clock!r}"
    ndim = len(dec.global_shape)
    for d in (dims if dims is not None else ()):
        if not isinstance(d, int) or not -ndim <= d < ndim or d % ndim not in dec.shard:
            return f"Balancer: dims {list(dims)} must name sharded dims of {dec.shard}"
    if not (isinstance(threshold, (int, float)) and 0 <= threshold < 1):
        return f"Balancer: threshold must be in [0, 1), got {threshold!r}"
    if not (isinstance(smoothing, (int, float)) and 0 < smoothing <= 1):
        return f"Balancer: smoothing must be in (0, 1], got {smoothing!r}"
    for name, value, least in (("every", every, 1), ("warmup", warmup, 0),
                               ("min_size", min_size, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            return f"Balancer: {name} must be an integer >= {least}, got {value!r}"
    for d, k in (unit or {}).items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or d not in dec.shard:
            return f"Balancer: unit {unit} must map sharded dims to positive integers"
    return None
