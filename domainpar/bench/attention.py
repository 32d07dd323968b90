"""`domainpar bench attention`: ring attention on N ranks against one process.

The case: F.scaled_dot_product_attention on q, k, v of shape (1, heads, T,
head_dim), float32, T from 16k to 64k tokens, sharded along the sequence over
a 1-D grid of all ranks, one torch thread per rank. A step is forward and
``.sum().backward()`` (q, k and v gradients). The one-process step is torch's
own fused CPU kernel on the whole tensors. Measured, per sequence length:

- step time on N ranks and in one process, interleaved step by step in one
  N-rank job (``timing.time_on_rank0`` says why that is fair); the speedup is
  the ratio of the medians. CPU time too (the busiest rank's), which a
  shared machine's other load disturbs less than wall time;
- communication left exposed by the ring: the time each rank spends waiting
  for k/v blocks (forward) and k/v plus their gradients (backward) that have
  not arrived when the computation on the previous block is done; beside it
  the same transfers with no computation to hide behind (``transfer_s``), so
  exposed / transfer is the share the overlap did not hide;
- peak memory of live tensors during the step (torch's allocator, from the
  profiler): per rank against one process. Both stay O(T) (no T x T scores);
  the ring's per-rank share is O(T / N).
- explicit attention, as MONAI's SABlock writes it (einsum scores, softmax,
  einsum with v: ``ops/einsum.py`` gathers k and then v, so a rank holds
  ceil(T/N) x T scores), at sequence lengths up to ``EXPLICIT_MAX_TOKENS`` (one
  process needs T x T scores): the peak of live tensors during forward and
  backward per rank and in one process, each also as a multiple of its own
  scores block (ceil(T/N) x T x heads, T x T x heads), which stays about the
  same when the per-rank memory is O(T/N x T).

Runs under the MPI launcher (``-n`` relaunches itself under mpiexec); rank 0
prints a table and writes JSON.
"""
from __future__ import annotations

import functools
import os
import platform
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI

from ..progress import Progress
from .output import write_json
from .settings import applied, configurations, describe, ratio_line
from .timing import live_tensor_peak_kib, median, on_rank0, time_on_rank0

DEFAULT_TOKENS = (16384, 32768, 65536)
EXPLICIT_MAX_TOKENS = 4096  # one process's T x T float32 scores: 64 MiB per head


def _inputs(tokens: int, heads: int, head_dim: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((1, heads, tokens, head_dim), generator=g, dtype=dtype)
            for _ in range(3)]


def _step(q, k, v, *, causal: bool):
    """Forward and backward; the leaves' gradients are dropped afterwards."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()


def _explicit_step(q, k, v):
    """MONAI SABlock's attention, forward and backward (its einsum spelling)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    att = torch.einsum("blxd,blyd->blxy", q, k) * q.shape[-1] ** -0.5
    torch.einsum("bhxy,bhyd->bhxd", att.softmax(dim=-1), v).sum().backward()


def _explicit_memory(tokens: int, heads: int, head_dim: int, grid) -> dict:
    """Collective. Peak live-tensor memory of explicit attention on token-sharded
    q, k, v per rank and in one process (rank 0), and as multiples of the scores
    block each holds."""
    comm = grid.comm
    whole = _inputs(tokens, heads, head_dim, torch.float32, seed=1)
    blocks = _sharded(whole, grid)
    per_rank = comm.allgather(live_tensor_peak_kib(lambda: _explicit_step(*blocks)))
    one = on_rank0(comm, lambda: live_tensor_peak_kib(lambda: _explicit_step(*whole)))
    rows = max(blocks[0].decomposition.block_sizes(2))
    block_kib, whole_kib = heads * rows * tokens * 4 / 1024, heads * tokens * tokens * 4 / 1024
    return {"tokens": tokens, "local_tokens": list(blocks[0].decomposition.block_sizes(2)),
            "live_tensor_peak_mib": {"per_rank": max(per_rank) / 1024, "one_process": one / 1024},
            "scores_block_mib": {"per_rank": block_kib / 1024, "one_process": whole_kib / 1024},
            "peak_over_scores_block": {"per_rank": max(per_rank) / block_kib,
                                       "one_process": one / whole_kib},
            "memory_ratio": max(per_rank) / one if one else float("nan")}


def _sharded(tensors, grid):
    from ..testing import shard_like
    return [shard_like(t, grid, {2: 0}) for t in tensors]


