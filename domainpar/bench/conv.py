"""`domainpar bench conv`: convolutions on N ranks against one process.

The cases: Conv3d(4, 4, 3, padding=1) on 1x4x128^3 and Conv2d(8, 8, 3,
padding=1) on 1x8x1024^2, float32, sharded along dim 2 over a 1-D grid of all
ranks, one torch thread per rank; a step is forward and ``.mean().backward()``
(input, weight and bias gradients). Measured:

- step time on N ranks and in one process, interleaved step by step in one
  N-rank job (see ``timing.time_on_rank0`` for why that is fair); the speedup is
  the ratio of the medians. CPU time too (the busiest rank's), which a shared
  machine's other load disturbs less than wall time;
- halo time left exposed: time inside ``HaloExchange.fill``/``accumulate``
  during the N-rank step (they block: none of it is overlapped), timed and
  labelled for the profiler through the public hook ``comm.clock.observing``;
  the number of exchanges per step is reported beside it (conv fills its padded
  block in place, so there is no separate copy to time);
- where the time goes: one step of each under torch.profiler, self CPU time
  summed by kind (conv forward, conv backward, halo, copies, other);
- the overlap probe: on one rank, its step on its halo'd block as one conv
  against the same conv split into the interior that needs no ghost cells and
  the two boundary slabs that do (the split an overlapped exchange needs),
  beside the exchange time that overlap could hide;
- per-rank peak memory above the import baseline, each in a fresh process
  (``_memory_worker``), N ranks against one process, alternating launches: the
  conv steps and a training step (forward, loss, backward, SGD with momentum,
  DomainParallel on N ranks) of a small 3-D UNet-like net, ``small_unet``;
  ``--unet MODULE:CALLABLE`` swaps in another model. Each under glibc's
  own malloc (``DOMAINPAR_MALLOC=0``) and with a fixed mmap threshold
  (``ALLOCATORS``).

Targets (issue 4): speedup >= 1.9 for the 3-D conv; the UNet step's per-rank
peak above the import baseline <= 0.55 of one process's.

The command runs outside any MPI launcher and launches its own jobs: one
N-rank timing job, then the memory jobs. Their rank 0 writes a JSON result
that this process collects (``python -m domainpar.bench.conv --worker ...``).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..progress import Progress
from . import jobs, settings
from .convreport import TARGET_MEMORY, TARGET_SPEEDUP, figures, print_report, ratios
from .memory import reset_peak, status_kib, trim
from .output import write_json
from .settings import configurations, describe
from .timing import live_tensor_peak_kib, on_rank0, quiet_stderr, time_on_rank0

CASES = {  # name -> (module factory, global input shape)
    "conv3d": (lambda: torch.nn.Conv3d(4, 4, 3, padding=1), (1, 4, 128, 128, 128)),
    "conv2d": (lambda: torch.nn.Conv2d(8, 8, 3, padding=1), (1, 8, 1024, 1024)),
}
SHARDED_DIM = 2
DEFAULT_UNET = "domainpar.bench.conv:small_unet"
DEFAULT_UNET_SHAPE = (1, 2, 64, 64, 64)


class SmallUNet(torch.nn.Module):
    """A stand-in for the 3-D UNet: conv+GELU blocks at two levels, a strided
    conv down, a transposed conv up and a skip connection by cat."""

    def __init__(self, channels: int = 2, width: int = 8):
        super().__init__()
        nn = torch.nn
        self.enc = nn.Sequential(nn.Conv3d(channels, width, 3, padding=1), nn.GELU(),
                                 nn.Conv3d(width, width, 3, padding=1), nn.GELU())
        self.down = nn.Conv3d(width, 2 * width, 3, stride=2, padding=1)
        self.mid = nn.Sequential(nn.GELU(), nn.Conv3d(2 * width, 2 * width, 3, padding=1),
                                 nn.GELU())
        self.up = nn.ConvTranspose3d(2 * width, width, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv3d(2 * width, width, 3, padding=1), nn.GELU(),
                                 nn.Conv3d(width, channels, 1))

    def forward(self, x):
        """Local. Encoder block, one down-up level, and the skip joined back in."""
        skip = self.enc(x)
        return self.dec(torch.cat([self.up(self.mid(self.down(skip))), skip], 1))


def small_unet(channels: int) -> torch.nn.Module:
    """The default ``--unet``: called with the input's channel count."""
    return SmallUNet(channels)


