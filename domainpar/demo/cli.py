"""`domainpar demo`: its parser. The job itself (``job.py``) imports torch and
MPI only when it runs, so `--help` stays instant."""
from __future__ import annotations

import argparse

from ..launch import positive

DESCRIPTION = """\
The main job, end to end, on N ranks (default 2; relaunches itself under mpiexec).
Its headline: a field one process cannot hold trains sharded, every rank under
a memory budget the kernel enforces (--memory-per-rank; see docs/demo.md):

  1 plan         `domainpar plan` for the UNet on --batch x 2 x --side^3: the
                 per-rank estimate for 1, 2, 4 ... ranks and the smallest rank
                 count that fits the budget (less a runtime allowance)
  2 solve        Gray-Scott reaction-diffusion in a periodic 3-D box, several
                 trajectories from random blobs, the box cut over a 3-D process
                 grid with ghost cells filled by dp.HaloExchange (numpy)
  3 write        pairs (state at t, state --every steps later) to HDF5, every
                 rank writing its block (dp.io.write); the last trajectory is
                 held out
  4 one process  two training steps on the whole field in a process of its own
                 under the budget: it runs out of memory, the job goes on
  5 train        the 3-D UNet surrogate (x + UNet3d(x), periodic convs) sharded
                 along D over all ranks (dp.DomainParallel, dp.io.ShardedDataset),
                 every rank under the budget, with a progress line; then its peak
                 per rank beside the budget
  6 check        the trained model on a crop sharded over the ranks against plain
                 PyTorch in one process: output, input and parameter gradients,
                 in float32 and float64; the job fails if they differ beyond
                 rounding
  7 plots        sample.png (a held-out sample: input, prediction, truth, error),
                 loss.png, memory.png (peak per rank against the budget for 1, 2
                 and 4 ranks, estimated and measured) and summary.json, in --out

--memory-per-rank none leaves out stages 1 and 4 and the limit. The defaults
take about 5 minutes on 2 idle cores, most of it training (--steps x --batch
UNet steps on --side^3 fields)."""


def _memory_size(text: str):
    from .budget import memory_size  # the plan's units, no torch
    return memory_size(text)


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
    sizes.add_argument("--side", type=positive(int), default=64,
                       help="grid points per side of the periodic box (default 64)")
    sizes.add_argument("--trajectories", type=positive(int), default=4,
                       help="trajectories, each from its own random blobs; the last is held "
                            "out for testing (default 4, at least 2)")
    sizes.add_argument("--pairs", type=positive(int), default=8,
                       help="(input, target) pairs per trajectory (default 8)")
    sizes.add_argument("--every", type=positive(int), default=100,
                       help="solver steps from an input to its target: the time step the "
                            "surrogate learns to take (default 100)")
    sizes.add_argument("--warmup", type=int, default=200,
                       help="solver steps before a trajectory's first input (default 200)")
    model = demo.add_argument_group("training")
    model.add_argument("--steps", type=positive(int), default=80,
                       help="training steps (default 80)")
    model.add_argument("--batch", type=positive(int), default=4,
                       help="samples per step (default 4)")
    model.add_argument("--width", type=positive(int), default=8,
                       help="UNet channels at the top level, doubled per level (default 8)")
    model.add_argument("--lr", type=positive(float), default=2e-3,
                       help="peak Adam learning rate; warm-up then cosine decay "
                            "(default 2e-3)")
    memory = demo.add_argument_group("memory")
    memory.add_argument("--memory-per-rank", type=_memory_size, default="576MiB",
                        metavar="SIZE",
                        help="every rank's memory budget for training, above what it holds "
                             "after its imports, enforced by the kernel (RLIMIT_DATA), e.g. "
                             "2GiB, 1500MiB; 'none' for no budget and no plan or one-process "
                             "stages (default 576MiB: one process runs out of it on the "
                             "default field, each of 2 ranks peaks at about 85%%)")
    memory.add_argument("--plan-seconds", type=positive(float), default=20.0,
                        help="the planner's measuring time (domainpar plan --time-budget; "
                             "default 20)")
    demo.add_argument("--crop", type=positive(int), default=16,
                      help="side of the crop the sharded-vs-one-process check runs on "
                           "(default 16, at least 9)")
    demo.add_argument("--out", default="demo-out",
                      help="folder for grayscott.h5, the PNGs and summary.json "
                           "(default demo-out)")
    demo.add_argument("--seed", type=int, default=0,
                      help="seed of the initial blobs and of training (default 0)")
    demo.set_defaults(run=_run)
