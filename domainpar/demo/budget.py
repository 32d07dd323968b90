"""The demo's per-rank memory budget, enforced by the kernel.

``enforce(nbytes)`` caps this process's data segment (``RLIMIT_DATA``: on
Linux 4.7 and later every private writable mapping, so the heap and the
anonymous ``mmap`` that torch's CPU allocator, numpy, MPI and h5py allocate
from) at its size now plus ``nbytes``. The budget is thus what a rank may
allocate on top of what it held after its imports and set-up (torch, MPI,
h5py and their libraries: about 250 MiB here, the same whatever the field),
as a device's memory is what a model may use beyond what the host process
holds. An allocation past it fails: torch raises ``RuntimeError:
DefaultCPUAllocator: can't allocate memory``, Python ``MemoryError``.

``peak_above_baseline()`` is the measured peak: the resident-set high-water
mark (reset by ``enforce``) less the resident size at ``enforce``. Resident
pages are what was touched; the limit counts what was mapped, which is at
least as much, so a peak below the budget under the limit is the run that
fits it, not a comparison of numbers.

``python -m domainpar.demo.budget`` is the one-process attempt: the demo's
first two training steps on the whole field on a one-rank grid (the same code
a rank of the sharded run executes), under the budget, in a process of its
own so that its failure is reported and the job goes on (``one_process``).
Under ``mpiexec -n N`` it is the same steps sharded over N ranks, each under
the budget (the tests use it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..bench import memory
from ..plan.units import format_bytes, parse_bytes

OFF = ("none", "off")
MMAP_THRESHOLD = 128 * 1024  # glibc's own starting values of its mmap and trim thresholds
STEPS = 2  # the attempt's training steps: the second holds Adam's state too
# Set by mpiexec in each rank (Open MPI sets OMPI_MCA_orte_*, ess, pmix too): a
# process started from a rank must not inherit them, or its MPI_Init would try
# to join the rank's job instead of starting alone (a singleton, which needs
# no transport settings: it talks to no one).
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "PMI_", "HYDRA_", "OPAL_", "ORTE_")
_KEEP_PREFIXES = ("OMPI_ALLOW_RUN_AS_ROOT",)


def memory_size(text: str) -> int | None:
    """Local. argparse type of ``--memory-per-rank``: a size (``2GiB``,
    ``1500MiB``, ``3e8``) in bytes, or None for ``none``/``off``."""
    if str(text).strip().lower() in OFF:
        return None
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or 'none'") from exc


def _status_bytes(key: str) -> int:
    kib = memory.status_kib(key)
    if kib is None:
        raise OSError(f"{memory.STATUS} has no {key} line: the memory budget needs Linux")
    return kib * 1024


@dataclass
class Limit:
    """What ``enforce`` set: the budget, the data segment and resident size at
    that point (the baseline), and the limit before (restored by ``release``)."""
    budget: int
    data_baseline: int
    rss_baseline: int
    previous: tuple[int, int]

    def peak_above_baseline(self) -> int:
        """Local. Peak resident bytes since ``enforce`` less the resident size then."""
        return max(0, _status_bytes("VmHWM") - self.rss_baseline)

    def release(self) -> None:
        """Local. Lift the limit (back to what it was before ``enforce``)."""
        resource.setrlimit(resource.RLIMIT_DATA, self.previous)


def _settle() -> None:
    """Local. Make the baseline what a training step needs before its first
    tensor: load what torch's optimizer imports on its first step
    (``torch._dynamo``, about 70 MiB, the same for any field); have glibc give
    every freed block of 128 KiB or more back to the system, and free heap
    memory past 128 KiB (glibc's default raises the first threshold to 32 MiB
    as blocks are freed, and domainpar fixes both at 2 GiB on import,
    ``comm.runtime.malloc_thresholds``: freed memory would stay mapped, a
    budget would then count tensors long dead, and memory freed before
    ``enforce`` could be reused uncounted); and return what the heap holds
    free now."""
    import torch._dynamo  # noqa: F401

    from ..comm.runtime import set_malloc_thresholds
    set_malloc_thresholds(MMAP_THRESHOLD, MMAP_THRESHOLD)
    memory.trim()


def enforce(budget: int) -> Limit:
    """Local. Cap this process's data segment at its size now plus ``budget``
    bytes and reset its resident high-water mark (see the module docstring);
    first settle the allocator and the lazy imports (``_settle``)."""
    _settle()
    data, rss = _status_bytes("VmData"), _status_bytes("VmRSS")
    previous = resource.getrlimit(resource.RLIMIT_DATA)
    hard = previous[1]
    soft = data + budget if hard == resource.RLIM_INFINITY else min(data + budget, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    if not memory.reset_peak():  # VmHWM (and ru_maxrss) := VmRSS
        raise OSError("/proc/self/clear_refs cannot be written: the memory budget needs Linux")
    return Limit(budget, data, rss, previous)


def out_of_memory(exc: BaseException) -> bool:
    """Local. Whether ``exc`` is an allocation failing (torch's or Python's)."""
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc)
                                           or "out of memory" in str(exc).lower()))


def abort_if_out_of_memory(comm, exc: BaseException) -> None:
    """Collective in effect. When ``exc`` is an allocation failing on this rank of
    a job of several, say so and abort the job: the other ranks wait for this
    one in a collective, and unwinding (closing a file collectively, say) would
    only wait for them in another. Returns otherwise."""
    if comm.Get_size() > 1 and out_of_memory(exc):
        print(f"domainpar demo: rank {comm.Get_rank()} of {comm.Get_size()} ran out of "
              f"memory: {_last_line(exc)}; aborting the job", file=sys.stderr, flush=True)
        comm.Abort(3)


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


def requested_bytes(message: str) -> int | None:
    """Local. The size of the allocation that failed, from torch's message."""
    match = re.search(r"tried to allocate (\d+) bytes", message)
    return int(match.group(1)) if match else None