def _resolve(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


# -- problems: one step on N ranks or in one process ------------------------------------------
def _problem(factory, shape, grid, train: bool):
    """Build a model and input (on ``grid``: this rank's block only; None: the
    whole tensor, plain torch); returns (a function running one step, model)."""
    import domainpar as dp

    from ..comm import Decomposition
    torch.manual_seed(0)
    model = factory()
    rank = 0 if grid is None else grid.rank
    gen = torch.Generator().manual_seed(1 + rank)
    if grid is None:
        local = x = torch.randn(shape, generator=gen)
    else:
        dec = Decomposition(shape, grid, {SHARDED_DIM: 0})
        local = torch.randn(dec.local_shape(), generator=gen)
        x = dp.DomainTensor(local, dec)
    if train:
        if grid is not None:
            model = dp.DomainParallel(model, grid)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def train_step():
            opt.zero_grad(set_to_none=True)
            (model(x) - x).pow(2).mean().backward()
            opt.step()
        return train_step, model
    local.requires_grad_(True)

    def step():
        local.grad = None
        model.zero_grad(set_to_none=True)
        model(x).mean().backward()
    return step, model


def _spec(what: str, unet: str, unet_shape, scale: float):
    """(factory, shape, train) for a case name or "unet"."""
    if what == "unet":
        shape = tuple(unet_shape)
        return (lambda: _resolve(unet)(shape[1])), _scaled(shape, scale), True
    factory, shape = CASES[what]
    return factory, _scaled(shape, scale), False


def _scaled(shape, scale: float):
    return tuple(shape[:2]) + tuple(max(4, int(round(s * scale))) for s in shape[2:])


# -- timing -------------------------------------------------------------------------------------
_HALO = {"exchange": 0.0}
_EXCHANGE_CALLS: list[float] = []  # this step's exchange durations, in call order
_EXCHANGE_NAMES = ("HaloExchange.fill", "HaloExchange.accumulate")


@contextlib.contextmanager
def _observe(name: str):
    """An observer for ``comm.clock.observing``: time every halo exchange (fill
    and accumulate) and label it for the profiler. Two clock reads per call."""
    if name not in _EXCHANGE_NAMES:
        yield
        return
    with torch.profiler.record_function("domainpar::halo_exchange"):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - t0
            _HALO["exchange"] += took
            _EXCHANGE_CALLS.append(took)


def _time_ranks(comm, step) -> dict:
    """Collective. One N-rank step: the slowest rank's wall and CPU time, each
    rank's time inside halo exchanges, and an estimate of the exchanges' own
    cost: per exchange, the time of the rank that took least (the last to
    arrive, which did not wait for a neighbour), summed over the exchanges."""
    comm.Barrier()
    _HALO.update(exchange=0.0)
    _EXCHANGE_CALLS.clear()
    t0, c0 = time.perf_counter(), time.thread_time()
    step()
    mine = (time.perf_counter() - t0, time.thread_time() - c0, _HALO["exchange"],
            list(_EXCHANGE_CALLS))
    per_rank = comm.allgather(mine)
    return {"wall": max(r[0] for r in per_rank), "cpu": max(r[1] for r in per_rank),
            "halo_exchange": [r[2] for r in per_rank],
            "halo_exchanges": [len(r[3]) for r in per_rank],
            "halo_exchange_cost": sum(map(min, zip(*(r[3] for r in per_rank))))}


def _settle_exchanges() -> None:
    """Collective. Run every cached exchange through its tuning calls (a plan
    times two ways on its first calls), so timed steps see settled plans."""
    import numpy as np

    from ..ops import window
    for halo in window.cached_exchanges():
        halo.settle(np.zeros(halo.padded_shape, np.float32))


_KINDS = (("conv backward", ("convolution_backward",)),
          ("conv forward", ("convolution", "conv2d", "conv3d")),
          ("halo exchange", ("domainpar::halo",)),
          ("copies and padding", ("copy_", "clone", "pad", "fill_", "zero_", "narrow", "cat")))


def _profile(comm, step, collective: bool) -> dict:
    """Collective. Self CPU time (ms) by kind and the top ops of one profiled
    step: of all ranks' step (rank 0's profile) or of rank 0's alone."""
    from torch.profiler import ProfilerActivity, profile

    def run():
        prof = profile(activities=[ProfilerActivity.CPU])
        with quiet_stderr():  # kineto prints a line at start and stop
            prof.start()
        try:
            if collective:
                comm.Barrier()  # every rank profiling before the step starts
            step()
        finally:
            with quiet_stderr():
                prof.stop()
        return _summary(prof.key_averages())
    if not collective:
        return on_rank0(comm, run)
    summary = run()
    return comm.bcast(summary if comm.Get_rank() == 0 else None, root=0)


def _summary(averages) -> dict:
    kinds = {name: 0.0 for name, _ in _KINDS}
    kinds["other"] = 0.0
    top = []
    for ev in averages:
        ms = ev.self_cpu_time_total / 1e3
        kind = next((name for name, keys in _KINDS if any(k in ev.key for k in keys)), "other")
        kinds[kind] += ms
        top.append({"op": ev.key, "self_ms": ms, "calls": ev.count})
    top.sort(key=lambda e: -e["self_ms"])
    return {"self_ms_by_kind": kinds, "top_ops": top[:12]}


def _split_probe(conv, local_shape, repeats: int) -> dict:
    """On one rank: its step on its halo'd block (ghosts one cell deep, as the
    conv rule gathers them) as one conv, against the interior (outputs that read
    no ghost cell) and the two boundary slabs along the sharded dim computed
    separately and joined, forward only and forward + backward."""
    nsp = len(local_shape) - 2
    conv_fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nsp]
    b = local_shape[SHARDED_DIM]
    cells = torch.randn([local_shape[0], local_shape[1]] + [s + 2 for s in local_shape[2:]],
                        requires_grad=True)
    w, bias = conv.weight.detach().requires_grad_(), conv.bias.detach().requires_grad_()

    def whole():
        return conv_fn(cells, w, bias)

    def split():
        inner = conv_fn(cells.narrow(SHARDED_DIM, 1, b), w, bias)  # outputs 1 .. b-2
        lo = conv_fn(cells.narrow(SHARDED_DIM, 0, 3), w, bias)     # output 0
        hi = conv_fn(cells.narrow(SHARDED_DIM, b - 1, 3), w, bias)  # output b-1
        return torch.cat([lo, inner, hi], SHARDED_DIM)

    with torch.no_grad():
        torch.testing.assert_close(split(), whole())  # the split computes the same

    def timed(fn, backward):
        for t in (cells, w, bias):
            t.grad = None
        t0 = time.perf_counter()
        if backward:
            fn().mean().backward()
        else:
            with torch.no_grad():
                fn()
        return time.perf_counter() - t0

    samples: dict[str, list[float]] = {
        k: [] for k in ("whole_forward", "split_forward", "whole_step", "split_step")}
    for _ in range(repeats):
        for backward, suffix in ((False, "forward"), (True, "step")):
            samples[f"whole_{suffix}"].append(timed(whole, backward))
            samples[f"split_{suffix}"].append(timed(split, backward))
    return {"median_s": {k: statistics.median(v) for k, v in samples.items()},
            "samples_s": samples}


