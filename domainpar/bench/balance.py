"""`domainpar bench balance`: dynamic load balancing with one rank slowed.

The slowdown is a documented per-cell delay spread over the step like a
slower device's time (``_slowdown``): on the slowed rank, each layer's forward
runs ``passes`` more times on its block and the backward through it
``2 * passes`` more forwards (plain torch, no gradients, no communication), so
every stretch of compute between two communications takes about ``1 +
passes`` times as long, and that rank would set every other rank's pace
through the halo exchanges and the gradient allreduce.

Two cases, each timed in one run:

- ``grid``: ``layers`` x (Conv2d(C, C, 3, padding=1) + tanh) on a (1, C, side,
  side) float32 field sharded along H over all ranks, DomainParallel, MSE loss,
  SGD. A ``dp.Balancer`` starts from even blocks and measures ``settle`` steps,
  moving the blocks when it predicts a saving over 5%.
- ``points``: a clustered point set (``cluster`` of the points in a small ball,
  the rest uniform in the unit cube) partitioned by ``dp.points.partition``
  (recursive bisection, equal counts), C features per point through a pointwise
  MLP; when the Balancer moves, the points are partitioned again with
  ``capacity=balancer.shares()``.

Then the starting layout ("even") and the balancer's ("balanced") are timed
alternately, step by step (``timing.interleaved``: one sample is the slowest
rank's step). Each rank's compute in a step is its wall time less its time
blocked in domainpar's communication (``comm.clock``); its throughput is its
cells over its compute. The ideal step is the total cells over the sum of the
ranks' throughputs (each pooled over both layouts' steps); the target is a balanced
step within 15% of it. Also reported: the slowest rank's compute over the ideal
(what balancing controls, communication left out), and each layout's compute
imbalance (max / mean over ranks), in wall and in CPU time; the ideal plus
the step's communication (the blocked time of the balanced layout's
least-waiting rank); and the Balancer's own cost (``balancer.step()``, moves).
"""
from __future__ import annotations

import copy
import functools
import os
import platform
import time
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ..comm import ProcessGrid, clock
from ..progress import Progress
from .output import write_json
from .timing import interleaved, median

TARGET = 1.15  # balanced step / ideal step


def _slowdown(model: torch.nn.Module, passes: int, slowed: bool) -> None:
    """Local. The per-cell delay, spread over the step the way a slower device's
    time is: on the slowed rank, each leaf module's forward runs ``passes``
    more times on this rank's block of its input, and the backward through its
    output ``2 * passes`` more (a backward costs about two forwards), on a plain
    copy of the module (no gradients, no communication). Every stretch of
    compute between two communications, forward and backward, then takes about
    ``1 + passes`` times as long: 1 pass about doubles the slowed rank's compute."""
    if not slowed or not passes:
        return
    plain = copy.deepcopy(model)  # DomainParallel's hooks stay on the trained one
    for module, twin in zip(model.modules(), plain.modules()):
        if next(module.children(), None) is None:
            module.register_forward_hook(functools.partial(_extra_work, twin, passes))


def _extra_work(twin: torch.nn.Module, passes: int, module, inputs, output) -> None:
    """Local. A forward hook: ``passes`` plain forwards of ``twin`` on the block of
    ``inputs[0]`` now, and ``2 * passes`` when backward reaches ``output``."""
    first = inputs[0]
    block = (first.to_local() if hasattr(first, "to_local") else first).detach()

    def run(times: int) -> None:
        with torch.no_grad():
            for _ in range(times):
                twin(block)
    run(passes)
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(lambda grad: run(2 * passes))


