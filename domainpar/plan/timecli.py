"""`domainpar model`: its parser (torch and MPI load only when it runs)."""
from __future__ import annotations

import argparse
import sys

from ..launch import positive
from .cli import _kwargs

DESCRIPTION = """\
Predict a model's training step time at P ranks on a process grid, and check
the prediction against measured steps.

  step = compute(block) x rate + attention + sum over the step's communication events

compute: a training step (forward, backward, SGD) timed in this process on
scaled-down blocks over a one-rank grid, one torch thread, less its attention
kernels, fitted to a + b*cells + c*faces of the block (the memory plan's
method). attention: the work of the traced step's attention kernels (queries
x keys: N^2/P per rank under ring attention) at their measured seconds per
unit of work. The events: one step of the model traced on 2 ranks with the
comm layer observed (every halo exchange, allreduce, transpose, ring shift,
gather, with its layout), then re-counted for the target grid from the
layouts (halo bytes and neighbours per round, allreduce sizes, transposes'
bytes and peers, ring passes of P - 1 or P shifts). A network is a latency
and a bandwidth: measured here over shared memory or Open MPI's TCP on
loopback (`--profile default|tcp`), an entered cluster profile (cpu-cluster,
gpu-cluster), or --latency/--bandwidth. --rate scales the measured compute
for other hardware. Ranks beyond a node's cores share them (--cores).
docs/scaling.md has the validation and the assumptions.

  domainpar model predict ENTRY --shape ... --ranks 1 8 64   one model
  domainpar model validate    UNet3d, ViT, FNO at 1-4 ranks: predicted vs measured
                              (median and fastest sample, load average per launch)
  domainpar model project     UNet3d 256^3-1024^3, 1-1,024 ranks, CPU and GPU clusters"""


def add_parser(subparsers) -> None:
    """Add `model` to the top-level subparsers."""
    model = subparsers.add_parser(
        "model", help="predict step time at P ranks (time model); validate; project",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = model.add_subparsers(dest="model_command", required=True)
    p = sub.add_parser("predict", help="one model's predicted step time per rank count")
    p.add_argument("entry", help="MODULE:CALLABLE returning the torch.nn.Module")
    p.add_argument("--kwargs", type=_kwargs, default={}, help="JSON keyword arguments")
    p.add_argument("--shape", type=positive(int), nargs="+", required=True,
                   help="the full input's shape, batch and channels first")
    p.add_argument("--trace-shape", type=positive(int), nargs="+",
                   help="shape to trace and measure at (default --shape); events scale "
                        "from it dim by dim")
    p.add_argument("--shard-dims", type=int, nargs="+", help="default: dims 2 and up")
    p.add_argument("--ranks", type=positive(int), nargs="+", required=True)
    p.add_argument("--grid", type=positive(int), nargs="+",
                   help="ranks per shard dim (with one --ranks; default: the fastest grid)")
    p.add_argument("--profile", default="default",
                   choices=["default", "tcp", "cpu-cluster", "gpu-cluster"],
                   help="network and compute: measured here (default: shared memory; tcp) "
                        "or an entered cluster profile")
    p.add_argument("--latency", type=positive(float), help="seconds per message (e.g. 2e-6)")
    p.add_argument("--bandwidth", type=positive(float), help="bytes/s (e.g. 25e9)")
    p.add_argument("--rate", type=positive(float), help="compute time factor (0.1: 10x faster)")
    p.add_argument("--cores", type=positive(int), help="cores per node (ranks share them)")
    p.add_argument("--ranks-per-node", type=positive(int))
    p.add_argument("--time-budget", type=positive(float), default=60.0,
                   help="seconds for the compute measurement (default 60)")
    p.add_argument("--json", metavar="FILE")
    v = sub.add_parser(
        "validate", help="predicted vs measured: UNet3d, ViT, FNO at 1-4 ranks, "
                         "shared memory and TCP",
        description="Predict, then measure, a training step of UNet3d (width 4, 3 levels, "
                    "1x2x32^3: halos), ViT (a 64x64 field, ring attention) and FNO (64x64, "
                    "FFT transposes) at each "
                    "rank count and transport; launches its own mpiexec jobs (run it "
                    "without mpiexec). Prints predicted, median, error, fastest sample and "
                    "the load average of each launch (a warning where the load exceeds the "
                    "cores: timings are then the scheduler's, not the model's); writes "
                    "JSON. About 4 minutes at the defaults on 2 idle cores.")
    v.add_argument("--ranks", type=positive(int), nargs="+", default=[1, 2, 3, 4],
                   help="rank counts (default 1 2 3 4)")
    v.add_argument("--transports", nargs="+", default=["default", "tcp"],
                   choices=["default", "tcp"],
                   help="default: Open MPI's own choice (shared memory on one node); tcp: "
                        "TCP alone on loopback, a stand-in for a network (default both)")
    v.add_argument("--models", nargs="+", choices=["UNet3d", "ViT", "FNO"],
                   help="validate these models only (default: all three)")
    v.add_argument("--rounds", type=positive(int), default=2,
                   help="interleaved launches per configuration (default 2)")
    v.add_argument("--repeats", type=positive(int), default=5,
                   help="timed steps per model per launch (default 5)")
    v.add_argument("--out", default="bench-out/model-validation.json",
                   help="JSON output (default bench-out/model-validation.json)")
    j = sub.add_parser(
        "project", help="UNet3d strong and weak scaling to 1,024 ranks",
        description="Measure a UNet3d's compute here (scaled-down blocks), trace its "
                    "communication on 2 ranks, and project its step at 256^3, 512^3 and "
                    "1024^3 on 1 to 1,024 ranks (the fastest grid of each count) for a CPU "
                    "cluster and a GPU cluster profile; names the op that stops the scaling "
                    "first. Prints tables; writes JSON and a PNG.")
    j.add_argument("--out", default="bench-out/model-projection.json",
                   help="JSON; the PNG goes beside it (default "
                        "bench-out/model-projection.json)")
    j.add_argument("--time-budget", type=positive(float), default=120.0,
                   help="seconds for the compute measurement (default 120)")
    model.set_defaults(run=_model, nprocs=1)


def _model(args) -> int:
    from .measure import PlanError
    try:
        from ..comm import init
        init()
        if args.model_command == "predict":
            from .timerun import predict_command
            return predict_command(args)
        from . import timereport
        if args.model_command == "validate":
            timereport.validate(args.ranks, args.transports, args.rounds, args.repeats,
                                args.out, args.models)
        else:
            timereport.project(out=args.out, budget_s=args.time_budget)
        return 0
    except PlanError as exc:
        print(f"domainpar model: {exc}", file=sys.stderr)
        return 2