def _time_worker(args) -> dict:
    """Collective. The N-rank timing job."""
    from ..comm import ProcessGrid, clock, init
    comm = init()
    grid = ProcessGrid((comm.Get_size(),))
    with clock.observing(_observe):
        return _time_cases(args, comm, grid)


def _time_cases(args, comm, grid) -> dict:
    """Collective. Each case's timing, profile and split probe."""
    rank = comm.Get_rank()
    # what the job is doing goes to stderr beside the progress bars; stdout is the table's
    say = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if rank == 0 else (
        lambda *a, **k: None)
    report = {}
    for name in args.cases:
        factory, shape, _ = _spec(name, DEFAULT_UNET, DEFAULT_UNET_SHAPE, args.scale)
        ranks_step, conv = _problem(factory, shape, grid, train=False)
        single = _problem(factory, shape, None, train=False)[0] if rank == 0 else None
        say(f"{name} {shape}: warming up", flush=True)
        ranks_step()
        _settle_exchanges()
        ranks_step()
        time_on_rank0(comm, single)
        samples: dict[str, list[dict]] = {"ranks": [], "one_process": []}
        bar = Progress(args.repeats, f"  {name} steps", comm=comm)
        for i in range(args.repeats):
            # alternate which goes first, so neither always follows the other
            order = ("ranks", "one_process") if i % 2 == 0 else ("one_process", "ranks")
            for path in order:
                samples[path].append(_time_ranks(comm, ranks_step) if path == "ranks"
                                     else time_on_rank0(comm, single))
            bar.update(ranks=f"{samples['ranks'][-1]['wall']:.3f} s",
                       one_process=f"{samples['one_process'][-1]['wall']:.3f} s")
        bar.close()
        say(f"{name}: profiling one step of each, then the interior/boundary split", flush=True)
        profiles = {"ranks": _profile(comm, ranks_step, collective=True),
                    "one_process": _profile(comm, single, collective=False)}
        from ..comm import Decomposition
        local_shape = Decomposition(shape, grid, {SHARDED_DIM: 0}).local_shape()
        probe = on_rank0(comm, functools.partial(_split_probe, conv, local_shape, args.probe_repeats))
        report[name] = {"shape": list(shape), "local_shape": list(local_shape),
                        "samples": samples, "profile": profiles, "split_probe": probe}
    return report


