"""`domainpar bench swap`: a change to domainpar's own code timed beside the code
as it is, step by step in one job.

``--compare`` switches what domainpar reads from the environment; a change
with no setting (a constant, a function, a kernel entry) is timed here instead.
``--set MODULE:NAME=VALUE`` names it: configuration B sets the attribute NAME
(a dotted path) of a module of domainpar to VALUE, a Python literal (``1``,
``None``, ``'pack'``) or ``@MODULE:NAME``, another object (``@domainpar.ops.
common:_meta_cached.__wrapped__``: the function without its cache). One job of
``--ranks`` ranks builds the model step of `bench scaling` once and times it
under A and B alternately (``timing.interleaved``: the slowest rank between
barriers), B's attributes set around each of B's steps and restored after, so
a slow spell of a shared machine hits both alike and both share one process's
allocator and caches. A change takes effect where the code reads the attribute
at call time: a value copied at import, or a plan cached on A's first step
(``tensor.layout.planned``), keeps A's choice.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import os
import platform
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def _resolve(path: str) -> tuple[Any, str]:
    """(the object holding the last attribute of ``MODULE:NAME``, that attribute's
    name); ValueError naming what is missing."""
    module_name, sep, name = path.partition(":")
    if not sep or not name:
        raise ValueError(f"{path!r}: expected MODULE:NAME (domainpar.ops.conv:_PIECE_ROWS)")
    if module_name != "domainpar" and not module_name.startswith("domainpar."):
        raise ValueError(f"{path!r}: only domainpar's own modules can be changed")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{path!r}: no module {module_name!r} ({e})") from None
    *parents, last = name.split(".")
    for part in parents:
        owner = _attribute(owner, part, path)
    _attribute(owner, last, path)
    return owner, last


def _attribute(owner: Any, name: str, path: str) -> Any:
    if not hasattr(owner, name):
        raise ValueError(f"{path!r}: {type(owner).__name__} {getattr(owner, '__name__', '')!r} "
                         f"has no attribute {name!r}")
    return getattr(owner, name)


def _value(text: str) -> Any:
    """VALUE of ``--set``: ``@MODULE:NAME`` (that object) or a Python literal."""
    if text.startswith("@"):
        owner, name = _resolve(text[1:])
        return getattr(owner, name)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"value {text!r}: a Python literal (1, 0.5, None, True, 'text') or "
                         f"@MODULE:NAME") from None


def parse_set(text: str) -> str:
    """argparse type of one ``--set MODULE:NAME=VALUE``: checked here (the module
    imports, the attribute and VALUE exist), kept as text for the job."""
    path, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODULE:NAME=VALUE")
    try:
        _resolve(path)
        _value(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


@contextlib.contextmanager
def swapped(changes: Sequence[str]) -> Iterator[None]:
    """Local (enter it alike on every rank). Every ``MODULE:NAME=VALUE`` of
    ``changes`` set inside the block; the previous values after it."""
    saved = []
    try:
        for text in changes:
            path, _, value = text.partition("=")
            owner, name = _resolve(path)
            new = _value(value)
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, new)
        yield
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)


def measure(comm, model: str, shape: Sequence[int], changes: Sequence[str], repeats: int,
            inference: bool = False, width: int = 4, levels: int = 4) -> dict:
    """Collective. The step of ``model`` on ``shape`` sharded over every rank of
    ``comm``, timed ``repeats`` times under A (as is) and B (``changes``),
    alternating, after two warm-up steps of each."""
    from ..comm import ProcessGrid
    from .scaling import model_step
    from .timing import interleaved
    step, local = model_step(ProcessGrid((comm.Get_size(),), comm=comm), tuple(shape), model,
                             width, levels, inference)

    def context(name: str):
        return swapped(changes) if name.startswith("B:") else contextlib.nullcontext()
    samples = interleaved(comm, {"A": step, "B:": step}, repeats, warmup=2, context=context)
    return {"local_shape": list(local), "A": samples["A"], "B": samples["B:"]}


def run(model: str, shape: Sequence[int], changes: Sequence[str], ranks: int = 2,
        repeats: int = 15, inference: bool = False, width: int = 4, levels: int = 4,
        out: str = "bench-out/swap.json", log=print) -> dict:
    """Launch the job, print the medians and B/A, write JSON and a PNG to ``out``."""
    from .jobs import launch
    from .output import write_json
    from .settings import KEYS, current
    from .step import describe_model
    from .timing import median
    what = "inference forward (eval, no_grad)" if inference else "training step"
    config = describe_model(model, width, levels)
    log(f"domainpar bench swap: {config} {what} on {'x'.join(map(str, shape))}, {ranks} "
        f"rank(s), {repeats} steps each of A (as is) and B, alternating; B sets "
        f"{'; '.join(changes)}", flush=True)
    load = [os.getloadavg()]
    worker = ["--worker", "--model", model, "--shape", *map(str, shape), "--repeats",
              str(repeats), "--width", str(width), "--levels", str(levels),
              *(["--inference"] if inference else []), "--set", *changes]
    with tempfile.TemporaryDirectory() as tmp:
        job = launch("domainpar.bench.swap", ranks, worker, Path(tmp) / "result.json")
    load.append(os.getloadavg())
    a, b = median(job["A"]), median(job["B"])
    report = {
        "benchmark": "swap", "model": model, "model_config": config,
        "mode": "inference" if inference else "training", "global_shape": list(shape),
        "local_shape": job["local_shape"], "ranks": ranks, "repeats": repeats,
        "changes": list(changes), "host": platform.node(), "cpus": os.cpu_count() or 1,
        "loadavg_start_end": load, "torch_threads_per_rank": 1,
        # --compare's keys set where the command ran (malloc's included): the job
        # inherits them, beside the launcher's defaults (launch.LAUNCH_ENV)
        "environment": {k: v for k, v in current(KEYS).items() if v is not None},
        "A": {"median_step_s": a, "samples_s": job["A"]},
        "B": {"median_step_s": b, "samples_s": job["B"]}, "ratio_B_over_A": b / a}
    for name in ("A", "B"):
        s = report[name]["samples_s"]
        log(f"  {name}: median {report[name]['median_step_s'] * 1e3:9.1f} ms "
            f"(min-max {min(s) * 1e3:.1f}-{max(s) * 1e3:.1f})")
    log(f"B/A median step {b / a:.3f} (below 1: B is faster); "
        f"{report['cpus']} cores on {report['host']}, load average {load[0][0]:.1f} at the "
        f"start, {load[1][0]:.1f} at the end.")
    write_json(report, out, log)
    return report


def plot(report: dict, plt):
    """The PNG: A's and B's samples, in step order, and their medians."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(("A", "B")):
        part = report[name]
        ax.plot(range(1, len(part["samples_s"]) + 1), part["samples_s"], marker="os"[i],
                linestyle="-" if name == "A" else "--", color=f"C{i}",
                label=f"{name}{' (as is)' if name == 'A' else ''}: median "
                      f"{part['median_step_s'] * 1e3:.1f} ms")
        ax.axhline(part["median_step_s"], color=f"C{i}", alpha=0.5, linewidth=1)
    ax.set_xlabel("step (A and B alternate)")
    ax.set_ylabel(("inference forward" if report["mode"] == "inference" else "training step")
                  + " (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{report['model_config']}, {'x'.join(map(str, report['global_shape']))}, "
                 f"{report['ranks']} rank(s): B/A {report['ratio_B_over_A']:.3f}\nB: "
                 + "; ".join(report["changes"]), fontsize=9)
    return fig