def _trainer(model, grid):
    """Local. One training step on (x, y): forward, MSE, backward, SGD."""
    import domainpar as dp
    wrapped = dp.DomainParallel(model, grid)
    opt = torch.optim.SGD(wrapped.parameters(), lr=1e-4)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = ((wrapped(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    return step


def _timed(step, log: list):
    """Local. ``step`` recording its compute and blocked seconds, wall and CPU, per call."""
    def go():
        t0, b0 = time.perf_counter(), clock.blocked_seconds()
        c0, k0 = time.process_time(), clock.blocked_seconds(cpu=True)
        step()
        wall, blocked = time.perf_counter() - t0, clock.blocked_seconds() - b0
        cpu, blocked_cpu = time.process_time() - c0, clock.blocked_seconds(cpu=True) - k0
        log.append((wall - blocked, blocked, cpu - blocked_cpu))
    return go


def _imbalance(values) -> float:
    """Local. max / mean: 1 is perfect balance."""
    return float(max(values) / np.mean(values)) if np.mean(values) > 0 else float("nan")


def _compare(comm, steps: dict, cells: dict, repeats: int, label: str) -> dict:
    """Collective. Time the layouts' steps interleaved; per-rank compute,
    throughputs and the ideal step from the balanced steps."""
    logs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in steps}
    bar = Progress(repeats, f"bench balance {label}", comm=comm)
    samples = interleaved(comm, {k: _timed(go, logs[k]) for k, go in steps.items()},
                          repeats, warmup=1, progress=bar)
    bar.close()
    out: dict[str, Any] = {"median_step_s": {k: median(v) for k, v in samples.items()},
                           "samples_s": samples}
    per_rank: dict[str, dict[str, Any]] = {}
    for name, log in logs.items():
        compute, blocked, cpu = np.median(np.array(log[1:]), axis=0)  # warm-up dropped
        rows = comm.allgather((cells[name], float(compute), float(blocked), float(cpu)))
        per_rank[name] = {"cells": [r[0] for r in rows], "compute_s": [r[1] for r in rows],
                          "blocked_s": [r[2] for r in rows], "compute_cpu_s": [r[3] for r in rows],
                          "throughput_cells_per_s": [r[0] / r[1] if r[1] > 0 else None
                                                     for r in rows],
                          "compute_imbalance": _imbalance([r[1] for r in rows]),
                          "compute_cpu_imbalance": _imbalance([r[3] for r in rows])}
    out["per_rank"] = per_rank
    ideal = _ideal(per_rank)
    med = out["median_step_s"]
    out.update(ideal_step_s=ideal, speedup=med["even"] / med["balanced"],
               balanced_over_ideal=med["balanced"] / ideal if ideal else None,
               even_over_ideal=med["even"] / ideal if ideal else None)
    for name in steps:  # the slowest rank's compute alone, communication left out
        worst = max(per_rank[name]["compute_s"])
        out[f"{name}_compute_over_ideal"] = worst / ideal if ideal else None
    # the step's communication: the blocked time of the rank that waits least
    comm_s = min(per_rank["balanced"]["blocked_s"])
    out.update(communication_s=comm_s, ideal_plus_communication_s=ideal + comm_s
               if ideal else None)
    return out


def _ideal(per_rank: dict) -> float | None:
    """Local. Total cells over the sum of the ranks' throughputs, each rank's pooled
    over both layouts' steps (its cells over its compute, summed)."""
    even, bal = per_rank["even"], per_rank["balanced"]
    rates = [(ce + cb) / (te + tb) for ce, cb, te, tb in
             zip(even["cells"], bal["cells"], even["compute_s"], bal["compute_s"]) if te + tb > 0]
    return sum(bal["cells"]) / sum(rates) if rates else None


def _settle(balancer, steps: int, step_on, relayout) -> dict:
    """Collective. ``steps`` measured steps with the Balancer, ``relayout()``
    after each move; the Balancer's own cost: the median wall time of
    ``balancer.step()`` on the rank where it is least, and each relayout's (the
    data's repartition)."""
    cost: dict[str, list[float]] = {"step_s": [], "move_s": []}
    for _ in range(steps):
        step_on()
        t0 = time.perf_counter()
        moved = balancer.step()
        cost["step_s"].append(time.perf_counter() - t0)
        if moved:
            t0 = time.perf_counter()
            relayout()
            cost["move_s"].append(time.perf_counter() - t0)
    # a faster rank also waits in step()'s allreduce: the rank that waits least pays its cost
    own = min(balancer.grid.comm.allgather(median(cost["step_s"])))
    return {"history": list(balancer.history), "fixed_s": balancer.fixed_seconds().tolist(),
            "median_step_s": own, "moves_s": cost["move_s"]}


def grid_case(comm, grid, *, side, channels, layers, passes, slow_rank, settle, repeats,
              clock_kind):
    """Collective. The conv stack on a field sharded along H: even against balanced."""
    import domainpar as dp

    from ..testing import shard_like
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in
                                  (torch.nn.Conv2d(channels, channels, 3, padding=1),
                                   torch.nn.Tanh())])
    _slowdown(model, passes, comm.Get_rank() == slow_rank)
    step = _trainer(model, grid)
    g = torch.Generator().manual_seed(1)
    x_full, y_full = (torch.randn(1, channels, side, side, generator=g) for _ in range(2))
    x, y = shard_like(x_full, grid, {2: 0}), shard_like(y_full, grid, {2: 0})
    balancer = dp.Balancer(x.decomposition, clock=clock_kind)
    now = {"data": (x, y)}

    def relayout():
        now["data"] = balancer.layout(x), balancer.layout(y)
    settled = _settle(balancer, settle, lambda: step(*now["data"]), relayout)
    bx, by = now["data"]
    cells = {"even": x.to_local().numel(), "balanced": bx.to_local().numel()}
    result = _compare(comm, {"even": lambda: step(x, y), "balanced": lambda: step(bx, by)},
                      cells, repeats, "grid")
    return {"shape": list(x.shape), "layers": layers, "sharded_dim": 2,
            "sizes": {"even": list(x.decomposition.block_sizes(2)),
                      "balanced": list(bx.decomposition.block_sizes(2))},
            "balancer": settled, **result}


