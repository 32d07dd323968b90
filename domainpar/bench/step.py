"""`domainpar bench step`: where a training step's time goes, rank by rank.

A training step (forward, mean-squared-error loss, backward, SGD step with
momentum, ``DomainParallel``, float32, one torch thread per rank), or with
``--inference`` one forward in eval mode under ``torch.no_grad``, of three
reference models (``domainpar.testing.models``: UNet3d, ViT2d, FNO2d), the
field sharded along dim 2 over a 1-D grid of all ranks, on 1, 2 and 4 ranks,
each rank count in its own job. Each rank's wall time of each step is split,
in the same run, into:

- ``halo``, ``allreduce``, ``other_comm`` (repartitions, ring shifts, gathers,
  broadcasts), ``agreement`` (``agree``: the checks that every rank sees the
  same op): the time in comm/'s blocking calls, timed through
  ``comm.clock.observing``, less the part counted as waiting;
- ``waiting``: of each such call, the time from this rank's entry to the
  latest entry of the ranks it waits for (its grid neighbours for halo
  exchanges and ring shifts, every rank for collectives), at most the call's
  length: time blocked for other ranks, not moving bytes. Entry times are
  read on each rank's clock after a common barrier (exact on one node);
- ``dispatch``: domainpar's Python around the local work of each DomainTensor
  call (``tensor.dispatch.observing_ops``: the dispatch, layout derivation,
  plans, wrapping): the call's time less the torch calls it makes on blocks
  (timed by a ``TorchFunctionMode`` entered only inside DomainTensor calls),
  less domainpar's C loops on blocks (``ops.rowwise.seconds``) and less its
  communication;
- ``instrumentation``: the measured cost of that timing itself (per observed
  call and per timed torch call, calibrated in the job before the steps);
- ``compute``: the rest of the step: the torch calls on blocks, backward's
  kernels (autograd runs on the blocks, outside any DomainTensor call), the
  optimizer and the model's own Python. It is the remainder, and is checked
  to be non-negative: a part counted twice would show as a negative remainder.

Besides the instrumented steps, as many plain steps run interleaved with them
(``plain_step_s``: the slowest rank's median without instrumentation). Each
rank's CPU time per step (``step_cpu_s``, ``time.process_time``, and the part
of it inside comm/'s calls, ``comm_cpu_s``) tells work from time the rank was
not running: on a loaded or oversubscribed machine a descheduled rank's lost
time lands in whatever part it was in, mostly compute and waiting.

The job with the fewest ranks also times one DomainTensor op (``x + y`` and
``F.gelu``) on a one-rank grid against plain torch on the same block, for
blocks of 1k to 1M cells: the dispatch overhead per op, in microseconds.

This module measures (the jobs run it: ``python -m domainpar.bench.step
--worker``); ``bench.stepreport`` launches them and writes the report.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

SHARDED_DIM = 2
PARTS = ("compute", "dispatch", "agreement", "halo", "allreduce", "other_comm", "waiting",
         "instrumentation")
MODELS = ("unet3d", "vit2d", "fno2d", "resnet3d")
DEFAULT_MODELS = MODELS[:3]  # resnet3d (fusion's model) only when asked for
DEFAULT_RANKS = (1, 2, 4)
DISPATCH_CELLS = (1_000, 10_000, 100_000, 1_000_000)
_NEIGHBOUR_WISE = ("HaloExchange.fill", "HaloExchange.accumulate", "PendingShift.wait",
                   "mirror_exchange")


def _kind(name: str) -> str:
    """The part a comm/ call's time goes to (less its waiting)."""
    if name.startswith("HaloExchange."):
        return "halo"
    if name in ("allreduce", "PendingReduction.wait"):
        return "allreduce"
    if name == "agree":
        return "agreement"
    return "other_comm"


