"""`domainpar bench points`: neighbour search and a point-model step on N ranks
against one process, and the imbalance of clustered data.

The clouds: ``points`` reference and as many query points in the unit cube,
float64, uniform and clustered (``cluster`` of them in a ball of radius 0.02).
Per cloud:

- imbalance (max / mean points per rank) of three layouts: blocks of equal
  count in input order (what ``dp.scatter`` gives: balanced, but every rank's
  points spread over the whole cube), equal-volume slabs along x (a naive
  spatial split: compact but unbalanced on clustered data), and
  ``dp.points.partition`` (recursive coordinate bisection: compact and balanced);
- ``knn`` (k neighbours) and ``radius_search`` (radius for about k neighbours in
  the uniform cloud, at most 2k) on the partitioned points, N ranks against one
  process running the same code on a one-rank grid, interleaved step by step in
  one job (``timing.time_on_rank0``: the other ranks sleep meanwhile); the halo
  (points received per rank) beside it;
- a model step: a PointNet++-style set abstraction (ball query, neighbour
  features by ``x[idx]``, a shared MLP, max over neighbours and over centers),
  forward and backward, the same way; and the peak of live tensors during it
  per rank against one process (torch's allocator, from the profiler).

The local search is brute force over a rank's own and halo points, in blocks of
queries: its cost grows as (points per rank) x (candidates), so splitting the
points over N ranks cuts it by about N squared; figures for large clouds would
need a spatial index inside each rank, which is not there yet. On a shared
machine the times are rough: the JSON and the caption carry the load average.
"""
from __future__ import annotations

import os
import platform
import time

import torch
from mpi4py import MPI

from ..progress import Progress
from .output import write_json
from .timing import live_tensor_peak_kib, median, time_on_rank0


def _cloud(n: int, kind: str, cluster: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=g, dtype=torch.float64)
    if kind == "clustered":
        m = int(cluster * n)
        x[:m] = (0.3 + 0.02 * torch.randn(m, 3, generator=g, dtype=torch.float64)).clamp(0, 1)
    return x


class SetAbstraction(torch.nn.Module):
    """PointNet++'s set abstraction: ball query, grouped relative coordinates
    and features, a shared MLP, max over the group; then max over the centers."""

    def __init__(self, features: int, width: int, radius: float, group: int):
        super().__init__()
        self.radius, self.group = radius, group
        self.mlp = torch.nn.Sequential(torch.nn.Linear(features + 3, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, width))

    def forward(self, pos, feat, centers):
        """Collective (the ball query searches across ranks). Features of the
        ``centers``' neighbourhoods in ``pos``, max-pooled."""
        import domainpar as dp
        idx, _ = dp.points.radius_search(centers, pos, self.radius, self.group)
        idx = torch.where(idx < 0, idx[:, :1], idx)
        grouped = torch.cat([pos[idx] - centers[:, None, :], feat[idx]], dim=-1)
        return self.mlp(grouped).amax(dim=1).amax(dim=0)


def _imbalance(sizes) -> float:
    mean = sum(sizes) / len(sizes)
    return max(sizes) / mean if mean else 1.0


def _layouts(pts: torch.Tensor, part, size: int) -> dict:
    """max/mean points per rank: input-order blocks, equal-volume x slabs, RCB."""
    from ..comm.decomposition import balanced_sizes
    slab = torch.clamp((pts[:, 0] * size).long(), 0, size - 1)
    return {"input_order_blocks": _imbalance(balanced_sizes(len(pts), size)),
            "equal_volume_slabs": _imbalance(torch.bincount(slab, minlength=size).tolist()),
            "rcb_partition": _imbalance(part.sizes)}


def _ranks_step(comm, fn) -> float:
    """Collective. One N-rank call of ``fn``: the slowest rank's wall time."""
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def _halo_points(comm, query, ref, k: int) -> int:
    """Collective. The most reference points one rank receives for knn."""
    from ..points import knn_halo_size
    return comm.allreduce(knn_halo_size(query, ref, k), op=MPI.MAX)