def clustered_points(n: int, cluster: float, seed: int = 2) -> torch.Tensor:
    """Local. ``n`` points in the unit cube, a ``cluster`` fraction of them in a
    ball of radius 0.05 around (0.3, 0.3, 0.3) (float64, the same on every rank)."""
    rng = np.random.default_rng(seed)
    k = int(n * cluster)
    direction = rng.normal(size=(k, 3))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    ball = 0.3 + 0.05 * direction * rng.random((k, 1)) ** (1 / 3)
    return torch.from_numpy(np.concatenate([ball, rng.random((n - k, 3))]))


def points_case(comm, grid, *, points, cluster, channels, layers, passes, slow_rank, settle,
                repeats, clock_kind):
    """Collective. A pointwise MLP on a clustered point set: the bisection's equal
    counts against counts in proportion to the balancer's measured shares."""
    import domainpar as dp
    from domainpar import points as dpp

    from ..testing import shard_like
    torch.manual_seed(0)
    mlp: list[torch.nn.Module] = [torch.nn.Linear(channels, channels * 4)]
    for _ in range(layers - 1):
        mlp += [torch.nn.Tanh(), torch.nn.Linear(channels * 4, channels * 4)]
    model = torch.nn.Sequential(*mlp, torch.nn.Tanh(), torch.nn.Linear(channels * 4, 1))
    _slowdown(model, passes, comm.Get_rank() == slow_rank)
    step = _trainer(model, grid)
    g = torch.Generator().manual_seed(3)
    coords = shard_like(clustered_points(points, cluster), grid, {0: 0})
    feats = shard_like(torch.randn(points, channels, generator=g), grid, {0: 0})
    target = shard_like(torch.randn(points, 1, generator=g), grid, {0: 0})
    even = dpp.partition(coords)
    data = {"even": even(feats, target)}
    data["now"] = data["even"]
    balancer = dp.Balancer(data["even"][0].decomposition, clock=clock_kind)

    def relayout():
        part = dpp.partition(coords, capacity=balancer.shares())
        data["now"] = part(feats, target)
        balancer.adopt(data["now"][0].decomposition)
    settled = _settle(balancer, settle, lambda: step(*data["now"]), relayout)
    cells = {k: data[k][0].to_local().numel() for k in ("even", "now")}
    result = _compare(comm, {"even": lambda: step(*data["even"]),
                             "balanced": lambda: step(*data["now"])},
                      {"even": cells["even"], "balanced": cells["now"]}, repeats, "points")
    per_rank = np.array(even.sizes)
    return {"points": points, "cluster": cluster, "layers": layers,
            "imbalance_of_a_grid_cut": _grid_cut_imbalance(clustered_points(points, cluster),
                                                           comm.Get_size()),
            "counts": {"even": list(map(int, per_rank)),
                       "balanced": list(data["now"][0].decomposition.block_sizes(0))},
            "balancer": settled, **result}


def _grid_cut_imbalance(xyz: torch.Tensor, parts: int) -> float:
    """Local. max/mean points per rank if the cube were cut into equal slabs
    along x instead of by bisection: what clustering does to a block layout."""
    counts = np.bincount(np.minimum((xyz[:, 0].numpy() * parts).astype(int), parts - 1),
                         minlength=parts)
    return float(counts.max() / counts.mean())


def _points_available() -> str | None:
    """Local. Why the points case cannot run here, or None."""
    try:
        from domainpar import points  # noqa: F401
    except ImportError as exc:
        return f"dp.points is not available: {exc}"
    return None


