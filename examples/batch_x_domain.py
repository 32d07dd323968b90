"""Data parallel x domain parallel: a 2-D process grid.

Run with an even number of ranks, e.g. ``mpiexec -n 4 python examples/batch_x_domain.py``
(a 2 x 2 grid); with 2 ranks choose ``--batch-ranks 2`` (2 x 1: data parallel
only) or ``--batch-ranks 1`` (1 x 2: domain parallel only). ``--help`` lists
the options.

Grid axis 0 cuts the batch (each row of ranks gets its own samples, as data
parallelism would), grid axis 1 cuts every sample's height (the ranks of a row
share each of its samples, as domain parallelism does). One ``shard`` map says
both: ``{0: 0, 2: 1}``, batch dim 0 on axis 0 and H (dim 2) on axis 1. Every
rank prints its grid coordinates and its block.

The model is a plain PyTorch convolutional denoiser (convs, BatchNorm, GELU,
a residual) wrapped in ``dp.DomainParallel`` over the whole grid: parameter
gradients are summed over all ranks, batch and domain axes alike, and
BatchNorm's statistics are those of the whole batch, every field whole. The
convs exchange halos along H within a row of the grid.

At the end the trained model on one batch, sharded, is checked against one
process running it on the whole batch (output and gradients, in float64).
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import TrainingLog, add_training_options, check_against_one_process, refuse, show_blocks

import domainpar as dp

SHARD = {0: 0, 2: 1}  # batch along grid axis 0, H along grid axis 1


class Denoiser(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        # bias=False where BatchNorm follows: it would subtract the bias again.
        self.body = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1), nn.GELU(),
            nn.Conv2d(width, 1, 1))

    def forward(self, x):
        return x - self.body(x)  # predicts the noise


def batch(step, args, grid):
    """Collective. Noisy fields and clean ones: random waves drawn on rank 0,
    scattered over the batch and H."""
    pair = (None, None)
    if grid.comm.rank == 0:
        g = torch.Generator().manual_seed(args.seed * 100003 + step)
        y, x = torch.meshgrid(torch.arange(args.size) / args.size,
                              torch.arange(args.size) / args.size, indexing="ij")
        k = torch.randint(1, 5, (args.batch, 2, 1, 1), generator=g)
        phase = 2 * math.pi * torch.rand(args.batch, 1, 1, generator=g)
        clean = torch.sin(2 * math.pi * (k[:, 0] * y + k[:, 1] * x) + phase)[:, None]
        pair = (clean + 0.5 * torch.randn(clean.shape, generator=g), clean)
    return tuple(dp.scatter(t, grid, shard=SHARD) for t in pair)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-ranks", type=int, default=None,
                        help="grid rows, i.e. ranks along the batch (default 2, or 1 on one "
                             "rank); the other grid axis gets the rest")
    parser.add_argument("--batch", type=int, default=8,
                        help="global batch size (default %(default)s)")
    parser.add_argument("--size", type=int, default=64,
                        help="side of a square field (default %(default)s)")
    parser.add_argument("--width", type=int, default=16, help="conv channels (default %(default)s)")
    add_training_options(parser, steps=40, lr=3e-3)
    args = parser.parse_args()

    comm = dp.init()
    rows = args.batch_ranks if args.batch_ranks is not None else min(2, comm.size)
    if rows < 1 or comm.size % rows:
        refuse(comm, f"{comm.size} ranks do not split into --batch-ranks {rows} rows: run on an "
                     f"even number of ranks or pass --batch-ranks 1")
    if min(args.steps, args.batch, args.size, args.width) < 1:
        refuse(comm, "--steps, --batch, --size and --width must be positive")
    grid = dp.ProcessGrid(dims=(rows, comm.size // rows))

    torch.manual_seed(args.seed)
    net = Denoiser(args.width)
    model = dp.DomainParallel(net, grid)  # gradients summed over the whole grid
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    noisy, _ = batch(0, args, grid)
    if comm.rank == 0:
        print(f"batch {tuple(noisy.shape)} (N, C, H, W) on a {rows} x {comm.size // rows} grid "
              f"(batch ranks x domain ranks)")
    show_blocks(comm, noisy, {0: "samples", 2: "rows"})

    log = TrainingLog(comm, args.steps, note=" (the noise alone: 2.5e-01)")
    for step in log:
        noisy, clean = batch(step, args, grid)
        opt.zero_grad()
        loss = F.mse_loss(model(noisy), clean)
        loss.backward()
        opt.step()
        log.record(loss)
    if not args.no_check:
        sample = noisy.full_tensor()  # gathered for the check only
        check_against_one_process(comm, net, sample, grid, SHARD)


if __name__ == "__main__":
    main()
