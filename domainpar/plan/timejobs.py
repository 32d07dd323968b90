"""The time model's MPI jobs, run as ``python -m domainpar.plan.timejobs JOB``
under mpiexec (``domainpar model`` starts them), each writing JSON on rank 0:

- ``trace``: one training step of each model on a grid of the world's ranks
  along the first shardable dim, after a warm-up step, with ``comms.record``
  on: every halo exchange and collective with its layout and counted bytes,
  and last an ``attention`` event (``timeattn.counting``: the step's attention
  kernels' work, the most of any rank, and their time at the least seconds
  per unit of work of any rank);
- ``steps``: measured step times of each model (forward, backward, SGD step),
  the models interleaved round-robin so that a shared machine's slow spells
  hit all alike; per sample the slowest rank's time;
- ``network``: point-to-point latency and bandwidth (mpi4py Sendrecv between
  ranks 0 and 1 of 8 B and 4 MiB messages, as ``bench halo``'s raw baseline),
  and the time of one of domainpar's own small allreduces.

A model is ``{"name", "entry", "kwargs", "shape", "dims"}`` (JSON).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _build(spec: dict, grid):
    """The model wrapped in DomainParallel, its input on ``grid`` and an optimizer."""
    import torch

    import domainpar as dp

    from .measure import load_factory
    torch.manual_seed(0)
    model = dp.DomainParallel(load_factory(spec["entry"], spec["kwargs"])(), grid)
    shard = {d: 0 if i == 0 else i for i, d in enumerate(spec["dims"])}
    x = dp.scatter(torch.randn(spec["shape"]), grid, shard=shard)
    return model, x, torch.optim.SGD(model.parameters(), lr=1e-3)


def _step(model, x, opt) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    opt.step()


def _grid(spec: dict, comm):
    """The world's ranks along the first shardable dim, 1 along the others."""
    import domainpar as dp
    return dp.ProcessGrid((comm.Get_size(),) + (1,) * (len(spec["dims"]) - 1), comm=comm)


def trace(specs: list[dict], comm, steps: int = 5) -> dict:
    """Collective. Each model's recorded communication of one step (rank 0's),
    each call's time the least of ``steps`` recorded steps' (waiting for a
    late peer only ever adds)."""
    from mpi4py import MPI

    from .comms import record
    from .timeattn import counting
    out = {}
    for spec in specs:
        grid = _grid(spec, comm)
        model, x, opt = _build(spec, grid)
        _step(model, x, opt)
        runs = []
        for _ in range(steps):
            with record() as events:
                _step(model, x, opt)
            with counting() as tally:  # apart: the dispatch mode slows every op
                _step(model, x, opt)
            # The most work of any rank (causal attention's last), at the least
            # seconds per unit of work of any rank (a slowed kernel only adds).
            rate = tally.seconds / tally.work if tally.work else float("inf")
            tally.work = comm.allreduce(tally.work, op=MPI.MAX)
            rate = comm.allreduce(rate, op=MPI.MIN)
            tally.seconds = tally.work * rate if tally.work else 0.0
            runs.append(events + [tally.event(comm.Get_size())])
        for i, e in enumerate(runs[0]):
            e.seconds = float(min(r[i].seconds for r in runs))
        out[spec["name"]] = {"grid": list(grid.dims), "events": [e.as_dict() for e in runs[0]]}
    return out


def steps(specs: list[dict], comm, repeats: int) -> dict:
    """Collective. Each model's step times (slowest rank's), interleaved."""
    from ..bench.timing import interleaved
    paths = {}
    for spec in specs:
        model, x, opt = _build(spec, _grid(spec, comm))
        paths[spec["name"]] = (lambda m=model, t=x, o=opt: _step(m, t, o))
    return interleaved(comm, paths, repeats, warmup=1)


def network(comm, repeats: int = 30) -> dict:
    """Collective (2 ranks or more; ranks past 1 only join the barriers)."""
    from ..comm import collectives
    rank = comm.Get_rank()
    result = {}
    for name, nbytes in (("small", 8), ("large", 4 << 20)):
        buf, got = np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        times = []
        for _ in range(repeats + 2):
            comm.Barrier()
            t0 = time.perf_counter()
            if rank < 2:
                comm.Sendrecv(buf, dest=1 - rank, recvbuf=got, source=1 - rank)
            times.append(time.perf_counter() - t0)
        result[name] = float(np.median(times[2:]))
    small = np.zeros(1)
    times = []
    for _ in range(repeats + 2):
        comm.Barrier()
        t0 = time.perf_counter()
        collectives.allreduce(small, comm, check=False)
        times.append(time.perf_counter() - t0)
    latency = result["small"]
    bandwidth = (4 << 20) / max(result["large"] - latency, 1e-9)
    return {"latency_s": latency, "bandwidth_Bps": bandwidth,
            "allreduce_small_s": float(np.median(times[2:])), "ranks": comm.Get_size()}


def main(argv=None) -> int:
    """``python -m domainpar.plan.timejobs {trace,steps,network} --models JSON --out FILE``."""
    parser = argparse.ArgumentParser(prog="python -m domainpar.plan.timejobs",
                                     description=main.__doc__)
    parser.add_argument("job", choices=["trace", "steps", "network"])
    parser.add_argument("--models", default="[]")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from ..comm import init
    comm = init()
    specs = json.loads(args.models)
    if args.job == "trace":
        result = trace(specs, comm)
    elif args.job == "steps":
        result = steps(specs, comm, args.repeats)
    else:
        result = network(comm)
    if comm.Get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