def run(cases=("grid", "points"), side: int = 512, channels: int = 16, layers: int = 4,
        points: int = 400_000, cluster: float = 0.7, passes: int = 1,
        slow_rank: int | None = None, settle: int = 16, repeats: int = 7,
        clock_kind: str = "wall", out: str = "bench-out/balance.json") -> dict:
    """Collective. Each case: settle the balancer, then time the even and the
    balanced layouts interleaved; write JSON and PNG (rank 0 prints a table)."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    slow_rank = size - 1 if slow_rank is None else slow_rank % size
    grid = ProcessGrid((size,))
    load = [os.getloadavg()]
    common = dict(channels=channels, layers=layers, passes=passes, slow_rank=slow_rank,
                  settle=settle, repeats=repeats, clock_kind=clock_kind)
    if rank == 0:
        print(f"domainpar bench balance: {size} rank(s), rank {slow_rank} slowed by {passes} "
              f"extra forwards of each layer (twice in backward); {settle} balancer steps, then "
              f"{repeats} steps per layout, interleaved", flush=True)
    results, skipped = {}, {}
    for case in cases:
        why = _points_available() if case == "points" else None
        if why:
            skipped[case] = why
            continue
        if case == "grid":
            results[case] = grid_case(comm, grid, side=side, **common)
        else:
            results[case] = points_case(comm, grid, points=points, cluster=cluster, **common)
    report = {"benchmark": "balance", "ranks": size, "slow_rank": slow_rank, "passes": passes,
              "settle": settle, "repeats": repeats, "clock": clock_kind, "target_balanced_over_ideal": TARGET,
              "host": platform.node(), "cpus": os.cpu_count(),
              "loadavg_start_end": load + [os.getloadavg()],
              "torch_threads": torch.get_num_threads(), "cases": results, "skipped": skipped}
    if rank == 0:
        _print(report)
        write_json(report, out)
    return report


def _print(report: dict) -> None:
    """Local (rank 0). The table on stdout."""
    for name, case in report["cases"].items():
        med = case["median_step_s"]
        ratio = case["balanced_over_ideal"]
        sizes = case.get("sizes") or case.get("counts")
        print(f"  {name:<7} even {med['even'] * 1e3:8.1f} ms   balanced "
              f"{med['balanced'] * 1e3:8.1f} ms   speedup {case['speedup']:.2f}   ideal "
              f"{(case['ideal_step_s'] or 0) * 1e3:8.1f} ms   balanced/ideal "
              f"{ratio if ratio is None else round(ratio, 3)} (target <= {TARGET})   "
              f"blocks {sizes['even']} -> {sizes['balanced']}")
        plus, own = case["ideal_plus_communication_s"], case["balancer"]
        print(f"          ideal + the step's communication {(plus or 0) * 1e3:.1f} ms "
              f"(balanced / that {med['balanced'] / plus if plus else float('nan'):.3f}); "
              f"balancer.step() {own['median_step_s'] * 1e3:.2f} ms, "
              f"{len(own['moves_s'])} move(s) of {sum(own['moves_s']) * 1e3:.1f} ms in all")
        print(f"          slowest rank's compute / ideal: even "
              f"{case['even_compute_over_ideal']:.3f}, balanced "
              f"{case['balanced_compute_over_ideal']:.3f}")
        print(f"          compute max/mean over ranks: even "
              f"{case['per_rank']['even']['compute_imbalance']:.2f} (CPU "
              f"{case['per_rank']['even']['compute_cpu_imbalance']:.2f}), balanced "
              f"{case['per_rank']['balanced']['compute_imbalance']:.2f} (CPU "
              f"{case['per_rank']['balanced']['compute_cpu_imbalance']:.2f})")
    for name, why in report["skipped"].items():
        print(f"  {name:<7} skipped: {why}")
    print(f"  load average {report['loadavg_start_end'][0][0]:.2f} at the start, "
          f"{report['loadavg_start_end'][1][0]:.2f} at the end, {report['cpus']} CPUs")


def plot(report: dict, plt):
    """Local (rank 0). The PNG: per case, the even and balanced step (median and samples) beside
    the ideal; and each rank's compute and blocked time per layout."""
    cases = list(report["cases"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    left, right = axes
    for i, name in enumerate(cases):
        case = report["cases"][name]
        for j, layout in enumerate(("even", "balanced")):
            x = i * 3 + j
            left.bar(x, case["median_step_s"][layout] * 1e3, color=f"C{j}",
                     label=layout if i == 0 else None)
            left.scatter([x] * len(case["samples_s"][layout]),
                         [s * 1e3 for s in case["samples_s"][layout]], s=10, color="black")
        if case["ideal_step_s"]:
            left.hlines(case["ideal_step_s"] * 1e3, i * 3 - 0.4, i * 3 + 1.4, colors="red",
                        linestyles="--", label="ideal" if i == 0 else None)
        for j, layout in enumerate(("even", "balanced")):
            pr = case["per_rank"][layout]
            xs = [i * 3 + j + (r - (len(pr["compute_s"]) - 1) / 2) * 0.3
                  for r in range(len(pr["compute_s"]))]
            right.bar(xs, [c * 1e3 for c in pr["compute_s"]], 0.28, color=f"C{j}")
            right.bar(xs, [b * 1e3 for b in pr["blocked_s"]], 0.28,
                      bottom=[c * 1e3 for c in pr["compute_s"]], color="lightgray",
                      label="blocked in comm" if (i, j) == (0, 0) else None)
    ticks = [i * 3 + 0.5 for i in range(len(cases))]
    for ax, title in ((left, "Step time (slowest rank)"),
                      (right, "Per rank: compute (colour) + blocked (grey)")):
        ax.set_xticks(ticks)
        ax.set_xticklabels(cases)
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Load balancing on {report['ranks']} ranks, rank {report['slow_rank']} "
                 f"slowed ({report['passes']} extra forwards per layer)")
    return fig
