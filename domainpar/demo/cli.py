"""`domainpar demo`: its parser. The job itself (``job.py``) imports torch and
MPI only when it runs, so `--help` stays instant."""
from __future__ import annotations

import argparse

from ..launch import positive

DESCRIPTION = """\
The main job, end to end, on N ranks (default 2; relaunches itself under mpiexec):

  1 solve  Gray-Scott reaction-diffusion in a periodic 3-D box, several
           trajectories from random blobs, the box cut over a 3-D process grid
           with ghost cells filled by dp.HaloExchange (numpy, explicit Euler)
  2 write  pairs (state at t, state --every steps later) to HDF5, every rank
           writing its block (dp.io.write); the last trajectory is held out
  3 train  a 3-D UNet surrogate (x + UNet3d(x), periodic convs) sharded along D
           over all ranks (dp.DomainParallel, dp.io.ShardedDataset), with a
           progress line: loss, step time, peak memory per rank
  4 check  the trained model on a crop sharded over the ranks against plain
           PyTorch in one process: output, input and parameter gradients, in
           float32 and float64; the job fails if they differ beyond rounding
  5 plots  sample.png (a plane of a held-out sample: input, prediction, truth,
           error), loss.png, and summary.json, in --out

The defaults take a few minutes on a 2-core machine; the time goes mostly to
training (about --steps x --batch UNet steps on --side^3 fields)."""


def _run(args) -> int:
    from . import job
    return job.run(args)


def add_parser(subparsers) -> None:
    """Add `demo` to the top-level subparsers."""
    demo = subparsers.add_parser(
        "demo", help="the main job: solve Gray-Scott in parallel, write HDF5, train a 3-D "
                     "UNet surrogate domain-parallel, check it against one process, plot",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("-n", "--nprocs", type=positive(int), default=2,
                      help="ranks to launch with mpiexec when not already under a launcher "
                           "(default 2)")
    sizes = demo.add_argument_group("data")
    sizes.add_argument("--side", type=positive(int), default=32,
                       help="grid points per side of the periodic box (default 32)")
    sizes.add_argument("--trajectories", type=positive(int), default=8,
                       help="trajectories, each from its own random blobs; the last is held "
                            "out for testing (default 8, at least 2)")
    sizes.add_argument("--pairs", type=positive(int), default=12,
                       help="(input, target) pairs per trajectory (default 12)")
    sizes.add_argument("--every", type=positive(int), default=100,
                       help="solver steps from an input to its target: the time step the "
                            "surrogate learns to take (default 100)")
    sizes.add_argument("--warmup", type=int, default=200,
                       help="solver steps before a trajectory's first input (default 200)")
    model = demo.add_argument_group("training")
    model.add_argument("--steps", type=positive(int), default=300,
                       help="training steps (default 300)")
    model.add_argument("--batch", type=positive(int), default=4,
                       help="samples per step (default 4)")
    model.add_argument("--width", type=positive(int), default=8,
                       help="UNet channels at the top level, doubled per level (default 8)")
    model.add_argument("--lr", type=positive(float), default=2e-3,
                       help="peak Adam learning rate; warm-up then cosine decay "
                            "(default 2e-3)")
    demo.add_argument("--crop", type=positive(int), default=16,
                      help="side of the crop the sharded-vs-one-process check runs on "
                           "(default 16, at least 9)")
    demo.add_argument("--out", default="demo-out",
                      help="folder for grayscott.h5, the PNGs and summary.json "
                           "(default demo-out)")
    demo.add_argument("--seed", type=int, default=0,
                      help="seed of the initial blobs and of training (default 0)")
    demo.set_defaults(run=_run)