# -- memory -------------------------------------------------------------------------------------
def _memory_worker(args) -> dict:
    """Collective. Peak RSS of one step above the import baseline, in this fresh
    process: 1 rank runs plain torch on the whole input, N ranks domainpar.

    The baseline is the RSS after the imports, MPI's start and the same step on
    a tiny input (libraries and kernels that load on first use count as import
    cost, not as the step's). Then the kernel's high-water mark is reset, the
    full-size model and input are built and the step runs (twice for a training
    step: the second has the optimizer's state); the high-water mark minus the
    baseline is the step's peak.
    """
    import resource

    import domainpar as dp  # noqa: F401  (loads the op rules before the baseline)

    from ..comm import ProcessGrid, init
    comm = init()
    size = comm.Get_size()
    grid = None if size == 1 else ProcessGrid((size,))
    after_import = status_kib("VmRSS")
    factory, shape, train = _spec(args.what, args.unet, args.unet_shape, args.scale)
    # 16 cells per dim: a 4-level UNet still has 2 per dim (BatchNorm needs 2 values) at the bottom
    tiny = tuple(shape[:2]) + (16 * size,) + (16,) * (len(shape) - 3)
    _problem(factory, tiny, grid, train)[0]()
    trim()
    baseline = status_kib("VmRSS")
    exact = reset_peak()
    before_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if baseline is None:  # no /proc/self/status: the high-water mark so far stands in
        baseline = before_max
    step, _ = _problem(factory, shape, grid, train)
    for _ in range(2 if train else 1):
        step()
    peak = status_kib("VmHWM") if exact else None
    exact = peak is not None
    if peak is None:  # ru_maxrss (KiB on Linux) only rises: a lower bound when it was higher before
        peak = max(baseline, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        peak = peak if peak > before_max else baseline
    mine = {"after_import_kib": after_import, "baseline_kib": baseline, "peak_kib": peak,
            "peak_above_baseline_kib": peak - baseline,
            "method": "VmHWM after clear_refs" if exact else "ru_maxrss",
            "live_tensor_peak_kib": live_tensor_peak_kib(step)}
    return {"what": args.what, "ranks": size, "shape": list(shape),
            "per_rank": comm.allgather(mine)}


# -- the launcher -------------------------------------------------------------------------------
# The allocators the memory jobs run under. glibc's own malloc raises its mmap
# threshold after the first large free, and from then on serves big tensors from
# its heap, which keeps freed memory resident: RSS then depends on the order of
# allocations as much as on what is alive (domainpar's own 2 GiB thresholds,
# comm.runtime.malloc_thresholds, keep all of it: DOMAINPAR_MALLOC=0 asks for
# glibc's). A fixed threshold gives every tensor over 128 KiB its own mapping,
# returned on free, so RSS follows live memory.
ALLOCATORS = {"default_malloc": {"DOMAINPAR_MALLOC": "0"},
              "fixed_mmap_threshold": {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}}


def _launch(nprocs: int, worker_args: list[str], result: Path, config=None,
            env: dict | None = None) -> dict:
    """A job of this module: configuration ``config``'s settings (None: A's)."""
    return jobs.launch("domainpar.bench.conv", nprocs, worker_args, result, config, env)


def run(nprocs: int = 2, cases=("conv3d", "conv2d"), repeats: int = 7, memory_repeats: int = 2,
        probe_repeats: int = 5, unet: str = DEFAULT_UNET, unet_shape=DEFAULT_UNET_SHAPE,
        scale: float = 1.0, out: str = "bench-out/conv.json", log=print, compare=None) -> dict:
    """Launch the timing and memory jobs, print a summary, write JSON and PNG to
    ``out``. With ``compare``, each job again under configuration B's settings,
    A's and B's jobs alternating."""
    from ..launch import mpiexec_env
    if nprocs < 2:
        raise SystemExit("domainpar bench conv compares N >= 2 ranks with one process: use -n 2 "
                         "or more")
    configs = {"A": None, **({"B": compare} if compare else {})}
    common = ["--scale", str(scale), "--unet", unet, "--unet-shape", *map(str, unet_shape)]
    whats = [*cases, "unet"]
    memory_jobs = memory_repeats * len(whats) * len(ALLOCATORS) * 2 * len(configs)
    load = [os.getloadavg()]
    timing: dict = {}
    # configuration -> allocator -> step -> rank count -> the jobs' results
    memory_runs: dict[str, dict[str, dict[str, dict[str, list]]]] = {
        name: {a: {w: {"1": [], str(nprocs): []} for w in whats} for a in ALLOCATORS}
        for name in configs}
    log(f"domainpar bench conv: {', '.join(cases)} on {nprocs} ranks against one process, "
        f"{repeats} steps each, interleaved (one {nprocs}-rank job"
        f"{' per configuration' if compare else ''}); peak memory: {len(whats)} steps x "
        f"(1 process, {nprocs} ranks) x {len(ALLOCATORS)} allocator settings x "
        f"{memory_repeats}{' x 2 configurations' if compare else ''}, each in a fresh job",
        flush=True)
    if compare:
        log(f"compared, jobs alternating: {describe(compare, mpiexec_env())}", flush=True)
    bar = Progress(len(configs) + memory_jobs, "bench conv jobs")
    with tempfile.TemporaryDirectory() as tmp:
        for name, values in configs.items():
            timing[name] = _launch(nprocs, ["--worker", "time", "--cases", *cases, "--repeats",
                                            str(repeats), "--probe-repeats", str(probe_repeats),
                                            *common], Path(tmp) / "time.json", values)
            bar.update(job=f"timing ({name})")
        for i in range(memory_repeats):
            for what in whats:
                for alloc, env in ALLOCATORS.items():
                    for n in (1, nprocs):
                        for name, values in configs.items():
                            res = _launch(n, ["--worker", "memory", "--what", what, *common],
                                          Path(tmp) / "memory.json", values, env)
                            memory_runs[name][alloc][what][str(n)].append(res)
                            bar.update(job=f"memory {i + 1}/{memory_repeats} {what}, {alloc}, "
                                           f"{n} rank(s) ({name})")
    bar.close()
    load.append(os.getloadavg())
    report = {"benchmark": "conv", "ranks": nprocs, "host": platform.node(),
              "cpus": os.cpu_count(), "loadavg_start_end": load, "torch": torch.__version__,
              "torch_threads_per_rank": 1, "sharded_dim": SHARDED_DIM, "scale": scale,
              "targets": {"speedup_conv3d": TARGET_SPEEDUP, "unet_memory_ratio": TARGET_MEMORY},
              "configurations": configurations(compare, mpiexec_env()),
              **figures(timing["A"], memory_runs["A"], nprocs, scale)}
    if compare:
        report["B"] = figures(timing["B"], memory_runs["B"], nprocs, scale)
        report["ratio_B_over_A"] = ratios(report["B"], report)
    print_report(report, log)
    write_json(report, out, log)
    return report


# -- worker entry point -------------------------------------------------------------------------
def _worker_main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="internal: a job of `domainpar bench conv`")
    parser.add_argument("--worker", choices=("time", "memory"), required=True)
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    parser.add_argument("--what")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--probe-repeats", type=int, default=5)
    parser.add_argument("--unet", default=DEFAULT_UNET)
    parser.add_argument("--unet-shape", type=int, nargs="+", default=list(DEFAULT_UNET_SHAPE))
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--result", required=True)
    settings.add_argument(parser)
    args = parser.parse_args(argv)
    return jobs.run_worker(
        args, lambda: _time_worker(args) if args.worker == "time" else _memory_worker(args))


if __name__ == "__main__":
    sys.exit(_worker_main())