def solo_env() -> dict:
    """Local. This environment without the launcher's per-job variables, for a
    process that must start as a job of its own (MPI singleton)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(_LAUNCHER_PREFIXES) or k.startswith(_KEEP_PREFIXES)}


def one_process(h5, *, budget: int, batch: int, width: int, seed: int, out: Path,
                steps: int = STEPS) -> dict:
    """Local. Run the one-process attempt (this module as a script) and return
    its report: ``fits``, ``peak_bytes`` (above its baseline), ``error`` and
    ``requested_bytes`` when it failed, ``returncode``."""
    report_path = Path(out) / "one_process.json"
    report_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "domainpar.demo.budget", str(h5), "--budget", str(budget),
           "--batch", str(batch), "--width", str(width), "--seed", str(seed),
           "--steps", str(steps), "--report", str(report_path)]
    proc = subprocess.run(cmd, env=solo_env(), capture_output=True, text=True)
    if report_path.exists():
        report = json.loads(report_path.read_text())
    else:  # killed before it could write (a signal, an abort in a library)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        report = {"fits": False, "peak_bytes": None, "requested_bytes": None,
                  "error": f"exit status {proc.returncode}: " + " / ".join(tail)}
    report["returncode"] = proc.returncode
    return report


def _attempt(args) -> dict:
    """Collective. ``args.steps`` training steps of the demo on ``args.h5``, D cut
    over every rank of this job (one, when started by ``one_process``), under
    ``args.budget`` in each; the report ``one_process`` reads, from rank 0. A
    rank that runs out of memory beside others aborts the job (they would wait
    for it forever)."""
    import domainpar as dp

    from . import surrogate
    comm = dp.init()
    grid = dp.ProcessGrid((comm.Get_size(),))
    limit = enforce(args.budget)
    try:
        surrogate.train(args.h5, grid, steps=args.steps, batch=args.batch, width=args.width,
                        lr=1e-3, seed=args.seed, quiet=True)
    except (RuntimeError, MemoryError) as exc:  # one rank: several abort in train
        if not out_of_memory(exc):
            raise
        limit.release()
        return {"fits": False, "peak_bytes": limit.peak_above_baseline(),
                "requested_bytes": requested_bytes(str(exc)), "error": _last_line(exc)}
    limit.release()
    peaks = comm.allgather(limit.peak_above_baseline())
    return {"fits": True, "peak_bytes": max(peaks), "peaks": peaks, "error": None,
            "requested_bytes": None, "ranks": comm.Get_size()}


def describe(report: dict, budget: int) -> str:
    """Local. One line on the one-process attempt."""
    peak = report.get("peak_bytes")
    if report["fits"]:
        assert peak is not None  # a run that fits recorded its peak
        return f"fits: peak {format_bytes(peak)} of the {format_bytes(budget)} budget"
    asked = report.get("requested_bytes")
    more = f", then asked for {format_bytes(asked)} more" if asked else ""
    held = f"after {format_bytes(peak)}{more}" if peak is not None else "no peak recorded"
    return f"out of memory ({held}; budget {format_bytes(budget)}): {_short(report['error'])}"


def _short(error: str) -> str:
    """torch's allocator message without its source location and errno text."""
    error = re.sub(r"\[enforce fail at [^\]]*\] err == 0\. ", "", error)
    return error.split(" Error code")[0][:200]


def main(argv=None) -> int:
    """Collective (over the job it runs in). The attempt; its report to --report."""
    parser = argparse.ArgumentParser(prog="python -m domainpar.demo.budget",
                                     description="the demo's one-process attempt")
    parser.add_argument("h5")
    parser.add_argument("--budget", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--report", required=True)
    args = parser.parse_args(argv)
    report = _attempt(args)
    if report.get("ranks", 1) == 1 or _rank() == 0:
        Path(args.report).write_text(json.dumps(report))
    return 0


def _rank() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


if __name__ == "__main__":
    sys.exit(main())