def _case(comm, grid, one, kind: str, n: int, k: int, cluster: float, repeats: int, bar) -> dict:
    """Collective. One cloud's figures."""
    import domainpar as dp
    size = comm.Get_size()
    pts, qs = _cloud(n, kind, cluster, 1), _cloud(n, kind, cluster, 2)
    feat = torch.randn(n, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    t0 = time.perf_counter()
    part = dp.points.partition(dp.scatter(pts, grid, shard={0: 0}))
    partition_s = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    ref, feat_p = part.points, part(dp.scatter(feat, grid, shard={0: 0}))
    query = part.assign(dp.scatter(qs, grid, shard={0: 0})).points  # the same regions
    # The one-process inputs, on rank 0; empty elsewhere, where the one-process
    # steps below are never called (time_on_rank0 and on_rank0 call them on rank 0).
    whole = [dp.scatter(t, one, shard={0: 0}) for t in (pts, qs, feat)] if one is not None else []
    radius = float((k / n * 3 / (4 * 3.14159)) ** (1 / 3))
    centers, centers1 = query[::16], (whole[1][::16] if whole else None)
    torch.manual_seed(0)
    model = SetAbstraction(8, 32, 2 * radius, k).double()
    steps = {
        "knn": (lambda: dp.points.knn(query, ref, k),
                lambda: dp.points.knn(whole[1], whole[0], k)),
        "radius_search": (lambda: dp.points.radius_search(query, ref, radius, 2 * k),
                          lambda: dp.points.radius_search(whole[1], whole[0], radius, 2 * k)),
        "model_step": (lambda: model(ref, feat_p, centers).sum().backward(),
                       lambda: model(whole[0], whole[2], centers1).sum().backward()),
    }
    out = {"points": n, "kind": kind, "k": k, "radius": radius, "partition_s": partition_s,
           "imbalance_max_over_mean": _layouts(pts, part, size), "points_per_rank": part.sizes,
           "knn_halo_points_max": _halo_points(comm, query, ref, k)}
    for name, (ranks_fn, one_fn) in steps.items():
        _ranks_step(comm, ranks_fn)  # warm-up
        time_on_rank0(comm, one_fn)
        many, single = [], []
        for _ in range(repeats):
            many.append(_ranks_step(comm, ranks_fn))
            single.append(time_on_rank0(comm, one_fn)["wall"])
            bar.update(cloud=kind, step=name)
        out[name] = {"ranks_s": median(many), "one_process_s": median(single),
                     "speedup": median(single) / median(many),
                     "samples_ranks_s": many, "samples_one_process_s": single}
    mem = comm.allgather(live_tensor_peak_kib(steps["model_step"][0]))
    from .timing import on_rank0
    mem_one = on_rank0(comm, lambda: live_tensor_peak_kib(steps["model_step"][1]))
    out["model_step"]["live_tensor_peak_mib"] = {"per_rank": [m / 1024 for m in mem],
                                                 "one_process": mem_one / 1024}
    out["model_step"]["memory_ratio"] = max(mem) / mem_one if mem_one else float("nan")
    return out


def run(points: int = 20_000, k: int = 16, cluster: float = 0.8, kinds=("uniform", "clustered"),
        repeats: int = 3, out: str = "bench-out/points.json", log=print) -> dict:
    """Collective. Every cloud kind: imbalance, search and model step on N ranks
    against one process; rank 0 prints a table and writes JSON and PNG."""
    from ..comm import ProcessGrid, init
    comm = init()
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    grid = ProcessGrid((size,))
    one = ProcessGrid((1,), comm=MPI.COMM_SELF) if rank == 0 else None
    say = log if rank == 0 else (lambda *a, **kw: None)
    say(f"domainpar bench points: {points} points (and as many queries), float64, k={k}, "
        f"{size} ranks against one process, {repeats} steps each, interleaved", flush=True)
    load = [os.getloadavg()]
    bar = Progress(len(kinds) * 3 * repeats, "bench points", comm=comm)
    cases = {kind: _case(comm, grid, one, kind, points, k, cluster, repeats, bar)
             for kind in kinds}
    bar.close()
    load.append(os.getloadavg())
    report = {"benchmark": "points", "ranks": size, "host": platform.node(),
              "cpus": os.cpu_count(), "loadavg_start_end": load, "torch": torch.__version__,
              "torch_threads_per_rank": 1, "cluster": cluster, "cases": cases}
    if rank == 0:
        _table(report, say)
        write_json(report, out, say)
    return report


def _table(report: dict, say) -> None:
    for kind, c in report["cases"].items():
        imb = c["imbalance_max_over_mean"]
        say(f"  {kind:<10} imbalance max/mean: input order {imb['input_order_blocks']:.2f}, "
            f"equal-volume slabs {imb['equal_volume_slabs']:.2f}, RCB {imb['rcb_partition']:.2f}"
            f"; knn halo <= {c['knn_halo_points_max']} points/rank")
        for name in ("knn", "radius_search", "model_step"):
            f = c[name]
            say(f"    {name:<14} {report['ranks']} ranks {f['ranks_s'] * 1e3:9.1f} ms   one "
                f"process {f['one_process_s'] * 1e3:9.1f} ms   speedup {f['speedup']:.2f}")
        say(f"    model step live-tensor peak per rank / one process: "
            f"{c['model_step']['memory_ratio']:.2f}")
    say(f"  load average {report['loadavg_start_end'][0][0]:.1f} -> "
        f"{report['loadavg_start_end'][1][0]:.1f} on {report['cpus']} CPUs: timings are rough")


def plot(report: dict, plt):
    """The PNG: speedups per step and cloud; imbalance per layout and cloud."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    kinds = list(report["cases"])
    steps = ("knn", "radius_search", "model_step")
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        c = report["cases"][kind]
        xs = [j + i * width for j in range(len(steps))]
        left.bar(xs, [c[s]["speedup"] for s in steps], width, label=kind)
        layouts = list(c["imbalance_max_over_mean"])
        right.bar([j + i * width for j in range(len(layouts))],
                  list(c["imbalance_max_over_mean"].values()), width, label=kind)
    n = report["ranks"]
    left.axhline(n, color="grey", linestyle=":", label=f"{n} (linear)")
    left.set_xticks([j + width * (len(kinds) - 1) / 2 for j in range(len(steps))], steps)
    left.set_ylabel(f"speedup, {n} ranks over one process")
    left.set_title("Neighbour search and a set-abstraction step")
    right.axhline(1, color="grey", linestyle=":")
    right.set_xticks([j + width * (len(kinds) - 1) / 2 for j in range(len(layouts))],
                     [name.replace("_", " ") for name in layouts])
    right.set_ylabel("max / mean points per rank")
    right.set_title("Imbalance")
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Point clouds: {report['cases'][kinds[0]]['points']} points, {n} ranks")
    return fig
