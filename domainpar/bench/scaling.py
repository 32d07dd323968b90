"""`domainpar bench scaling`: strong and weak scaling of a model's training
step or inference forward.

The models (``bench.step.model_factory``, the ones ``bench step`` times):
``unet3d`` (domainpar.testing.models.UNet3d, 4 levels, width 4, a field of
2 channels, N x C x D x H x W), ``vit2d`` and ``fno2d`` (one channel,
N x C x H x W), in ``DomainParallel``, float32, on a field sharded along dim 2
(D or H) over a 1-D grid of all ranks, one torch thread per rank. The step:

- training (default): forward, mean-squared-error loss against a target,
  backward and an SGD step;
- inference (``--inference``): one forward in eval mode under
  ``torch.no_grad``: no loss, no backward (the latency case for strong scaling).

- strong scaling: a fixed global field (default side 64 for unet3d, 256 for
  vit2d, 512 for fno2d; ``--side`` or ``--strong-shape``) on 1 .. N ranks; speedup
  ``T1 / Tn``, efficiency ``T1 / (n * Tn)``;
- weak scaling: a fixed block per rank (default half the strong field along
  dim 2, so that 2 ranks hold the strong field; the global extent along dim 2
  grows with the ranks); efficiency ``T1 / Tn``.

Each rank count runs in its own job (``python -m domainpar.bench.scaling
--worker``), which times both modes with ``measure`` (the function
examples/scaling.py calls too); one sample is the slowest rank's step,
between barriers. ``rounds`` > 1 runs the jobs that many times, alternating
rank counts (1, 2, 1, 2, ...), and pools their samples: the medians are of
interleaved runs, so a slow spell of a shared machine hits every rank count.
T1 is the 1-rank job's step (the same domainpar code on a 1-rank grid);
without a 1-rank job, the smallest rank count stands in for it. More ranks
than cores share cores: those points measure oversubscription, not scaling,
and the output says so.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

from .step import MODELS

SHARDED_DIM = 2
DEFAULT_SIDES = {"unet3d": 64, "vit2d": 256, "fno2d": 512, "resnet3d": 64}
CHANNELS = {"unet3d": 2, "vit2d": 1, "fno2d": 1, "resnet3d": 2}
SPATIAL_DIMS = {"unet3d": 3, "vit2d": 2, "fno2d": 2, "resnet3d": 3}
DEFAULT_STRONG_SHAPE = (1, 2, 64, 64, 64)
DEFAULT_WEAK_BLOCK = (1, 2, 32, 64, 64)
MODES = ("strong", "weak")


# -- the step, shared with examples/scaling.py ----------------------------------------------------
def weak_shape(block, ranks: int) -> tuple:
    """The global shape of ``ranks`` blocks of ``block`` side by side along the sharded dim."""
    shape = list(block)
    shape[SHARDED_DIM] *= ranks
    return tuple(shape)


def shapes(model: str, side: int | None = None, strong=None, weak=None) -> tuple:
    """Local. ``(strong field, weak block)`` of ``model``: the given ones, else a
    field of side ``side`` (default ``DEFAULT_SIDES``) and a block of half of it
    along dim 2. Raises ValueError for a shape of the wrong length."""
    s = side or DEFAULT_SIDES[model]
    field = (1, CHANNELS[model]) + (s,) * SPATIAL_DIMS[model]
    block = list(field)
    block[SHARDED_DIM] = max(1, s // 2)
    out = (tuple(strong or field), tuple(weak or block))
    for what, shape in zip(("--strong-shape", "--weak-block"), out):
        if len(shape) != len(field):
            names = "N C D H W" if len(field) == 5 else "N C H W"
            raise ValueError(f"{what} {' '.join(map(str, shape))}: {model} takes "
                             f"{len(field)} extents ({names})")
    return out


def model_step(grid, shape, model: str = "unet3d", width: int = 4, levels: int = 4,
               inference: bool = False):
    """Collective. One training step (or, with ``inference``, one no_grad forward)
    of ``model`` on a field of global ``shape`` sharded along dim 2 over ``grid``
    (a 1-D ProcessGrid): returns (step function, this rank's block shape). Every
    rank builds the same initial model; each generates only its own block of
    the input (and target)."""
    from .step import inference_step, model_factory, training_step
    build = inference_step if inference else training_step
    return build(grid, model_factory(model, shape, width, levels), shape)


def time_step(comm, shape, repeats: int, width: int = 4, levels: int = 4, warmup: int = 1,
              progress=None, model: str = "unet3d", inference: bool = False,
              contention: bool = False) -> dict:
    """Collective. The median step (the slowest rank's, between barriers) on
    ``shape`` sharded over all ranks of ``comm``, and its samples. With
    ``contention`` (and more than one rank), interleaved with it: every rank
    runs the same step on a block of its own size over a one-rank grid, all
    ranks at once, no message between them ("together"): the step each block
    takes while the other ranks load the machine's shared caches and memory."""
    from mpi4py import MPI

    from ..comm import ProcessGrid
    from .timing import interleaved, median
    step, local = model_step(ProcessGrid((comm.Get_size(),), comm=comm), shape, model, width,
                             levels, inference)
    paths = {"step": step}
    if contention and comm.Get_size() > 1:
        paths["together"] = model_step(ProcessGrid((1,), comm=MPI.COMM_SELF), local, model,
                                       width, levels, inference)[0]
    samples = interleaved(comm, paths, repeats, warmup=warmup, progress=progress)
    out = {"ranks": comm.Get_size(), "global_shape": list(shape), "local_shape": list(local),
           "median_step_s": median(samples["step"]), "samples_s": samples["step"]}
    if "together" in samples:
        out.update(together_step_s=median(samples["together"]),
                   together_samples_s=samples["together"])
    return out


def measure(comm, strong_shape=DEFAULT_STRONG_SHAPE, weak_block=DEFAULT_WEAK_BLOCK,
            repeats: int = 5, width: int = 4, levels: int = 4, modes=MODES,
            label: str = "", model: str = "unet3d", inference: bool = False,
            contention: bool = False) -> dict:
    """Collective. ``time_step`` in each mode at this communicator's rank count:
    strong, the fixed global ``strong_shape``; weak, ``weak_block`` per rank."""
    from ..progress import Progress
    out = {}
    for mode in modes:
        shape = (strong_shape if mode == "strong"
                 else weak_shape(weak_block, comm.Get_size()))
        bar = Progress(repeats, f"{label}{mode} scaling, {comm.Get_size()} rank(s), steps",
                       comm=comm)
        out[mode] = time_step(comm, shape, repeats, width, levels, progress=bar, model=model,
                              inference=inference, contention=contention)
        bar.close()
    return out


# -- the benchmark: one job per rank count ------------------------------------------------------
def default_rank_counts(nprocs: int) -> list[int]:
    """1, 2, 4, ... up to ``nprocs``, and ``nprocs`` itself."""
    counts, n = [], 1
    while n < nprocs:
        counts.append(n)
        n *= 2
    return counts + [nprocs]


def _efficiency(mode: str, n0: int, t0: float, n: int, t: float) -> float:
    """Local. Strong T0 n0 / (n Tn), weak T0 / Tn."""
    return n0 * t0 / (n * t) if mode == "strong" else t0 / t


def _efficiencies(points: dict, mode: str) -> None:
    """Add speedup and efficiency to each point, against the smallest rank count
    (1 when it was run): strong T0 n0 / (n Tn), weak T0 / Tn. With more than one
    round, also ``round_efficiencies``: each round's job against the base's job of
    that round (run just before it), so a reader sees how far a slow spell of the
    machine moves the figure."""
    base = points[min(points, key=int)]
    n0, t0 = base["ranks"], base["median_step_s"]
    base_rounds = base.get("job_medians_s") or []
    for p in points.values():
        n, t = p["ranks"], p["median_step_s"]
        p["speedup"] = t0 / t if mode == "strong" else n * t0 / (n0 * t)
        p["efficiency"] = _efficiency(mode, n0, t0, n, t)
        if "together_step_s" in p:  # domainpar's own share, the machine's contention aside
            p["efficiency_vs_together"] = p["together_step_s"] / t
        rounds = p.get("job_medians_s") or []
        if p is not base and len(rounds) == len(base_rounds) > 1:
            p["round_efficiencies"] = [_efficiency(mode, n0, b, n, r)
                                       for b, r in zip(base_rounds, rounds)]


def _figures(jobs_by_count: dict, modes) -> dict:
    """One configuration's points per mode, with efficiencies (and ceilings)."""
    out = {}
    for mode in modes:
        points = {str(n): job[mode] for n, job in jobs_by_count.items()}
        _efficiencies(points, mode)
        out[mode] = {"points": points}
    _ceilings(out)
    return out


def _ceilings(figures: dict) -> None:
    """Add to each strong point whose block the 1-rank weak job also ran (n = 2 by
    default) the efficiency it would have if each rank took what one process takes
    on that block alone: ``ceiling`` = T1(field) / (n T1(block)), below 1 where a
    block costs more than its share of the field; and ``efficiency_vs_ceiling``."""
    if "strong" not in figures or "weak" not in figures:
        return
    lone = {tuple(p["local_shape"]): p["median_step_s"]
            for p in figures["weak"]["points"].values() if p["ranks"] == 1}
    points = figures["strong"]["points"]
    base = points[min(points, key=int)]
    if base["ranks"] != 1:
        return
    for p in points.values():
        block = lone.get(tuple(p["local_shape"]))
        if p["ranks"] > 1 and block:
            p["ceiling"] = base["median_step_s"] / (p["ranks"] * block)
            p["efficiency_vs_ceiling"] = p["efficiency"] / p["ceiling"]


def _pool(jobs: list, modes) -> dict:
    """One rank count's figures from its jobs (one per round): every sample, the
    median of them all, and each job's own median."""
    from .timing import median
    out = {}
    for mode in modes:
        samples = [t for job in jobs for t in job[mode]["samples_s"]]
        out[mode] = {**jobs[0][mode], "samples_s": samples, "median_step_s": median(samples),
                     "job_medians_s": [job[mode]["median_step_s"] for job in jobs]}
        if "together_samples_s" in jobs[0][mode]:
            together = [t for job in jobs for t in job[mode]["together_samples_s"]]
            out[mode].update(together_samples_s=together, together_step_s=median(together))
    return out


def _header(model, width, levels, inference, modes, counts, repeats, rounds, over) -> str:
    from .step import describe_model
    cpus = os.cpu_count() or 1
    what = "inference forward (eval, no_grad)" if inference else "training step"
    return (f"domainpar bench scaling: {describe_model(model, width, levels)} {what}, "
            f"{', '.join(modes)} scaling on {', '.join(map(str, counts))} ranks, one job each"
            f"{f' per round, {rounds} rounds alternating' if rounds > 1 else ''}, median of "
            f"{repeats * rounds} steps; this machine has {cpus} cores"
            + (f": {', '.join(map(str, over))} ranks oversubscribe them" if over else ""))


def run(nprocs: int | None = None, ranks=None, strong_shape=None, weak_block=None,
        repeats: int = 5, width: int = 4, levels: int = 4, modes=MODES,
        out: str = "bench-out/scaling.json", log=print, compare=None, model: str = "unet3d",
        side: int | None = None, inference: bool = False, rounds: int = 1,
        contention: bool = False) -> dict:
    """Launch one job per rank count (and configuration, alternating A and B;
    ``rounds`` times, alternating rank counts), print a table, write JSON and
    PNG to ``out``. Shapes: ``shapes(model, side, strong_shape, weak_block)``."""
    from ..launch import mpiexec_env
    from ..progress import Progress
    from .jobs import launch
    from .output import write_json
    from .settings import configurations, describe
    from .step import describe_model
    strong_shape, weak_block = shapes(model, side, strong_shape, weak_block)
    cpus = os.cpu_count() or 1
    counts = sorted(set(ranks or default_rank_counts(nprocs or cpus)))
    configs = {"A": None, **({"B": compare} if compare else {})}
    over = [n for n in counts if n > cpus]
    log(_header(model, width, levels, inference, modes, counts, repeats, rounds, over),
        flush=True)
    if compare:
        log(f"compared, jobs alternating: {describe(compare, mpiexec_env())}", flush=True)
    worker = ["--worker", "--model", model, "--strong-shape", *map(str, strong_shape),
              "--weak-block", *map(str, weak_block), "--repeats", str(repeats),
              "--width", str(width), "--levels", str(levels), "--modes", *modes,
              *(["--inference"] if inference else []),
              *(["--contention"] if contention else [])]
    jobs: dict[str, dict[int, list]] = {name: {n: [] for n in counts} for name in configs}
    load = [os.getloadavg()]  # a shared machine's other load slows collectives most
    bar = Progress(rounds * len(counts) * len(configs), "bench scaling jobs")
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for n in counts:
                for name, values in configs.items():
                    jobs[name][n].append(launch("domainpar.bench.scaling", n,
                                                worker + ["--label", f"  {name} "],
                                                Path(tmp) / "result.json", values))
                    bar.update(job=f"{n} ranks ({name})")
    bar.close()
    load.append(os.getloadavg())
    results = {name: {n: _pool(js, modes) for n, js in by_n.items()}
               for name, by_n in jobs.items()}
    report: dict[str, Any] = {
        "benchmark": "scaling", "model": model,
        "model_config": describe_model(model, width, levels),
        "mode": "inference" if inference else "training",
        "step": ("one forward in eval mode under torch.no_grad" if inference
                 else "forward, MSE loss, backward, SGD step"),
        "rank_counts": counts, "ranks": max(counts), "rounds": rounds,
        "machine": {"host": platform.node(), "cores": cpus,
                    "loadavg_start": list(load[0]), "loadavg_end": list(load[1])},
        "host": platform.node(), "cpus": cpus, "oversubscribed_rank_counts": over,
        "loadavg_start_end": load, "sharded_dim": SHARDED_DIM,
        "torch_threads_per_rank": 1, "repeats": repeats, "contention": contention,
        "configurations": configurations(compare, mpiexec_env()),
        **_figures(results["A"], modes)}
    for mode, shape in (("strong", strong_shape), ("weak", weak_block)):
        if mode in report:
            report[mode]["global_shape" if mode == "strong" else "block_shape"] = list(shape)
    if compare:
        report["B"] = _figures(results["B"], modes)
        report["ratio_B_over_A"] = {
            mode: {n: report["B"][mode]["points"][n]["median_step_s"] / p["median_step_s"]
                   for n, p in report[mode]["points"].items()} for mode in modes}
    _print(report, modes, log)
    write_json(report, out, log)
    return report


def _print(report: dict, modes, log) -> None:
    from .settings import parts, ratio_line
    configs = parts(report)
    together = report.get("contention")
    log(f"\n{'':>2} {'mode':<6} {'ranks':>5} {'block per rank':>18} {'median step s':>13} "
        f"{'min-max s':>13} {'speedup':>8} {'efficiency':>10}"
        + (f" {'together s':>10} {'eff. vs together':>16}" if together else ""))
    for mode in modes:
        for n in report[mode]["points"]:
            for name, part in configs:
                p = part[mode]["points"][n]
                note = "  (oversubscribed)" if int(n) > report["cpus"] else ""
                log(f"{name if len(configs) > 1 else '':>2} {mode:<6} {n:>5} "
                    f"{'x'.join(map(str, p['local_shape'])):>18} {p['median_step_s']:13.3f} "
                    f"{min(p['samples_s']):6.3f}-{max(p['samples_s']):6.3f} "
                    f"{p['speedup']:8.2f} {p['efficiency']:10.2f}"
                    + (_together_columns(p) if together else "") + note)
    for name, part in configs:
        for n, p in part.get("strong", {}).get("points", {}).items():
            if "ceiling" in p:
                log(f"{name + ' ' if len(configs) > 1 else ''}strong, {n} ranks: ceiling "
                    f"{p['ceiling']:.2f} (1 rank on the field / {n} x 1 rank on one block), "
                    f"efficiency against it {p['efficiency_vs_ceiling']:.2f}")
    for name, part in configs:
        for mode in modes:
            for n, p in part[mode]["points"].items():
                if "round_efficiencies" in p:
                    log(_rounds_line(name if len(configs) > 1 else "", mode, n, p))
    if "ratio_B_over_A" in report:
        for mode in modes:
            log(ratio_line(f"{mode} step (per rank count)", report["ratio_B_over_A"][mode]))
    if together:
        log("together: every rank runs the step on a block of its size over a one-rank grid, "
            "all at once, no messages (the machine's shared caches and memory loaded as in "
            "the sharded run); eff. vs together = together / sharded step: domainpar's own "
            "share of the loss.")
    machine = report["machine"]
    log(f"{report['model_config']}, {report['mode']} ({report['step']}). Speedup: strong "
        f"T1 / Tn, weak n T1 / Tn; efficiency: strong T1 / (n Tn), weak T1 / Tn (T1: "
        f"{min(report['rank_counts'])} rank(s)); {machine['cores']} cores on "
        f"{machine['host']}, load average {machine['loadavg_start'][0]:.1f} at the start, "
        f"{machine['loadavg_end'][0]:.1f} at the end.")


def _rounds_line(name: str, mode: str, n: str, point: dict) -> str:
    from .timing import median
    e = point["round_efficiencies"]
    return (f"{name + ' ' if name else ''}{mode}, {n} ranks: efficiency round by round "
            f"{min(e):.2f}-{max(e):.2f}, median {median(e):.2f} ({len(e)} rounds; each "
            f"round's job against the fewest ranks' job of that round)")


def _together_columns(point: dict) -> str:
    if "together_step_s" not in point:
        return f" {'-':>10} {'-':>16}"
    return f" {point['together_step_s']:10.3f} {point['efficiency_vs_together']:16.2f}"


# -- worker entry point ---------------------------------------------------------------------------
def _worker_main(argv=None) -> int:
    from . import jobs, settings
    parser = argparse.ArgumentParser(description="internal: a job of `domainpar bench scaling`")
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--inference", action="store_true")
    parser.add_argument("--contention", action="store_true")
    parser.add_argument("--strong-shape", type=int, nargs="+", required=True)
    parser.add_argument("--weak-block", type=int, nargs="+", required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--levels", type=int, required=True)
    parser.add_argument("--modes", nargs="+", choices=MODES, required=True)
    parser.add_argument("--label", default="")
    parser.add_argument("--result", required=True)
    settings.add_argument(parser)
    args = parser.parse_args(argv)
    from ..comm import init
    comm = init()
    return jobs.run_worker(args, lambda: measure(
        comm, args.strong_shape, args.weak_block, args.repeats, args.width, args.levels,
        args.modes, label=args.label, model=args.model, inference=args.inference,
        contention=args.contention))


if __name__ == "__main__":
    sys.exit(_worker_main())