# -- the models ---------------------------------------------------------------------------------
def model_factory(name: str, shape, width: int = 4, levels: int = 4):
    """Local. A factory of the benchmark model ``name`` (``MODELS``) for a field of
    global ``shape`` (N, C, spatial...), as many channels out as in: the UNet3d
    with ``width`` channels at its first of ``levels`` levels; the ViT2d (patch 4,
    dim 32, 4 heads, 2 blocks) and the FNO2d (width 8, 4 layers, up to 8 modes)
    at their ``bench step`` sizes."""
    from ..testing import models
    c = shape[1]
    if name == "unet3d":
        return lambda: models.UNet3d(c, c, width=width, levels=levels)
    if name == "vit2d":
        return lambda: models.ViT2d(tuple(shape[2:]), c, c, patch=4, dim=32, heads=4, depth=2)
    if name == "fno2d":
        return lambda: models.FNO2d(c, c, width=8, modes=min(8, min(shape[2:]) // 4), layers=4)
    if name == "resnet3d":
        return lambda: models.ResNet3d(c, c, width=2 * width, blocks=levels - 1)
    raise ValueError(f"unknown model {name!r}; use one of {', '.join(MODELS)}")


def describe_model(name: str, width: int = 4, levels: int = 4) -> str:
    """Local. ``model_factory``'s model ``name`` in words, for reports."""
    return {"unet3d": f"UNet3d(width={width}, levels={levels})",
            "vit2d": "ViT2d(patch=4, dim=32, heads=4, depth=2)",
            "fno2d": "FNO2d(width=8, modes=min(8, side/4), layers=4)",
            "resnet3d": f"ResNet3d(width={2 * width}, blocks={levels - 1})"}[name]


def model_spec(name: str, unet_side: int, field_side: int, levels: int = 4) -> tuple:
    """Local. ``(factory, global shape)`` of a benchmark model: the UNet3d on a
    ``unet_side``^3 field of 2 channels, the 2-D models on ``field_side``^2, one channel."""
    shape = ((1, 2, unet_side, unet_side, unet_side) if name in ("unet3d", "resnet3d")
             else (1, 1, field_side, field_side))
    return model_factory(name, shape, levels=levels), shape


def _sharded_model(grid, factory, shape):
    """Collective. ``factory()`` in DomainParallel over ``grid`` (the same initial
    parameters on every rank), the Decomposition of global ``shape`` sharded along
    dim 2, a random input block, and the generator that made it (seeded per rank)."""
    import torch

    import domainpar as dp
    torch.manual_seed(0)  # the same initial parameters on every rank
    model = dp.DomainParallel(factory(), grid)
    dec = dp.Decomposition(shape, grid, {SHARDED_DIM: 0})
    gen = torch.Generator().manual_seed(1 + grid.rank)
    x = dp.DomainTensor(torch.randn(dec.local_shape(), generator=gen), dec)
    return model, dec, x, gen


def training_step(grid, factory, shape):
    """Collective. One training step (MSE loss, SGD with momentum) of ``factory()``
    in DomainParallel on a random field of global ``shape`` sharded along dim 2
    over ``grid`` (a 1-D ProcessGrid): returns (step function, this rank's block
    shape). Every rank builds the same initial model; each generates only its
    own block of the input and target."""
    import torch
    import torch.nn.functional as F

    import domainpar as dp
    model, dec, x, gen = _sharded_model(grid, factory, shape)
    target = dp.DomainTensor(torch.randn(dec.local_shape(), generator=gen), dec)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), target).backward()
        opt.step()
    return step, tuple(dec.local_shape())


def inference_step(grid, factory, shape):
    """Collective. One inference forward of ``factory()`` (eval mode, under
    ``torch.no_grad``: no loss, no backward) in DomainParallel on a random field
    of global ``shape`` sharded along dim 2 over ``grid``: returns (step
    function, this rank's block shape), as ``training_step``."""
    import torch
    model, dec, x, _ = _sharded_model(grid, factory, shape)
    model.eval()

    def step():
        with torch.no_grad():
            model(x)
    return step, tuple(dec.local_shape())


