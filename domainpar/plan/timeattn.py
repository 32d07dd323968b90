"""The time model's attention: the work of a step's attention kernels, counted
from the kernels' own operands, and its price at another rank count.

Ring attention (``ops/ring.py``) computes a rank's N/P queries against all N
keys, block by block: P kernel calls of (N/P) x (N/P) per pass, N^2/P of work
per rank, where the same model built for one rank's block of the field would
do (N/P)^2. The compute fit (one process, scaled-down blocks) therefore cannot
price it; ``counting`` reads the work off every attention kernel a step calls
(torch's CPU flash kernel, forward and backward: ``batch x heads x queries x
keys x head dim`` of each call, the shapes of its q and k), with the kernels'
own wall time. The compute fit takes the kernels' time out of its points
(``timerun.measure_compute``); the trace's kernels, run at the real key count,
give the price of the work (``attention_seconds``).

Not counted: ring attention's tiled math kernel (half types off the flash
path, masks), whose matmuls a dispatch mode cannot tell from others.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

from .comms import Event, Where

# The kernels counted, each with the positions of its q and k operands: aten's
# names in torch 2.13 (the private TorchDispatchMode below too);
# tests/test_time_model.py::test_counting_reads_the_flash_kernels_forward_and_backward
# fails when a torch release renames them.
KERNELS = {"_scaled_dot_product_flash_attention_for_cpu": (0, 1),
           "_scaled_dot_product_flash_attention_for_cpu_backward": (1, 2)}


def work_of(q_shape, k_shape) -> int:
    """Local. One kernel call's work: batch x heads x queries x keys x head dim
    (q of shape (..., queries, head dim), k of shape (..., keys, head dim))."""
    return math.prod(q_shape[:-1]) * k_shape[-2] * q_shape[-1]


class _Tally:
    """The running sums of one ``counting`` block."""

    def __init__(self) -> None:
        self.work, self.seconds, self.calls = 0, 0.0, 0

    def event(self, ranks: int) -> Event:
        """Local. The tally as the step's ``attention`` event, traced on ``ranks``."""
        return Event("attention", "kernels", ranks=ranks, work=self.work, seconds=self.seconds,
                     messages=0)


@contextlib.contextmanager
def counting() -> Iterator[_Tally]:
    """Local. Within the block, every attention kernel this process runs adds its
    work and wall time to the yielded tally (a torch dispatch mode: every aten op
    pays a Python call, so time steps outside this block)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    tally = _Tally()

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            operands = KERNELS.get(func.__name__.split(".")[0])
            if operands is None:
                return func(*args, **(kwargs or {}))
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            tally.seconds += time.perf_counter() - t0
            tally.work += work_of(args[operands[0]].shape, args[operands[1]].shape)
            tally.calls += 1
            return out

    with _Mode():
        yield tally


def target_work(e: Event, where: Where) -> float:
    """Local. The attention work of event ``e`` on a rank of ``where``: queries
    and keys both scale with the field's cells (``where.scale``); a rank holds
    1/P of the queries and meets every key, so the work per rank is the traced
    one x scale^2 x (traced ranks / P)."""
    cells = math.prod(where.scale) if where.scale else 1.0
    return e.work * cells * cells * e.ranks / where.size


def attention_seconds(e: Event, where: Where, rate: float = 1.0) -> float:
    """Local. The kernels' time of event ``e`` on ``where``: the traced seconds
    per unit of work (measured at the real key count) times the target's work,
    times the compute ``rate``."""
    if e.work <= 0:
        return 0.0
    return e.seconds / e.work * target_work(e, where) * rate
