"""Time spent blocked in domainpar's communication, per process.

Every call of comm/ that can wait for another rank (halo fill and accumulate,
the collectives, the waits of nonblocking work, ``agree``) is wrapped in
``blocking``: it adds its wall time to a running total that ``blocked_seconds``
reads. A step's wall time minus the total's growth over the step is the time
this rank computed (``domainpar.balance`` fits throughputs from it). A call
made inside another wrapped call is counted once, by the outer one. The cost
is two ``perf_counter`` reads per call.
"""
from __future__ import annotations

import functools
import threading
import time

_local = threading.local()
_lock = threading.Lock()
_total = [0.0, 0]  # seconds, calls


def blocked_seconds() -> float:
    """Local. Seconds this process has spent inside domainpar's communication
    calls so far (all threads; a nested call counted once)."""
    return _total[0]


def blocking_calls() -> int:
    """Local. How many outermost communication calls have been timed so far."""
    return _total[1]


def blocking(fn):
    """Decorator: count ``fn``'s wall time into ``blocked_seconds``."""
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        depth = getattr(_local, "depth", 0)
        if depth:
            return fn(*args, **kwargs)
        _local.depth = 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            _local.depth = 0
            with _lock:
                _total[0] += took
                _total[1] += 1
    return timed
