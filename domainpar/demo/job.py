"""`domainpar demo`: the five stages (solve, write, train, check, plots) in one
MPI job, with a header and a line per stage on rank 0."""
from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import domainpar as dp

from ..bench.timing import median
from ..plan.units import format_bytes
from . import budget as budget_module
from . import check, dataset, fit, grayscott, plots, surrogate

MIN_CROP = 9  # 9 -> 5 -> 3 -> 2 at the UNet's bottom: 8 values per channel


def _problem(args) -> str | None:
    """What is wrong with the options, alike on every rank (None when fine)."""
    if args.trajectories < 2:
        return f"--trajectories {args.trajectories}: needs at least 2 (the last is held out)"
    if args.crop > args.side:
        return f"--crop {args.crop} must be at most --side {args.side}"
    if args.crop < MIN_CROP:
        # The UNet halves the crop three times, and its BatchNorm (training mode,
        # as in the check) needs more than one value per channel at the bottom.
        return f"--crop {args.crop} must be at least {MIN_CROP}"
    if args.warmup < 0:
        return f"--warmup {args.warmup} must not be negative"
    budget = args.memory_per_rank
    if budget is not None and budget <= fit.RUNTIME_ALLOWANCE:
        return (f"--memory-per-rank {format_bytes(budget)} must exceed the runtime allowance "
                f"of {format_bytes(fit.RUNTIME_ALLOWANCE)} (docs/demo.md)")
    return None


class _Stages:
    """Rank 0's stage lines: '[k/5] name: what ... done in s'."""

    def __init__(self, comm, total: int = 5):
        self.comm, self.total, self.k = comm, total, 0
        self.times: dict[str, float] = {}
        self.cpu: dict[str, float] = {}  # rank 0's CPU time: less noisy on a shared machine

    def log(self, *parts) -> None:
        if self.comm.Get_rank() == 0:
            print(*parts, flush=True)

    def run(self, name: str, fn, describe=None):
        """Collective. ``fn()`` timed (wall on rank 0, from a barrier)."""
        self.k += 1
        self.comm.Barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        self.cpu[name] = time.process_time() - c0
        self.comm.Barrier()
        self.times[name] = time.perf_counter() - t0
        tail = f"  ({describe(result)})" if describe else ""
        self.log(f"[{self.k}/{self.total}] {name}: done in {self.times[name]:.1f} s{tail}")
        return result


def run(args) -> int:
    """Collective. The demo with the parsed ``args``; 0 when the check passed."""
    comm = dp.init()
    rank0 = comm.Get_rank() == 0
    problem = _problem(args)
    if problem:
        if rank0:
            print(f"domainpar demo: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
    comm.Barrier()
    h5 = out / "grayscott.h5"
    spec = dataset.Spec(side=args.side, trajectories=args.trajectories, pairs=args.pairs,
                        every=args.every, warmup=args.warmup, seed=args.seed)
    params = grayscott.Params()
    budget = args.memory_per_rank
    stages = _Stages(comm, 5 if budget is None else 7)
    t_start = time.perf_counter()
    _header(stages, args, spec, comm.Get_size())
    planned = None
    if budget is not None:
        planned = stages.run("plan", lambda: fit.plan(comm, args, out))
        stages.log("      " + fit.planned_line(planned, comm.Get_size()))
        why = fit.problem(planned, comm.Get_size())
        if why:
            stages.log(f"domainpar demo: {why}")
            return 2

    solver, states = stages.run(
        "solve", lambda: dataset.solve(spec, params, comm),
        lambda r: f"grid {'x'.join(map(str, r[0].dec.grid.dims))}, "
                  f"{spec.solver_steps} steps, block {r[0].dec.local_shape()[1:]} on rank 0")
    sizes = stages.run("write", functools.partial(dataset.write, h5, states, solver, spec, params),
                       lambda r: f"{r['train']['samples']} training + {r['test']['samples']} "
                                 f"held-out pairs, {h5}")
    del states, solver
    alone = None
    if budget is not None:
        alone = stages.run("one process", lambda: fit.one_process(comm, h5, args, out),
                           lambda r: budget_module.describe(r, budget))
    grid = dp.ProcessGrid((comm.Get_size(),))
    show = args.pairs // 2  # the held-out pair drawn and cropped for the check
    model, history, test = stages.run(
        "train", lambda: _train_and_test(h5, grid, args, show),
        lambda r: f"loss {_tail_mean(r[1]['loss']):.2e} over the last 20 steps, "
                  f"median step {median(r[1]['step_s']) * 1e3:.0f} ms")
    stages.log("      " + _versus_no_change(test))
    memory = None
    if budget is not None:
        memory = {"budget_bytes": budget, "allowance_bytes": fit.RUNTIME_ALLOWANCE,
                  "plan": planned, "one_process": alone,
                  "sharded_peak_bytes": history["peak_bytes"]}
        stages.log("      " + fit.sharded_line(history["peak_bytes"], budget))
    report = stages.run("check", lambda: check.check(model, _crop(h5, grid, show, args.crop),
                                                     grid, surrogate.SHARD),
                        lambda r: "PASSED" if r["ok"] else "FAILED")
    _log_check(stages, report)

    files = stages.run("plots", lambda: _plots(out, args, spec, test, history, sizes, grid,
                                               rank0, memory))
    summary = _summary(args, spec, params, comm, sizes, model, history, test, report,
                       stages, time.perf_counter() - t_start, h5, files, grid)
    summary["memory"] = memory
    if rank0:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"domainpar demo: {'OK' if report['ok'] else 'CHECK FAILED'} in "
              f"{summary['seconds']['total']:.0f} s. Pictures: "
              + ", ".join(str(f) for f in files) + f"; summary: {out / 'summary.json'}",
              flush=True)
    return 0 if report["ok"] else 1


