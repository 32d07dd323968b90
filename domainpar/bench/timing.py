"""Timing and memory measurement shared by the benchmarks: interleaved timing of
collective code paths, one-process steps on rank 0 beside N-rank ones, and the
live-tensor peak of a step."""
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


def idle_barrier(comm: MPI.Comm) -> None:
    """A barrier that sleeps while it waits (MPI_Barrier polls a core busily)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def time_on_rank0(comm: MPI.Comm, step: Callable[[], object]) -> dict:
    """Collective. One step of the whole problem in one process, on rank 0:
    ``{"wall": s, "cpu": s}`` on every rank.

    Fair on a machine with few cores: the other ranks wait in a barrier that
    sleeps, so rank 0 runs as a lone process would, with the other cores free.
    (An MPI_Barrier would spin one core per waiting rank: on 2 cores, load that
    the machine's other processes would then push onto rank 0's core.) Taking
    it step by step, alternating with the N-rank step, puts both under the same
    background load of a shared machine, which separate launches, minutes
    apart, would not.
    """
    sample = None
    if comm.Get_rank() == 0:
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        sample = {"wall": time.perf_counter() - t0, "cpu": time.thread_time() - c0}
    idle_barrier(comm)
    return comm.bcast(sample, root=0)


def on_rank0(comm: MPI.Comm, fn: Callable[[], object]):
    """Collective. ``fn()`` on rank 0 while the others sleep; its result everywhere."""
    result = fn() if comm.Get_rank() == 0 else None
    idle_barrier(comm)
    return comm.bcast(result, root=0)


def live_tensor_peak_kib(step: Callable[[], object]) -> float:
    """The most memory torch's allocator had live during ``step``, from the
    profiler's allocation and free records: what the activations, gradients and
    buffers need, without the allocator's and libraries' own resident pages
    (which RSS counts, and which make RSS about twice this for a UNet step)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak / 1024
