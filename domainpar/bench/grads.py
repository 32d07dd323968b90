"""`domainpar bench grads`: one training step with DomainParallel's deferred,
bucketed gradient reductions (nonblocking and overlapped with backward, and
blocking per bucket) against per-op reductions (each op's backward allreducing
its parameters' gradients itself).

The model: ``layers`` blocks of ``Linear(width, width) + tanh`` applied over
the channel (last) dim of a (1, side, side, width) field sharded along dim 1
over all ranks; about ``layers * width**2`` parameters (20 x 700**2 = 9.8M by
default). One sample is forward, a global mean-square loss, backward and an
SGD step, timed per variant round-robin in one run (``timing.interleaved``).
Also counted per step: allreduce calls made for parameter gradients.
"""
from __future__ import annotations

import copy
import os
import platform

import torch
from mpi4py import MPI

from ..comm import ProcessGrid
from ..progress import Progress
from .output import write_json
from .settings import applied, configurations, context_for, describe, parts, ratio_line
from .timing import interleaved, median, ratios, split_configurations


def _model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks)


def _variants(base, grid, x) -> dict:
    """Local. One step function per variant, each on its own copy of ``base``."""
    import domainpar as dp
    models = {"per_op": copy.deepcopy(base),
              "domain_parallel": dp.DomainParallel(copy.deepcopy(base), grid),
              "domain_parallel_blocking": dp.DomainParallel(copy.deepcopy(base), grid,
                                                            overlap=False)}

    def step(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def go():
            opt.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
        return go
    return {name: step(model) for name, model in models.items()}


def _figures(samples: dict, counts: dict) -> dict:
    """One configuration's medians, samples, allreduce counts and ratios."""
    med = {k: median(v) for k, v in samples.items()}
    return {"median_step_s": med, "samples_s": samples,
            "gradient_allreduces_per_step": counts,
            "ratio_over_per_op": {k: v / med["per_op"] for k, v in med.items()}}


def run(layers: int = 20, width: int = 700, side: int = 16, repeats: int = 7,
        out: str = "bench-out/grads.json", compare=None) -> dict:
    """Collective. Time every variant (and under ``compare``'s settings too,
    interleaved, when given) and write JSON and PNG (rank 0 prints a table)."""
    from domainpar.testing import shard_like
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    grid = ProcessGrid((size,))
    base = _model(layers, width)
    n_params = sum(p.numel() for p in base.parameters())
    x = shard_like(torch.randn(1, side, side, width, generator=torch.Generator().manual_seed(1)),
                   grid, {1: 0})
    steps = _variants(base, grid, x)
    if compare:
        with applied(compare):
            steps.update({f"B:{k}": go for k, go in _variants(base, grid, x).items()})
    if rank == 0:
        print(f"domainpar bench grads: {layers} layers x Linear({width}, {width}) = "
              f"{n_params / 1e6:.1f}M parameters, field (1, {side}, {side}, {width}) on "
              f"{size} rank(s), {repeats} steps per variant, interleaved", flush=True)
        if compare:
            print(f"compared, interleaved: {describe(compare)}", flush=True)
    load = [os.getloadavg()]
    bar = Progress(repeats, "bench grads", comm=comm)
    samples = interleaved(comm, steps, repeats, warmup=1, context=context_for(compare),
                          progress=bar)
    bar.close()
    counts = {}
    for k, go in steps.items():
        with context_for(compare)(k):
            counts[k] = _count_allreduces(go)
    samples, samples_b = split_configurations(samples)
    counts, counts_b = split_configurations(counts)
    result = {
        "benchmark": "grads", "ranks": size, "layers": layers, "width": width, "side": side,
        "parameters": n_params, "repeats": repeats, "host": platform.node(),
        "cpus": os.cpu_count(), "loadavg_start_end": load + [os.getloadavg()],
        "torch_threads": torch.get_num_threads(),
        "configurations": configurations(compare), **_figures(samples, counts),
    }
    if compare:
        assert samples_b is not None and counts_b is not None  # measured when comparing
        result["B"] = _figures(samples_b, counts_b)
        result["ratio_B_over_A"] = ratios(result["B"]["median_step_s"], result["median_step_s"])
    if rank == 0:
        for name, part in parts(result):
            for k, v in part["median_step_s"].items():
                print(f"  {name if compare else ''} {k:<25} median step {v * 1e3:8.1f} ms   "
                      f"x per-op {part['ratio_over_per_op'][k]:.3f}   "
                      f"allreduces per step: {part['gradient_allreduces_per_step'][k]}")
        if compare:
            print("  " + ratio_line("step", result["ratio_B_over_A"]))
        write_json(result, out)
    return result


def _count_allreduces(go) -> int:
    """Calls of domainpar's allreduce and iallreduce during one step, on this rank
    (the loss's own allreduce included, in both variants)."""
    import domainpar.comm.collectives as col
    calls = [0]
    real_allreduce, real_iallreduce = col.allreduce, col.iallreduce

    def counted(fn):
        def wrapper(*a, **k):
            calls[0] += 1
            return fn(*a, **k)
        return wrapper
    col.allreduce, col.iallreduce = counted(real_allreduce), counted(real_iallreduce)
    try:
        MPI.COMM_WORLD.Barrier()
        go()
    finally:
        col.allreduce, col.iallreduce = real_allreduce, real_iallreduce
    return calls[0]
