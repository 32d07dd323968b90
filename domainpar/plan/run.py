"""The `domainpar plan` run: check the options, measure, fit, recommend, print,
write JSON, and optionally verify the recommendation with a real run."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..progress import Progress
from .measure import PlanError, Setup, constraints, measure, setup_from
from .model import fit
from .report import MODES, best_per_count, grid_text, ranked, smallest_fit, table
from .units import format_bytes

SHOWN_RANKS = 64   # table rows up to this count (or 4x the smallest that fits)


def shard_dims(shape, dims) -> tuple[int, ...]:
    """Local. The shardable dims, checked against ``shape`` (default 2 and up)."""
    if dims is None:
        if len(shape) < 3:
            raise PlanError(f"--shape {' '.join(map(str, shape))} has no spatial dims "
                            "(batch, channels, then space); name the dims with --shard-dims")
        return tuple(range(2, len(shape)))
    dims = tuple(d + len(shape) if d < 0 else d for d in dims)
    bad = [d for d in dims if not 0 <= d < len(shape)]
    if bad or len(set(dims)) != len(dims):
        raise PlanError(f"--shard-dims {list(dims)}: need distinct dims of a "
                        f"{len(shape)}-dim shape")
    return tuple(sorted(dims))


def run(args) -> int:
    """Local (one process; ``--verify`` starts its own MPI job). ``domainpar plan``:
    measure the model's peak memory on growing blocks over a one-rank grid, fit
    it, estimate each grid, print and write the report; returns the exit status."""
    from ..comm import init
    init()
    shape = tuple(args.shape)
    dims = shard_dims(shape, args.shard_dims)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PlanError("--device cuda: torch sees no CUDA device here")
    setup = setup_from(args.entry, args.kwargs, shape, dims, args.dtype, device, args.optimizer)
    multiple, min_block = _constraints(setup, args)
    log = sys.stdout
    print(f"domainpar plan: {args.entry} on {_x(shape)} {args.dtype}, {device}, "
          f"optimizer {args.optimizer}; shardable dims {', '.join(map(str, dims))}", file=log)

    t0 = time.perf_counter()
    bar = Progress(args.points, "measuring scaled-down blocks", every_s=5.0)
    points, skipped = measure(setup, args.points, args.time_budget, multiple, min_block,
                              progress=bar)
    bar.close()
    seconds = time.perf_counter() - t0
    fits = {mode: fit([(p.cells, p.faces, getattr(p, mode)) for p in points]) for mode in MODES}
    _print_method(points, skipped, fits, seconds, multiple, min_block, log)

    budget = args.memory
    rows = best_per_count(shape, dims, args.max_ranks, fits, min_block, multiple)
    result = {"entry": args.entry, "kwargs": args.kwargs, "shape": list(shape),
              "shard_dims": list(dims), "dtype": args.dtype, "device": device,
              "optimizer": args.optimizer, "budget_bytes": budget, "multiple": multiple,
              "min_block": min_block, "measure_seconds": seconds,
              "points": [p.as_dict() for p in points], "skipped_blocks": skipped,
              "fits": {name: f.as_dict() for name, f in fits.items()},
              "rows": [r.as_dict(budget) for r in rows]}
    chosen = None
    if args.ranks is not None:
        options = ranked(shape, dims, args.ranks, fits, min_block, multiple)
        chosen = _for_ranks(args.ranks, options, shape, dims, budget, log)
        result.update(ranks=args.ranks, grids_for_ranks=[o.as_dict(budget) for o in options])
    if args.ranks is None or budget is not None:
        smallest = _per_count(rows, dims, budget, log)
        if smallest:
            result["smallest"] = {m: (e.as_dict(budget) if e else None)
                                  for m, e in smallest.items()}
            chosen = chosen or smallest["train"]
    if args.verify:
        result["verify"] = _verify(args, setup, chosen, log)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.json}", file=log)
    return 0


def _for_ranks(ranks: int, options, shape, dims, budget, log):
    """Print the grids of ``ranks`` ranks, best first; return the best."""
    if not options:
        raise PlanError(f"--ranks {ranks}: no grid of {ranks} ranks over dims {list(dims)} "
                        f"of {_x(shape)} leaves every rank a cell")
    print(f"\ngrids of {ranks} ranks, best first:", file=log)
    print(table(options[:10], dims, budget), file=log)
    best = options[0]
    print(f"\nbest grid for {ranks} ranks: {grid_text(best)}; estimated peak per rank: "
          f"training {format_bytes(best.train)}, inference {format_bytes(best.inference)}"
          + _fits_text(best, budget), file=log)
    return best


def _per_count(rows, dims, budget, log) -> dict:
    """Print the best grid per rank count and, given a budget, the smallest
    counts that fit it; return those ({} without a budget)."""
    smallest = {m: smallest_fit(rows, budget, m) for m in MODES} if budget else {}
    limit = SHOWN_RANKS
    train_fit = smallest.get("train")
    if train_fit:
        limit = max(limit, 4 * train_fit.grid.size)
    print("\nbest grid per rank count (estimated peak per rank):", file=log)
    print(table([r for r in rows if r.grid.size <= limit], dims, budget), file=log)
    if smallest:
        print(file=log)
    for mode, best in smallest.items():
        what = "the budget" if mode == "train" else "the budget for inference"
        text = (f"{best.grid.size} (grid {grid_text(best)})" if best else
                f"none up to {rows[-1].grid.size} ranks" + _why_none(rows))
        print(f"smallest rank count that fits {what}: {text}", file=log)
    return smallest


def _constraints(setup: Setup, args) -> tuple[int, int]:
    multiple, min_block = constraints(setup.factory())
    multiple = args.multiple or multiple
    return multiple, args.min_block or max(min_block, multiple)


def _print_method(points, skipped, fits, seconds, multiple, min_block, log) -> None:
    print(f"measured {len(points)} blocks in {seconds:.1f} s (one process; blocks' extents "
          f"multiples of {multiple}; grids with blocks under {min_block} cells along a "
          "sharded dim are flagged):", file=log)
    head = ("block", "train", "inference", "seconds")
    rows = [(_x(p.block), *(format_bytes(getattr(p, m)) for m in MODES), f"{p.seconds:.1f}")
            for p in points]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    for r in [head] + rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)), file=log)
    for failure in skipped:  # too small for the model
        print(f"  skipped {failure[:150]}", file=log)
    print("fitted per-rank peaks (cells: the block's elements; faces: its cross-sections "
          "over the shardable dims):", file=log)
    for mode, f in fits.items():
        print(f"  {mode}: {f.describe()}", file=log)
        if f.r2 < 0.99:
            print(f"    warning: R^2 {f.r2:.3f}: the peak is not linear in the block; the "
                  "estimates are rough", file=log)


def _fits_text(e, budget) -> str:
    if budget is None:
        return ""
    verdict = {True: "fits", False: "does not fit"}
    return (f" (training {verdict[e.fits(budget, 'train')]}, inference "
            f"{verdict[e.fits(budget, 'inference')]} {format_bytes(budget)})")


def _why_none(rows) -> str:
    if rows and rows[-1].too_small:
        return " before the blocks get too small (shard more dims, or a smaller model)"
    return " (raise --max-ranks)"


def _verify(args, setup: Setup, chosen, log) -> dict:
    """Run ``chosen``'s grid on the full field under mpiexec; measured against estimated."""
    from ..launch import mpiexec_env, mpiexec_path
    if chosen is None:
        raise PlanError("--verify needs --ranks or a --memory budget that some grid fits")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "measured.json"
        cmd = [mpiexec_path(), "-n", str(chosen.grid.size), sys.executable, "-m",
               "domainpar.plan.measure", args.entry, "--kwargs", json.dumps(args.kwargs),
               "--shape", *map(str, setup.shape), "--dims", *map(str, setup.dims),
               "--grid", *map(str, chosen.grid.ranks), "--dtype", args.dtype,
               "--device", setup.device, "--optimizer", setup.optimizer, "--out", str(out)]
        print(f"\nverifying: {' '.join(cmd)}", file=log, flush=True)
        code = subprocess.call(cmd, env=mpiexec_env())
        if code != 0:
            raise PlanError(f"the verification run failed (exit {code})")
        measured = json.loads(out.read_text())
    report: dict[str, Any] = {"grid": list(chosen.grid.ranks)}
    for mode in MODES:
        peak, want = max(measured[mode]), getattr(chosen, mode)
        report[mode] = {"measured_bytes": measured[mode], "estimated_bytes": want,
                        "error": want / peak - 1}
        print(f"  {mode}: measured peak {format_bytes(peak)} (largest rank), estimated "
              f"{format_bytes(want)} ({100 * (want / peak - 1):+.1f}%)", file=log)
    return report


def _x(shape) -> str:
    return "x".join(map(str, shape))