# -- the recorder -------------------------------------------------------------------------------
class Recorder:
    """Local. What one rank's step spends where: comm/ calls (kind, entry time,
    length, inside a DomainTensor call or not), the DomainTensor calls' time and
    the torch calls they make on blocks. ``recording()`` turns both hooks on."""

    def __init__(self):
        self.t0 = 0.0
        # per torch callable, over every step since made: [calls, own seconds, torch calls]
        self.by_op: dict = {}
        self.reset()

    def reset(self, t0: float = 0.0) -> None:
        """Local. Start a step at ``t0`` (``perf_counter``)."""
        self.t0, self.in_op = t0, False
        self.calls: list[tuple[str, float, float, bool]] = []
        self.op_s = self.local_s = 0.0
        self.ops = self.local_calls = 0

    @contextlib.contextmanager
    def comm_call(self, name: str):
        """An observer for ``comm.clock.observing``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.calls.append((name, start - self.t0, time.perf_counter() - start, self.in_op))

    @contextlib.contextmanager
    def op_call(self, func):
        """An observer for ``dispatch.observing_ops``: the call's time, its torch calls timed."""
        from ..ops import rowwise
        self.in_op = True
        local, local_calls, calls = self.local_s, self.local_calls, len(self.calls)
        native, start = rowwise.seconds(), time.perf_counter()
        try:
            with _LocalClock(self):
                yield
        finally:
            took = time.perf_counter() - start
            self.local_s += rowwise.seconds() - native  # C loops: local work, as torch's
            self.op_s += took
            self.ops += 1
            self.in_op = False
            entry = self.by_op.setdefault(func, [0, 0.0, 0])
            entry[0] += 1
            entry[1] += took - (self.local_s - local) - sum(c[2] for c in self.calls[calls:])
            entry[2] += self.local_calls - local_calls

    @contextlib.contextmanager
    def recording(self):
        """Local. Both hooks on for the block."""
        from ..comm import clock
        from ..tensor import dispatch
        with clock.observing(self.comm_call), dispatch.observing_ops(self.op_call):
            yield


def _local_clock_class():
    from torch.overrides import TorchFunctionMode

    from ..comm import clock

    class LocalClock(TorchFunctionMode):
        """Times each torch call made inside a DomainTensor call (less comm inside it)."""

        def __init__(self, recorder):
            super().__init__()
            self.recorder = recorder

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.recorder.local_calls += 1
            if getattr(func, "__name__", "") in ("__get__", "__set__"):  # metadata: dispatch
                return func(*args, **(kwargs or {}))
            blocked, start = clock.blocked_seconds(), time.perf_counter()
            try:
                return func(*args, **(kwargs or {}))
            finally:
                took = time.perf_counter() - start - (clock.blocked_seconds() - blocked)
                self.recorder.local_s += took
    return LocalClock


_CLASSES: dict = {}


def _LocalClock(recorder):  # noqa: N802 (a class made once torch is imported)
    if "clock" not in _CLASSES:
        _CLASSES["clock"] = _local_clock_class()
    return _CLASSES["clock"](recorder)


# -- one step's parts ---------------------------------------------------------------------------
def _waits(per_rank_calls: list[list], rank: int, size: int) -> list[float] | None:
    """Local. This rank's waiting in each of its comm calls, from every rank's
    (name, entry, length) lists; None where the ranks' call sequences differ."""
    mine = per_rank_calls[rank]
    if any([c[0] for c in calls] != [c[0] for c in mine] for calls in per_rank_calls):
        return None
    waits = []
    for i, (name, entry, took, _) in enumerate(mine):
        if name in _NEIGHBOUR_WISE:
            peers = [r for r in (rank - 1, rank + 1) if 0 <= r < size] or [rank]
        else:
            peers = list(range(size))
        latest = max(per_rank_calls[r][i][1] for r in peers)
        waits.append(min(took, max(0.0, latest - entry)))
    return waits


def step_parts(rec: Recorder, wall: float, waits, costs: dict) -> dict:
    """Local. The parts of one step of ``wall`` seconds (they sum to it)."""
    parts = dict.fromkeys(PARTS, 0.0)
    comm_in_ops = 0.0
    for (name, _, took, in_op), wait in zip(rec.calls, waits or [0.0] * len(rec.calls)):
        parts[_kind(name)] += took - wait
        parts["waiting"] += wait
        comm_in_ops += took if in_op else 0.0
    parts["instrumentation"] = rec.ops * costs["per_op_s"] + rec.local_calls * costs["per_call_s"]
    parts["dispatch"] = rec.op_s - rec.local_s - comm_in_ops - parts["instrumentation"]
    parts["compute"] = wall - sum(v for k, v in parts.items() if k != "compute")
    return parts


