"""Gray-Scott reaction-diffusion in a periodic 3-D box, domain-parallel.

    du/dt = Du lap(u) - u v^2 + F (1 - u)
    dv/dt = Dv lap(v) + u v^2 - (F + k) v

on a grid of unit spacing: explicit Euler in time, the 7-point Laplacian in
space. Each rank owns one block of the ``(2, D, H, W)`` state (u and v) and
keeps it padded by one ghost cell per side of every spatial dim; before every
step ``HaloExchange.fill`` copies the neighbours' faces into the ghosts and
wraps them around the box. numpy only (no torch): this is the simulation that
makes the demo's data, not a model.

A step does the same arithmetic in the same order on every cell whatever the
decomposition, so any number of ranks gives the bits one process gets.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..comm.decomposition import Decomposition
from ..comm.errors import LayoutError
from ..comm.grid import ProcessGrid
from ..comm.halo import HaloExchange

SPATIAL = (1, 2, 3)  # the state's spatial dims; dim 0 holds (u, v)


@dataclass(frozen=True)
class Params:
    """Diffusion rates, feed, kill and time step. Explicit Euler on the 7-point
    Laplacian is stable for dt * max(Du, Dv) < 1/6; Du = 0.1 keeps the grid-scale
    mode well damped (factor 1 - 12 Du dt = -0.2 per step) instead of ringing as
    a checkerboard near the limit. F and k give spots and worms that grow from
    the initial blobs and fill the box in about 1500 steps."""
    du: float = 0.1
    dv: float = 0.05
    feed: float = 0.035
    kill: float = 0.065
    dt: float = 1.0

    def as_dict(self) -> dict:
        """Local. The parameters as a plain dict (for JSON)."""
        return asdict(self)


def box_decomposition(side: int | tuple[int, int, int], comm=None) -> Decomposition:
    """Collective. The state ``(2, D, H, W)`` of a periodic box cut over a 3-D
    periodic process grid of all ranks of ``comm`` (MPI picks the grid dims)."""
    shape = (side,) * 3 if isinstance(side, int) else tuple(side)
    grid = ProcessGrid(dims=(0, 0, 0), periodic=True, comm=comm)
    return Decomposition((2, *shape), grid, shard={1: 0, 2: 1, 3: 2})


def initial_blobs(dec: Decomposition, seed: int) -> np.ndarray:
    """Local. This rank's block of an initial state: u = 1, v = 0 everywhere but
    in 3 to 6 balls of random centre and radius (4% to 12% of the box side,
    measured across the periodic boundary), where u = 0.5 and v = 0.25. Drawn
    from ``seed`` alone, so every rank agrees on the balls and evaluates them on
    its own block only."""
    rng = np.random.default_rng(seed)
    shape = np.array(dec.global_shape[1:])
    block = np.empty(dec.local_shape(), dtype=np.float64)
    block[0], block[1] = 1.0, 0.0
    coords = np.meshgrid(*(np.arange(o, o + n) for o, n in
                           zip(dec.offsets()[1:], dec.local_shape()[1:])), indexing="ij")
    for _ in range(rng.integers(3, 7)):
        centre = rng.uniform(0, shape)
        radius = rng.uniform(0.04, 0.12) * shape.min()
        d2 = 0.0
        for c, x, n in zip(centre, coords, shape):
            d = np.abs(x - c)
            d2 = d2 + np.minimum(d, n - d) ** 2
        inside = d2 < radius ** 2
        block[0][inside], block[1][inside] = 0.5, 0.25
    return block


class Solver:
    """Collective (construction builds the halo exchange). Gray-Scott on this
    rank's block of ``dec``, a decomposition of ``(2, D, H, W)`` whose three
    spatial dims are all sharded on periodic grid axes (``box_decomposition``;
    an axis may have one rank, which then wraps onto itself)."""

    def __init__(self, dec: Decomposition, params: Params = Params()):
        problem = None
        if dec.ndim != 4 or dec.global_shape[0] != 2 or 0 in dec.shard:
            problem = (f"the state must be (2, D, H, W) with dim 0 not sharded; got shape "
                       f"{dec.global_shape}, shard {dec.shard}")
        elif any(a is None or not dec.grid.periodic[a]
                 for a in (dec.axis_of(d) for d in SPATIAL)):
            problem = (f"dims 1, 2, 3 must each be sharded on a periodic grid axis (the box "
                       f"wraps by halo exchange); got shard {dec.shard}, periodic "
                       f"{dec.grid.periodic}")
        elif min(min(dec.block_sizes(d)) for d in SPATIAL) < 1:
            problem = f"every rank needs at least one cell per dim; blocks {dec.local_shape()}"
        if problem:
            raise LayoutError(f"Gray-Scott solver: {problem}")
        self.dec, self.params = dec, params
        self.halo = HaloExchange(dec, width={d: 1 for d in SPATIAL})
        self.padded = np.zeros(self.halo.padded_shape, dtype=np.float64)
        self.owned = self.halo.owned
        self.steps = 0

    def set_state(self, block: np.ndarray) -> None:
        """Local. Start from ``block``, this rank's ``(2, d, h, w)`` cells."""
        self.padded[self.owned] = block

    def state(self) -> np.ndarray:
        """Local. A copy of this rank's cells, ``(2, d, h, w)``."""
        return self.padded[self.owned].copy()

    def run(self, steps: int) -> None:
        """Neighbour-wise collective. ``steps`` explicit Euler steps."""
        # The check in fill agrees on shapes across ranks; this array was built
        # from the exchange's own layout, so once per run is enough.
        for i in range(steps):
            self.halo.fill(self.padded, check=i == 0)
            self._step()
        self.steps += steps

    def _step(self) -> None:
        p, par = self.padded, self.params
        c = p[self.owned]
        lap = laplacian(p)
        u, v = c[0], c[1]
        uvv = u * v * v
        du = par.dt * (par.du * lap[0] - uvv + par.feed * (1.0 - u))
        dv = par.dt * (par.dv * lap[1] + uvv - (par.feed + par.kill) * v)
        u += du  # c is a view: this updates the owned cells in place
        v += dv


def laplacian(p: np.ndarray) -> np.ndarray:
    """Local. The 7-point Laplacian of the cells of ``p`` inside its one-cell
    border along the last three dims (dim 0 is a batch of fields). Terms in a
    fixed order (-z, +z, -y, +y, -x, +x, centre), which a reference on the whole
    box must keep to agree to the bit."""
    inner = slice(1, -1)
    c = p[:, inner, inner, inner]
    return (p[:, :-2, inner, inner] + p[:, 2:, inner, inner]
            + p[:, inner, :-2, inner] + p[:, inner, 2:, inner]
            + p[:, inner, inner, :-2] + p[:, inner, inner, 2:] - 6.0 * c)
