"""The `domainpar model` runs: the pieces every subcommand shares (compute
measured in this process, the MPI jobs of ``timejobs``) and ``predict``.
``validate`` and ``project`` are in ``timereport``."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .comms import Event
from .measure import PlanError, Setup, constraints, ladder, load_factory
from .model import fit
from .timemodel import PROFILES, Compute, Machine, Network, best_grid, predict


def spec(name: str, entry: str, kwargs: dict, shape, dims, size_kwarg: str | None = None) -> dict:
    """Local. A model as the jobs take it; ``size_kwarg``: the keyword that gives
    the model its field's spatial size (a ViT's positional table), set to each
    measured block's when compute is measured on scaled-down blocks."""
    return {"name": name, "entry": entry, "kwargs": kwargs, "shape": list(shape),
            "dims": list(dims), "size_kwarg": size_kwarg}


def job(name: str, nprocs: int, transport: str = "default", models=(), repeats: int = 5,
        timeout: float = 1800) -> dict:
    """Local. Run ``timejobs`` ``name`` on ``nprocs`` ranks; its JSON."""
    from ..launch import mpiexec_path, transport_env
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, "-m",
               "domainpar.plan.timejobs", name, "--models", json.dumps(list(models)),
               "--repeats", str(repeats), "--out", str(out)]
        code = subprocess.call(cmd, env=transport_env(transport), timeout=timeout,
                               stdout=subprocess.DEVNULL)
        if code != 0 or not out.exists():
            raise PlanError(f"`{' '.join(cmd[:4])} ... {name}` failed (exit {code})")
        return json.loads(out.read_text())


def traced(models, nprocs: int = 2) -> dict[str, list[Event]]:
    """Local. Each model's recorded step events from a ``nprocs``-rank run."""
    result = job("trace", nprocs, models=models)
    return {name: [Event.from_dict(e) for e in r["events"]] for name, r in result.items()}


def measured_network(transport: str) -> Network:
    """Local. Latency and bandwidth measured by a 2-rank job over ``transport``."""
    r = job("network", 2, transport)
    return Network(f"here-{transport}", r["latency_s"], r["bandwidth_Bps"],
                   r["allreduce_small_s"])


def measure_compute(model: dict, points: int = 4, budget_s: float = 60.0,
                    repeats: int = 3, blocks=None) -> tuple[Compute, list[dict]]:
    """Local. Fit the step time of ``model`` on a block (one torch thread, a
    one-rank grid, the plan's scaled-down blocks, or ``blocks``); the fit and
    the measured points. Each point's attention kernels (``timeattn``) are
    timed in steps apart and left out of the fit: the model prices them from
    the trace, at the real key count."""
    import torch
    from mpi4py import MPI

    from ..comm import ProcessGrid
    dims = tuple(model["dims"])
    setup = Setup(load_factory(model["entry"], model["kwargs"]), tuple(model["shape"]), dims,
                  optimizer="sgd")
    multiple, min_block = constraints(setup.factory())
    grid = ProcessGrid((1,) * len(dims), comm=MPI.COMM_SELF)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    points_out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    attends = True  # until the first block's step runs no attention kernel
    try:
        for block in blocks or ladder(setup.shape, dims, multiple, min_block):
            if len(points_out) >= points or (len(points_out) >= 3
                                             and time.perf_counter() - t0 > budget_s):
                break
            if model.get("size_kwarg"):  # the model built for the block's field
                kwargs = {**model["kwargs"], model["size_kwarg"]: list(block[2:])}
                setup.factory = load_factory(model["entry"], kwargs)
            point = _step_seconds(setup, block, grid, repeats, attends)
            attends = point["work"] > 0
            points_out.append({"block": list(block), **point})
    finally:
        torch.set_num_threads(threads)
    return fit_compute(points_out, dims)


def fit_compute(points, dims) -> tuple[Compute, list[dict]]:
    """Local. The compute fit to measured ``{"block", "seconds"}`` points less
    their ``attention_s`` (the median per block where a block was measured more
    than once)."""
    from .model import features
    by_block: dict[tuple, list[float]] = {}
    for p in points:
        by_block.setdefault(tuple(p["block"]), []).append(
            p["seconds"] - p.get("attention_s", 0.0))
    f = fit([(*features(b, dims), statistics.median(t)) for b, t in by_block.items()])
    return Compute(f.coef, tuple(dims)), points


def _step_seconds(setup: Setup, block, grid, repeats: int, attends: bool = True) -> dict:
    """``seconds``: the median time of a training step (SGD) on ``block`` over a
    one-rank grid; ``attention_s`` and ``work``: its attention kernels' least
    time and their work, in two steps apart (``attends`` False: not counted)."""
    import torch

    import domainpar as dp

    from ..comm import Decomposition
    from .timeattn import counting
    torch.manual_seed(0)
    model = dp.DomainParallel(setup.factory(), grid)
    x = dp.DomainTensor(torch.randn(tuple(block)),
                        Decomposition(tuple(block), grid, {d: i for i, d in enumerate(setup.dims)}))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    kernels = []
    for _ in range(2 if attends else 0):
        with counting() as tally:
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
        kernels.append((tally.seconds, tally.work))
    seconds, work = min(kernels, default=(0.0, 0))
    return {"seconds": statistics.median(times[1:]), "attention_s": seconds, "work": work}


def machine_here(network: Network) -> Machine:
    """Local. This machine: its cores shared by all ranks, ``network``."""
    return Machine(network.name, network, 1.0, os.cpu_count() or 1)


def machine_from(args) -> Machine:
    """Local. The machine of ``predict``'s options: a profile, or entered values."""
    if args.profile in PROFILES:
        base = PROFILES[args.profile]
    else:
        base = machine_here(measured_network(args.profile))
    net = base.network
    if args.latency is not None or args.bandwidth is not None:
        net = Network("entered", args.latency if args.latency is not None else net.latency_s,
                      args.bandwidth if args.bandwidth is not None else net.bandwidth_Bps)
    return Machine(base.name, net, args.rate if args.rate is not None else base.rate,
                   args.cores or base.cores, args.ranks_per_node or base.ranks_per_node)


def predict_command(args) -> int:
    """``domainpar model predict``: one model's predicted step per rank count."""
    from .run import shard_dims
    shape = tuple(args.shape)
    dims = shard_dims(shape, args.shard_dims)
    model = spec("model", args.entry, args.kwargs, args.trace_shape or shape, dims)
    print(f"domainpar model: {args.entry} on {'x'.join(map(str, shape))}; tracing one step "
          "on 2 ranks, measuring compute in this process ...", flush=True)
    events = traced([model])["model"]
    compute, points = measure_compute(model, budget_s=args.time_budget)
    machine = machine_from(args)
    trace_on = ([2] + [1] * (len(dims) - 1), measured_network("default"))
    rows = []
    for ranks in args.ranks:
        if args.grid and len(args.ranks) == 1:
            rows.append(predict(events, model["shape"], shape, args.grid, dims, compute, machine,
                                trace_on))
        else:
            rows.append(best_grid(events, model["shape"], shape, dims, ranks, compute, machine,
                                  trace_on))
    from .timereport import breakdown_table
    print(f"machine {machine.name}: latency {machine.network.latency_s * 1e6:.1f} us, bandwidth "
          f"{machine.network.bandwidth_Bps / 1e9:.2f} GB/s, compute rate x{machine.rate:g}")
    print(breakdown_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine.as_dict(), "compute_points": points,
            "compute_fit": list(compute.coef), "rows": rows}, indent=1))
    return 0
