"""Time spent blocked in domainpar's communication, per process.

Every call of comm/ that can wait for another rank (halo fill and accumulate,
the collectives, the waits of nonblocking work, ``agree``) is wrapped in
``blocking``: it adds its wall time to a running total that ``blocked_seconds``
reads, and its CPU time (``process_time``) to a second total. A step's time
minus the total's growth over the step is the time this rank computed
(``domainpar.balance`` fits throughputs from it): wall time by default, CPU
time where other load on a shared machine would blur the wall clock. A call
made inside another wrapped call is counted once, by the outer one. The cost
is two reads of each clock per call.

``observing`` is the public hook for benchmarks that need more than the total:
it runs each outermost call inside a context manager of theirs, named after the
call (``HaloExchange.fill``), to time it or label it for a profiler (the
calls that start nonblocking work, ``starting``, too, their time not counted
as blocked), and
with ``arguments=True`` given the call's arguments too (the layout it was
given: ``domainpar model`` counts the bytes of every exchange from them). This
module is the one place that hooks into communication calls; benchmarks never
patch comm/ methods.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

_local = threading.local()
_lock = threading.Lock()
_total: list[float] = [0.0, 0, 0.0]  # wall seconds, calls, CPU seconds
# Each observer with whether it takes the call's arguments as well as its name.
_observers: list[tuple[Callable[..., ContextManager[object]], bool]] = []


def blocked_seconds(cpu: bool = False) -> float:
    """Local. Seconds this process has spent inside domainpar's communication
    calls so far (all threads; a nested call counted once): wall time, or with
    ``cpu`` the process's CPU time (``time.process_time``) in them."""
    return _total[2] if cpu else _total[0]


def now(cpu: bool = False) -> float:
    """Local. The clock ``blocked_seconds`` counts in: ``perf_counter`` or
    ``process_time``."""
    return time.process_time() if cpu else time.perf_counter()


def blocking_calls() -> int:
    """Local. How many outermost communication calls have been timed so far."""
    return int(_total[1])


@contextlib.contextmanager
def observing(observer: Callable[..., ContextManager[object]],
              arguments: bool = False) -> Iterator[None]:
    """Local. Inside this block, every outermost communication call on this
    process runs inside ``observer(name)``, a context manager made per call,
    ``name`` the call's qualified name (``HaloExchange.fill``,
    ``HaloExchange.accumulate``, ``allreduce`` ...); with ``arguments``, inside
    ``observer(name, args, kwargs)``, the call's own arguments (``self`` first
    for a method). Observers nest; outside any block a call pays one test of an
    empty list."""
    entry = (observer, arguments)
    _observers.append(entry)
    try:
        yield
    finally:
        _observers.remove(entry)


def _observed(name: str, args: tuple[object, ...],
              kwargs: dict[str, object]) -> ContextManager[object]:
    if not _observers:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for observer, arguments in list(_observers):
        stack.enter_context(observer(name, args, kwargs) if arguments else observer(name))
    return stack


def blocking(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Local. Decorator: count ``fn``'s wall and CPU time into ``blocked_seconds``
    (and run it inside the ``observing`` observers)."""
    return _wrapped(fn, counted=True)


def starting(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Local. Decorator for a call that starts nonblocking communication (its
    wait is ``blocking``): run inside the ``observing`` observers like a
    blocking call, its time not counted as blocked."""
    return _wrapped(fn, counted=False)


def _wrapped(fn: Callable[_P, _R], counted: bool) -> Callable[_P, _R]:
    name = fn.__qualname__

    @functools.wraps(fn)
    def timed(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        depth = getattr(_local, "depth", 0)
        if depth:
            return fn(*args, **kwargs)
        _local.depth = 1
        start, start_cpu = time.perf_counter(), time.process_time()
        try:
            with _observed(name, args, kwargs):
                return fn(*args, **kwargs)
        finally:
            took, took_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            _local.depth = 0
            if counted:
                with _lock:
                    _total[0] += took
                    _total[1] += 1
                    _total[2] += took_cpu
    return timed