def calibrate(repeats: int = 2000, rounds: int = 7) -> dict:
    """Local. The instrumentation's own cost (medians of interleaved rounds): per
    timed torch call (``torch.add`` of tiny tensors, timed against untimed) and
    per observed DomainTensor call (reading ``requires_grad`` of a DomainTensor
    on a one-rank grid, observed against unobserved: a call whose own work is
    tiny, so that the difference is the hooks' and no op's noise)."""
    import statistics

    import torch
    from mpi4py import MPI

    import domainpar as dp
    a = torch.ones(4)
    x = dp.DomainTensor.from_local(torch.ones(4), dp.ProcessGrid((1,), comm=MPI.COMM_SELF),
                                   shard={0: 0})
    rec = Recorder()

    def loop(fn):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats

    def add():
        return torch.add(a, a)

    def read():
        return x.requires_grad

    per_call, per_op = [], []
    for _ in range(rounds):
        plain = loop(add)
        with _LocalClock(rec):
            per_call.append(loop(add) - plain)
        plain = loop(read)
        with rec.recording():
            per_op.append(loop(read) - plain)
    return {"per_call_s": max(statistics.median(per_call), 0.0),
            "per_op_s": max(statistics.median(per_op), 0.0)}


def measure_model(comm, factory, shape, repeats: int, costs: dict, warmup: int = 1,
                  inference: bool = False) -> dict:
    """Collective. ``repeats`` instrumented steps of the model interleaved with
    as many plain ones: every rank's mean parts per step and the step times.
    A step is a training step, or with ``inference`` a no_grad forward
    (``inference_step``)."""
    import statistics

    from mpi4py import MPI

    from ..comm import ProcessGrid
    make = inference_step if inference else training_step
    step = make(ProcessGrid((comm.Get_size(),), comm=comm), factory, shape)[0]
    rec = Recorder()
    for _ in range(warmup):
        comm.Barrier()
        step()
    rows, plain = [], []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        step()
        plain.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        rows.append(_recorded_step(comm, step, rec, costs))
    walls = [r["wall"] for r in rows]
    mine: dict = {"step_s": statistics.fmean(walls),
                  "parts_s": {k: statistics.fmean(r["parts"][k] for r in rows)
                              for k in PARTS},
                  "step_cpu_s": statistics.fmean(r["cpu"] for r in rows),
                  "comm_cpu_s": statistics.fmean(r["comm_cpu"] for r in rows),
                  "ops_per_step": rec.ops, "block_torch_calls_per_step": rec.local_calls,
                  "comm_calls_per_step": len(rec.calls)}
    mine["dispatch_us_per_op"] = 1e6 * mine["parts_s"]["dispatch"] / max(rec.ops, 1)
    mine["dispatch_by_op"] = dispatch_by_op(rec.by_op, repeats, costs)
    matched = all(r["matched"] for r in rows)
    per_rank = comm.allgather(mine)
    return {"ranks": comm.Get_size(), "global_shape": list(shape), "per_rank": per_rank,
            "waits_matched": bool(comm.allreduce(int(matched), op=MPI.MIN)),
            "step_samples_s": [max(s) for s in zip(*comm.allgather(walls))],
            "plain_step_s": statistics.median(plain), "plain_samples_s": plain,
            "mean_parts_s": {k: statistics.fmean(r["parts_s"][k] for r in per_rank)
                             for k in PARTS}}




def dispatch_by_op(by_op: dict, steps: int, costs: dict, most: int = 12) -> dict:
    """Local. The ``most`` DomainTensor calls with the most dispatch time per
    step (less their instrumentation), by op name: calls and seconds per step."""
    from ..tensor.dispatch import op_name
    out: dict = {}
    for func, (calls, own, local_calls) in by_op.items():
        row = out.setdefault(op_name(func), {"calls": 0.0, "dispatch_s": 0.0})
        row["calls"] += calls / steps
        row["dispatch_s"] += (own - calls * costs["per_op_s"]
                              - local_calls * costs["per_call_s"]) / steps
    ranked = sorted(out.items(), key=lambda kv: -kv[1]["dispatch_s"])
    return dict(ranked[:most])