def _ring_step(blocks, causal: bool) -> dict:
    """Collective. One N-rank step: the slowest rank's wall and CPU time (CPU time
    is what other load on a shared machine disturbs least); each rank's wait."""
    from ..ops.ring import RING_WAIT
    comm = blocks[0].grid.comm
    comm.Barrier()
    RING_WAIT.reset()
    t0, c0 = time.perf_counter(), time.thread_time()
    _step(*blocks, causal=causal)
    mine = (time.perf_counter() - t0, time.thread_time() - c0, RING_WAIT.seconds)
    per_rank = comm.allgather(mine)
    return {"wall": max(r[0] for r in per_rank), "cpu": max(r[1] for r in per_rank),
            "wait": [r[2] for r in per_rank]}


def _transfer_time(blocks, repeats: int) -> float:
    """Collective. The ring's messages alone, with nothing to overlap: N - 1
    shifts of k and v (forward), then N shifts of k, v and two gradient
    accumulators of their sizes (backward)."""
    from .. import autograd as ag
    from ..tensor import layout
    comm = layout.comm_of(blocks[1].decomposition, (2,))
    n = comm.Get_size()
    kv = [blocks[1].to_local().detach(), blocks[2].to_local().detach()]
    samples = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(n - 1):
            kv = [ag.ring_shift(t, comm) for t in kv]
        with_grads = kv + [t.clone() for t in kv]
        for _ in range(n):
            with_grads = [ag.ring_shift(t, comm) for t in with_grads]
        samples.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return median(samples)


def _figures(ring, single, transfer, mem_ring, mem_one) -> dict:
    """One configuration's figures for one sequence length from its samples."""
    wall, wall1 = median([r["wall"] for r in ring]), median([s["wall"] for s in single])
    cpu, cpu1 = median([r["cpu"] for r in ring]), median([s["cpu"] for s in single])
    exposed = median([max(r["wait"]) for r in ring])
    return {
        "median_step_s": {"ranks": wall, "one_process": wall1}, "speedup": wall1 / wall,
        "median_cpu_s": {"ranks": cpu, "one_process": cpu1}, "cpu_speedup": cpu1 / cpu,
        "ring_wait_exposed_s": exposed, "transfer_s": transfer,
        "exposed_fraction_of_step": exposed / wall,
        "exposed_fraction_of_transfer": exposed / transfer if transfer else float("nan"),
        "live_tensor_peak_mib": {"per_rank": max(mem_ring) / 1024, "one_process": mem_one / 1024},
        "memory_ratio": max(mem_ring) / mem_one if mem_one else float("nan"),
        "samples": {"ranks": ring, "one_process": single},
    }


def run(tokens=DEFAULT_TOKENS, heads: int = 1, head_dim: int = 32, causal: bool = False,
        repeats: int = 3, out: str = "bench-out/attention.json", log=print,
        compare=None, explicit_tokens=None) -> dict:
    """Collective. Every sequence length, N ranks against one process; with
    ``compare``, each step again under configuration B's settings, alternating.
    Explicit attention's memory at ``explicit_tokens`` (default: the lengths
    capped at ``EXPLICIT_MAX_TOKENS``)."""
    from ..comm import ProcessGrid, init
    comm = init()
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    grid = ProcessGrid((size,))
    say = log if rank == 0 else (lambda *a, **k: None)
    say(f"domainpar bench attention: SDPA forward+backward, (1, {heads}, T, {head_dim}) float32, "
        f"{'causal' if causal else 'not causal'}, {size} ranks against one process, "
        f"{repeats} steps each, interleaved", flush=True)
    configs = {"A": None}
    if compare:
        configs["B"] = compare
        say(f"compared, interleaved step by step: {describe(compare)}", flush=True)
    load = [os.getloadavg()]
    results = {}
    bar = Progress(len(tokens) * repeats, "bench attention", comm=comm)
    for t in tokens:
        whole = _inputs(t, heads, head_dim, torch.float32)
        blocks = _sharded(whole, grid)
        # This size's steps, bound now (the closures outlive nothing: each is
        # called within this iteration).
        one_step = functools.partial(_step, *whole, causal=causal)
        ring_step = functools.partial(_step, *blocks, causal=causal)
        for settings in configs.values():
            with applied(settings):  # warm-up: plans, buffers, first-call costs
                _ring_step(blocks, causal)
                time_on_rank0(comm, one_step)
        ring: dict[str, list[dict]] = {name: [] for name in configs}
        single: dict[str, list[dict]] = {name: [] for name in configs}
        for _ in range(repeats):
            for name, settings in configs.items():
                with applied(settings):
                    ring[name].append(_ring_step(blocks, causal))
                    single[name].append(time_on_rank0(comm, one_step))
            bar.update(T=t, ranks=f"{ring['A'][-1]['wall']:.2f} s",
                       one_process=f"{single['A'][-1]['wall']:.2f} s")
        figures = {}
        for name, settings in configs.items():
            with applied(settings):
                transfer = _transfer_time(blocks, repeats)
                mem_ring = comm.allgather(live_tensor_peak_kib(ring_step))
                mem_one = on_rank0(comm, functools.partial(live_tensor_peak_kib, one_step))
            figures[name] = _figures(ring[name], single[name], transfer, mem_ring, mem_one)
        results[str(t)] = {"tokens": t,
                           "local_tokens": list(blocks[0].decomposition.block_sizes(2)),
                           **figures["A"]}
        if compare:
            results[str(t)]["B"] = figures["B"]
            results[str(t)]["ratio_B_over_A"] = _ratios(figures["B"], figures["A"])
    bar.close()
    if explicit_tokens is None:
        explicit_tokens = sorted({min(t, EXPLICIT_MAX_TOKENS) for t in tokens})
    explicit = {str(t): _explicit_memory(t, heads, head_dim, grid) for t in explicit_tokens}
    load.append(os.getloadavg())
    report = {"benchmark": "attention", "ranks": size, "host": platform.node(),
              "cpus": os.cpu_count(), "loadavg_start_end": load, "torch": torch.__version__,
              "torch_threads_per_rank": 1, "heads": heads, "head_dim": head_dim,
              "causal": causal, "dtype": "float32", "configurations": configurations(compare),
              "cases": results, "explicit": explicit}
    if rank == 0:
        _print(report, log)
        write_json(report, out, log)
    return report