def _train_and_test(h5, grid, args, show: int):
    """Collective. Train and evaluate, under ``--memory-per-rank`` in every rank
    when it is set (``budget.enforce``; lifted after the evaluation). The
    history gets ``peak_bytes``: every rank's peak above its baseline."""
    limit = None if args.memory_per_rank is None else budget_module.enforce(args.memory_per_rank)
    try:
        model, history = surrogate.train(h5, grid, steps=args.steps, batch=args.batch,
                                         width=args.width, lr=args.lr, seed=args.seed)
        test = surrogate.evaluate(model, h5, grid, show)
    finally:
        if limit is not None:
            limit.release()
    if limit is not None:
        history["peak_bytes"] = grid.comm.allgather(limit.peak_above_baseline())
    return model, history, test


def _versus_no_change(test: dict) -> str:
    mse, still = test["mse"], test["persistence_mse"]
    verdict = (f"{still / mse:.1f}x lower" if mse < still else
               "no better: train longer (--steps) or on more data")
    return (f"held-out trajectory: MSE {mse:.2e}; predicting no change: {still:.2e} "
            f"({verdict})")


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _header(stages: _Stages, args, spec: dataset.Spec, size: int) -> None:
    n = spec.side
    per = spec.warmup + spec.pairs * spec.every
    budget = args.memory_per_rank
    limit = ("" if budget is None else
             f", every rank limited to {format_bytes(budget)} above its baseline")
    lines = [
        ("plan", f"domainpar plan: per-rank estimates for {args.batch}x2x{n}^3 training, "
                 f"the smallest rank count that fits {format_bytes(budget or 0)}"
                 f" less {format_bytes(fit.RUNTIME_ALLOWANCE)}"),
        ("solve", f"{spec.trajectories} trajectories in a periodic {n}^3 box, {per} explicit "
                  "steps each, the box cut over all ranks (dp.HaloExchange)"),
        ("write", f"{spec.pairs} pairs (t, t + {spec.every} steps) per trajectory to "
                  f"{args.out}/grayscott.h5, each rank its block (dp.io.write)"),
        ("one process", "two training steps on the whole field in one process under "
                        "the budget (expected to run out of memory)"),
        ("train", f"{args.steps} Adam steps, batch {args.batch}, D cut over {_ranks(size)} "
                  f"(dp.DomainParallel, dp.io.ShardedDataset){limit}"),
        ("check", f"sharded vs one process on a {args.crop}^3 crop: output, input and "
                  "parameter gradients"),
        ("plots", f"{args.out}/sample.png, loss.png"
                  + ("" if budget is None else ", memory.png") + ", summary.json")]
    if budget is None:
        lines = [line for line in lines if line[0] not in ("plan", "one process")]
    stages.log(f"domainpar demo on {_ranks(size)}: a 3-D UNet surrogate of Gray-Scott "
               "reaction-diffusion\n" + "\n".join(f"  {k} {name:<11} {text}" for k, (name, text)
                                                  in enumerate(lines, 1)))


