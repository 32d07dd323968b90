"""Interleaved timing of collective code paths across ranks."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping

from mpi4py import MPI


def interleaved(comm: MPI.Comm, paths: Mapping[str, Callable[[], object]], repeats: int,
                warmup: int = 2) -> dict[str, list[float]]:
    """Collective. Time each path ``repeats`` times, round-robin, so that slow
    spells of a shared machine hit every path alike. One sample is the slowest
    rank's time between a barrier and the path's end."""
    for _ in range(warmup):
        for fn in paths.values():
            comm.Barrier()
            fn()
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            samples[name].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return samples


def median(values) -> float:
    return statistics.median(values)
