"""The demo's dataset: Gray-Scott trajectories solved domain-parallel, written
to HDF5 by every rank in parallel.

A trajectory starts from random blobs (its own seed), runs ``warmup`` solver
steps, then records ``pairs + 1`` states ``every`` steps apart; sample ``i``
is the pair (state i, state i + 1): input and target of a surrogate that
jumps ``every`` solver steps at once. The last trajectory is held out: its
pairs go to ``test/``, the others' to ``train/``. Datasets are
``(N, 2, D, H, W)`` float32, channels (u, v); each rank holds and writes only
its block of every sample.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import domainpar as dp

from ..progress import Progress
from .grayscott import Params, Solver, box_decomposition, initial_blobs

SHARD = {2: 0, 3: 1, 4: 2}  # (N, C, D, H, W): the solver grid's axes cut D, H, W
NAMES = ("train/inputs", "train/targets", "test/inputs", "test/targets")


@dataclass(frozen=True)
class Spec:
    """What to solve: box side, trajectories (the last one held out), pairs per
    trajectory, solver steps between input and target, steps before the first
    input, and the seed of the first trajectory's blobs (trajectory t: seed + t)."""
    side: int = 32
    trajectories: int = 8
    pairs: int = 12
    every: int = 100
    warmup: int = 200
    seed: int = 0

    @property
    def solver_steps(self) -> int:
        """Local. Solver steps of all trajectories: warm-up plus the steps between pairs."""
        return self.trajectories * (self.warmup + self.pairs * self.every)


def solve(spec: Spec, params: Params = Params(), comm=None):
    """Collective. Every trajectory of ``spec`` on all ranks of ``comm`` (a 3-D
    periodic process grid cuts the box). Returns ``(solver, states)``: states
    is this rank's ``(trajectories, pairs + 1, 2, d, h, w)`` float32 block."""
    dec = box_decomposition(spec.side, comm)
    solver = Solver(dec, params)
    states = np.empty((spec.trajectories, spec.pairs + 1, *dec.local_shape()), np.float32)
    bar = Progress(spec.solver_steps, "solve", comm=dec.grid.comm)
    for t in range(spec.trajectories):
        solver.set_state(initial_blobs(dec, spec.seed + t))
        solver.run(spec.warmup)
        bar.update(spec.warmup)
        states[t, 0] = solver.state()
        for p in range(spec.pairs):
            solver.run(spec.every)
            states[t, p + 1] = solver.state()
            bar.update(spec.every, trajectory=f"{t + 1}/{spec.trajectories}")
    bar.close()
    return solver, states


def write(path, states: np.ndarray, solver: Solver, spec: Spec, params: Params) -> dict:
    """Collective. The pairs of ``states`` (from ``solve``) into ``path``: the
    datasets ``NAMES``, each rank writing its block (``dp.io.write``). Returns
    per split the number of samples and the persistence baseline: the mean
    squared change from input to target, the MSE of predicting no change."""
    grid = solver.dec.grid
    comm = grid.comm
    attrs = {**{f"gray_scott_{k}": v for k, v in params.as_dict().items()},
             "solver_steps_between_input_and_target": spec.every}
    info = {}
    for split, block in (("train", states[:-1]), ("test", states[-1:])):
        # (T, P+1, ...) -> inputs (T*P, ...) = states 0..P-1, targets = states 1..P
        inputs = block[:, :-1].reshape(-1, *block.shape[2:])
        targets = block[:, 1:].reshape(-1, *block.shape[2:])
        for name, array in (("inputs", inputs), ("targets", targets)):
            x = dp.DomainTensor.from_local(torch.from_numpy(np.ascontiguousarray(array)),
                                           grid, SHARD)
            dp.io.write(path, f"{split}/{name}", x, overwrite=True, attrs=attrs)
        change = np.square(targets.astype(np.float64) - inputs).sum()
        cells = len(inputs) * 2 * spec.side ** 3
        info[split] = {"samples": len(inputs),
                       "persistence_mse": comm.allreduce(float(change)) / cells}
    return info
