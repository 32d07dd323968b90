"""Timing and memory measurement shared by the benchmarks: interleaved timing of
collective code paths, one-process steps on rank 0 beside N-rank ones, and the
live-tensor peak of a step."""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from mpi4py import MPI

from ..comm.errors import DomainparError

_V = TypeVar("_V")


def interleaved(comm: MPI.Comm, paths: Mapping[str, Callable[[], object]], repeats: int,
                warmup: int = 2, context: Callable[[str], contextlib.AbstractContextManager]
                | None = None, progress=None) -> dict[str, list[float]]:
    """Collective. Time each path ``repeats`` times, round-robin, so that slow
    spells of a shared machine hit every path alike. One sample is the slowest
    rank's time between a barrier and the path's end. ``context(name)``, when
    given, is entered around each call of that path, outside the timed span
    (``settings.context_for``: configuration B's settings around B's paths);
    ``progress`` (a Progress) advances once per round."""
    enter = context or (lambda name: contextlib.nullcontext())
    for _ in range(warmup):
        for name, fn in paths.items():
            with enter(name):
                comm.Barrier()
                fn()
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            with enter(name):
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                took = time.perf_counter() - t0
            samples[name].append(comm.allreduce(took, op=MPI.MAX))
        if progress is not None:
            progress.update()
    return samples


def split_configurations(samples: Mapping[str, _V]) -> tuple[dict[str, _V], dict[str, _V] | None]:
    """Samples keyed ``name`` (configuration A) and ``B:name`` (B) as (A's, B's);
    B's is None when there are none."""
    a = {k: v for k, v in samples.items() if not k.startswith("B:")}
    b = {k[2:]: v for k, v in samples.items() if k.startswith("B:")}
    return a, (b or None)


def ratios(b: Mapping[str, float], a: Mapping[str, float]) -> dict[str, float]:
    """B over A for every key both have (a zero in A gives no ratio)."""
    return {k: b[k] / a[k] for k in a if k in b and a[k]}


def median(values) -> float:
    """Local. The median of ``values``."""
    return statistics.median(values)


def idle_barrier(comm: MPI.Comm) -> None:
    """A barrier that sleeps while it waits (MPI_Barrier polls a core busily)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def time_on_rank0(comm: MPI.Comm, step: Callable[[], object] | None) -> dict:
    """Collective. One step of the whole problem in one process, on rank 0:
    ``{"wall": s, "cpu": s}`` on every rank. Only rank 0 calls ``step``; the
    others may pass None. If rank 0 has no step or its step raises, every rank
    raises (``on_rank0``).

    Fair on a machine with few cores: the other ranks wait in a barrier that
    sleeps, so rank 0 runs as a lone process would, with the other cores free.
    (An MPI_Barrier would spin one core per waiting rank: on 2 cores, load that
    the machine's other processes would then push onto rank 0's core.) Taking
    it step by step, alternating with the N-rank step, puts both under the same
    background load of a shared machine, which separate launches, minutes
    apart, would not.
    """
    def timed() -> dict:
        if step is None:
            raise TypeError("time_on_rank0: rank 0 was given no step (None)")
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        return {"wall": time.perf_counter() - t0, "cpu": time.thread_time() - c0}
    return on_rank0(comm, timed)


def on_rank0(comm: MPI.Comm, fn: Callable[[], object]):
    """Collective. ``fn()`` on rank 0 while the others sleep; its result everywhere.
    If ``fn`` raises, every rank raises the same DomainparError naming it (chained
    from the original on rank 0) instead of leaving the others waiting."""
    result, failure = None, None
    if comm.Get_rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 (raised again below, on every rank)
            failure = exc
    idle_barrier(comm)
    result, why = comm.bcast((result, None if failure is None else
                              f"{type(failure).__name__}: {failure}"), root=0)
    if why is not None:
        raise DomainparError(f"rank 0 failed: {why}") from failure
    return result


def live_tensor_peak_kib(step: Callable[[], object]) -> float:
    """The most memory torch's allocator had live during ``step``, in KiB: what
    the activations, gradients and buffers need, without the allocator's and
    libraries' own resident pages (which RSS counts, and which make RSS about
    twice this for a UNet step)."""
    return profiled_peak_bytes(step) / 1024


def profiled_peak_bytes(work: Callable[[], object]) -> int:
    """The highest running sum of torch's CPU allocations and frees during
    ``work``, from the profiler's raw allocator records. (Summing each op's net
    memory instead, as the profiler's op events give it, misses what an op
    allocates and frees inside itself: a conv's scratch buffers, which are
    a third of a UNet step's peak and more of an inference pass's.)"""
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():  # kineto prints a line at start and at stop
        prof.start()
    try:
        work()
    finally:
        with quiet_stderr():
            prof.stop()
    # The raw records, not prof.events(): those take seconds to build for a step.
    # (Private profiler fields, set once it ran; torch 2.13 types them as optional
    # and its memory events without nbytes.)
    records = sorted((e.start_ns(), e.nbytes())  # type: ignore[union-attr]
                     for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
                     if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def quiet_stderr():
    """Point file descriptor 2 at /dev/null (C++ libraries write there directly)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