# -- the command ------------------------------------------------------------------------------------
def add_parser(bench_sub, add_out) -> None:
    """Add `bench swap` to the bench subcommands (``add_out``: the --out option)."""
    from ..launch import positive
    from .step import MODELS
    swap = bench_sub.add_parser(
        "swap", help="a change to domainpar's code (a constant, a function) timed beside "
                     "the code as it is, step by step in one job",
        description="Times the model step of `bench scaling` (same models and fields) in "
                    "one job of --ranks ranks, alternating configuration A (the code as it "
                    "is) and B (--set: attributes of domainpar's modules changed around "
                    "each of B's steps, restored after), medians of the slowest rank "
                    "between barriers. For changes with no setting; --compare covers the "
                    "environment variables. A change takes effect where the code reads "
                    "the attribute at call time (not a value copied at import, not a plan "
                    "cached on A's first step). Run it without mpiexec. Prints both "
                    "medians and B/A; writes JSON and a PNG of the samples. Example: "
                    "--model unet3d --side 64 --set domainpar.ops.conv:_PIECE_ROWS=1 "
                    "(or =@domainpar.ops.common:_meta_cached.__wrapped__ for an object).")
    swap.add_argument("--set", nargs="+", type=parse_set, required=True, dest="changes",
                      metavar="MODULE:NAME=VALUE",
                      help="what B changes: the attribute NAME (dotted) of a domainpar "
                           "module set to VALUE, a Python literal (1, None, 'pack') or "
                           "@MODULE:NAME (that object)")
    swap.add_argument("--model", choices=MODELS, default="unet3d",
                      help="the model, as in `bench scaling` (default unet3d)")
    swap.add_argument("--side", type=positive(int), default=None,
                      help="the field's side, as `bench scaling`'s strong field (default: "
                           "64 for unet3d and resnet3d, 256 for vit2d, 512 for fno2d)")
    swap.add_argument("--shape", type=positive(int), nargs="+", default=None,
                      metavar="EXTENT", help="the global field instead: N C D H W (3-D "
                                             "models) or N C H W (vit2d, fno2d)")
    swap.add_argument("--ranks", type=positive(int), default=2,
                      help="ranks of the job; the field is sharded along dim 2 (default 2)")
    swap.add_argument("--inference", action="store_true",
                      help="time one forward in eval mode under torch.no_grad instead")
    swap.add_argument("--repeats", type=positive(int), default=15,
                      help="timed steps of each configuration, after two warm-up steps "
                           "each (default 15)")
    swap.add_argument("--width", type=positive(int), default=4,
                      help="unet3d: the channels at the first level (default 4)")
    swap.add_argument("--levels", type=positive(int), default=4,
                      help="unet3d: the levels (default 4)")
    add_out(swap, "swap")
    swap.set_defaults(run=main, launches_jobs=True, nprocs=1)