def _ratios(b: dict, a: dict) -> dict:
    """B over A of the step medians (N ranks, one process) and the memory peaks."""
    return {"step_ranks": b["median_step_s"]["ranks"] / a["median_step_s"]["ranks"],
            "step_one_process": (b["median_step_s"]["one_process"]
                                 / a["median_step_s"]["one_process"]),
            "speedup": b["speedup"] / a["speedup"],
            "live_tensor_peak_per_rank": (b["live_tensor_peak_mib"]["per_rank"]
                                          / a["live_tensor_peak_mib"]["per_rank"])}


def _print(report: dict, log) -> None:
    n = report["ranks"]
    compared = "B" in report["configurations"]
    log(f"\n{'':>2} {'tokens':>7} {'1 proc s':>9} {f'{n} ranks s':>10} {'speedup':>8} "
        f"{'cpu speedup':>11} {'exposed ms':>11} {'transfer ms':>12} {'live MiB 1 proc':>16} "
        f"{'per rank':>9} {'ratio':>6}")
    for case in report["cases"].values():
        for name in ("A", "B") if compared else ("A",):
            c = case if name == "A" else case["B"]
            m, mem = c["median_step_s"], c["live_tensor_peak_mib"]
            log(f"{name if compared else '':>2} {case['tokens']:>7} {m['one_process']:9.2f} "
                f"{m['ranks']:10.2f} {c['speedup']:8.2f} {c['cpu_speedup']:11.2f} "
                f"{c['ring_wait_exposed_s'] * 1e3:11.1f} {c['transfer_s'] * 1e3:12.1f} "
                f"{mem['one_process']:16.1f} {mem['per_rank']:9.1f} {c['memory_ratio']:6.2f}")
    if compared:
        log(ratio_line(f"step on {n} ranks", {f"T={c['tokens']}": c["ratio_B_over_A"]["step_ranks"]
                                                for c in report["cases"].values()}))
    log(f"\nExplicit attention (einsum, softmax, einsum), live MiB: {'tokens':>7} "
        f"{'1 proc':>9} {'per rank':>9} {'ratio':>6}   peak / scores block: 1 proc, per rank")
    for e in report.get("explicit", {}).values():
        m, b = e["live_tensor_peak_mib"], e["peak_over_scores_block"]
        log(f"{'':>55} {e['tokens']:>7} {m['one_process']:9.1f} {m['per_rank']:9.1f} "
            f"{e['memory_ratio']:6.2f}   {b['one_process']:.2f}, {b['per_rank']:.2f}")
    log(f"Load average {report['loadavg_start_end'][0][0]:.1f} at the start, "
        f"{report['cpus']} CPUs.")