def _crop(h5, grid: dp.ProcessGrid, index: int, side: int):
    """Collective. A centred ``side``^3 crop of held-out input ``index``, whole on
    every rank (the check's one-process run needs it all; it is small)."""
    x = dp.io.read(h5, "test/inputs", grid, shard=surrogate.SHARD, index=index)
    n = x.shape[2:]
    box = tuple(slice((m - side) // 2, (m - side) // 2 + side) for m in n)
    return x[(slice(None), slice(None)) + box].full_tensor()


def _log_check(stages: _Stages, report: dict) -> None:
    for dtype in ("float64", "float32"):
        for what, row in report[dtype].items():
            line = (f"      {dtype:<8} {what:<20} max |diff| {row['max_abs']:.1e} "
                    f"(relative {row['max_rel']:.1e})")
            if "error_sharded" in row:
                line += (f"; error vs float64: sharded {row['error_sharded']:.1e}, one process "
                         f"{row['error_one_process']:.1e} (group's worst)")
            worst = f" (worst: {row['worst']})" if "worst" in row else ""
            stages.log(f"{line}  {'ok' if row['ok'] else 'FAILED'}{worst}")


def _plots(out: Path, args, spec, test: dict, history: dict, sizes: dict, grid, rank0: bool,
           memory: dict | None):
    files = [out / "sample.png", out / "loss.png"] + ([out / "memory.png"] if memory else [])
    if rank0 and memory:
        plots.memory_png(files[2], memory, title=f"training a 3-D UNet on {args.batch}x2x"
                                                 f"{spec.side}³ fields: memory per rank")
    if rank0:
        ranks = grid.comm.Get_size()
        dec = dp.Decomposition((spec.side,), grid, {0: 0}, check=False)
        seams = list(dec.block_offsets(0)[1:ranks])
        show, n = args.pairs // 2, spec.side
        mse, still = test["per_sample_mse"][show], test["per_sample_persistence_mse"][show]
        plots.sample_png(
            files[0], test["planes"], seams=seams,
            title=f"Gray-Scott surrogate on a held-out trajectory, pair {show + 1} of "
                  f"{args.pairs} (Δt = {spec.every} solver steps): MSE {mse:.2e}, "
                  f"no-change MSE {still:.2e}",
            plane_label=f"the plane y = {n // 2} of the periodic {n}³ box"
                        + (f"; dashed: where the {ranks} ranks' blocks meet along z"
                           if ranks > 1 else ""))
        plots.loss_png(files[1], history["loss"], persistence=sizes["train"]["persistence_mse"],
                       test_mse=test["mse"],
                       title=f"3-D UNet surrogate, {n}³ fields sharded over "
                             f"{_ranks(ranks)}, batch {args.batch}")
    return files


def _tail_mean(values, n: int = 20) -> float:
    tail = values[-n:]
    return sum(tail) / len(tail)


def _summary(args, spec, params, comm, sizes, model, history, test, report, stages, total, h5,
             files, grid) -> dict:
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "ranks": comm.Get_size(),
        "data": {"side": spec.side, "trajectories": spec.trajectories, "pairs": spec.pairs,
                 "every": spec.every, "warmup": spec.warmup, "seed": spec.seed,
                 "solver_steps": spec.solver_steps, "gray_scott": params.as_dict(),
                 "file": str(h5), **sizes},
        "training": {"steps": args.steps, "batch": args.batch, "width": args.width,
                     "lr": args.lr, "parameters": n_params, "grid": list(grid.dims),
                     "loss_first": history["loss"][0], "loss_last20": _tail_mean(history["loss"]),
                     "loss": history["loss"], "median_step_s": median(history["step_s"]),
                     "read_s_total": sum(history["read_s"]),
                     "peak_rss_mib_per_rank": history["peak_rss_mib"]},
        "test": {k: v for k, v in test.items() if k != "planes"},
        "check": {"crop": args.crop, **report},
        "seconds": {**stages.times, "total": total},
        "cpu_seconds_rank0": stages.cpu,
        "pictures": [str(f) for f in files],
    }