def main(args) -> int:
    """`domainpar bench swap`: check the field, launch the job, report."""
    from ..launch import under_launcher
    from . import scaling
    if under_launcher():
        sys.exit("domainpar bench swap launches its own job; run it without mpiexec")
    try:
        shape = scaling.shapes(args.model, args.side, args.shape)[0]
    except ValueError as e:
        sys.exit(f"domainpar bench swap: {str(e).replace('--strong-shape', '--shape')}")
    run(args.model, shape, args.changes, ranks=args.ranks, repeats=args.repeats,
        inference=args.inference, width=args.width, levels=args.levels, out=args.out)
    return 0


# -- worker entry point ---------------------------------------------------------------------------
def _worker_main(argv=None) -> int:
    from . import jobs
    from .scaling import MODELS
    parser = argparse.ArgumentParser(description="internal: the job of `domainpar bench swap`")
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--shape", type=int, nargs="+", required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--levels", type=int, required=True)
    parser.add_argument("--inference", action="store_true")
    parser.add_argument("--set", nargs="+", required=True, dest="changes")
    parser.add_argument("--result", required=True)
    parser.set_defaults(compare=None)
    args = parser.parse_args(argv)
    from ..comm import init
    comm = init()
    return jobs.run_worker(args, lambda: measure(
        comm, args.model, args.shape, args.changes, args.repeats, args.inference, args.width,
        args.levels))


if __name__ == "__main__":
    sys.exit(_worker_main())