def _recorded_step(comm, step, rec: Recorder, costs: dict) -> dict:
    """Collective. One instrumented step after a barrier: its parts, wall and CPU
    time (the process's, and the part of it inside comm/'s calls)."""
    from ..comm import clock
    comm.Barrier()
    cpu, comm_cpu = time.process_time(), clock.blocked_seconds(cpu=True)
    start = time.perf_counter()
    rec.reset(start)
    with rec.recording():
        step()
    wall = time.perf_counter() - start
    cpu, comm_cpu = time.process_time() - cpu, clock.blocked_seconds(cpu=True) - comm_cpu
    waits = _waits(comm.allgather(rec.calls), comm.Get_rank(), comm.Get_size())
    return {"parts": step_parts(rec, wall, waits, costs), "wall": wall, "cpu": cpu,
            "comm_cpu": comm_cpu, "matched": waits is not None}

def dispatch_overhead(cells=DISPATCH_CELLS, budget_s: float = 0.02, rounds: int = 5) -> list:
    """Local. One DomainTensor op on a one-rank grid against plain torch on the
    same block, per block size: the medians per call and the overhead in us."""
    import statistics

    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    import domainpar as dp
    grid = dp.ProcessGrid((1,), comm=MPI.COMM_SELF)
    table = []
    for n in cells:
        a, b = torch.randn(1, 1, n), torch.randn(1, 1, n)
        x, y = (dp.DomainTensor.from_local(t, grid, shard={2: 0}) for t in (a, b))
        for op, fn in (("add", lambda u, v: u + v), ("gelu", lambda u, v: F.gelu(u))):
            calls = max(1, int(budget_s / max(_per_call(fn, a, b, 3), 1e-7)))
            plain, wrapped = [], []
            for _ in range(rounds):  # interleaved
                plain.append(_per_call(fn, a, b, calls))
                wrapped.append(_per_call(fn, x, y, calls))
            p, w = statistics.median(plain), statistics.median(wrapped)
            table.append({"op": op, "cells": n, "torch_us": 1e6 * p, "domaintensor_us": 1e6 * w,
                          "overhead_us": 1e6 * (w - p), "ratio": w / p})
    return table


def _per_call(fn, u, v, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(u, v)
    return (time.perf_counter() - start) / calls


# -- the jobs -----------------------------------------------------------------------------------
def _measure_all(comm, args) -> dict:
    """Collective. The job's figures: every model's steps, and on request the
    dispatch table (rank 0, the others waiting)."""
    from ..progress import Progress
    from .timing import on_rank0
    costs = comm.bcast(calibrate() if comm.Get_rank() == 0 else None, root=0)
    result: dict = {"instrumentation_costs_s": costs, "models": {}}
    bar = Progress(len(args.models), f"  {comm.Get_size()} rank(s), models", comm=comm)
    for name in args.models:
        factory, shape = model_spec(name, args.unet_side, args.field_side, args.levels)
        result["models"][name] = measure_model(comm, factory, shape, args.repeats, costs,
                                               inference=args.inference)
        bar.update(job=name)
    bar.close()
    if args.dispatch:
        result["dispatch_overhead"] = on_rank0(comm, dispatch_overhead)
    return result


def _worker_main(argv=None) -> int:
    from . import jobs, settings
    parser = argparse.ArgumentParser(description="internal: a job of `domainpar bench step`")
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--models", nargs="+", choices=MODELS, required=True)
    parser.add_argument("--unet-side", type=int, required=True)
    parser.add_argument("--field-side", type=int, required=True)
    parser.add_argument("--levels", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--dispatch", action="store_true")
    parser.add_argument("--inference", action="store_true")
    parser.add_argument("--result", required=True)
    settings.add_argument(parser)
    args = parser.parse_args(argv)
    from ..comm import init
    comm = init()
    return jobs.run_worker(args, lambda: _measure_all(comm, args))


if __name__ == "__main__":
    sys.exit(_worker_main())
