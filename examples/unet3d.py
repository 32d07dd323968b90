"""Training a 3-D UNet surrogate from HDF5, domain-parallel.

Run with any number of ranks, e.g. ``mpiexec -n 2 python examples/unet3d.py``
(``--steps 3 --size 16`` for a quick look; ``--help`` lists the options).

1. Data. If ``--data FILE`` does not exist, the example first writes a small
   synthetic dataset to it: ``--samples`` random smooth fields ``u`` on a
   periodic cube of side ``--size`` and, as targets, ``v``, the same fields
   diffused (the heat equation's exact solution a while later), both
   (N, 1, D, H, W). Each rank computes only its block and ``dp.io.write``
   writes the blocks into one dataset, collectively.
2. ``dp.io.ShardedDataset`` hands each rank its block of every sample (cut over
   D, H and W on a process grid MPI chooses), shuffled the same way on every
   rank, the next sample read in the background.
3. A plain PyTorch UNet, wrapped in ``dp.DomainParallel``, trains with Adam on
   the mean squared error; convs, pooling, norms and interpolation exchange
   halos inside, nothing in the model knows about ranks.
4. At the end a checkpoint (``dp.io.save_checkpoint``: model, optimizer, step)
   goes to ``--checkpoint``; ``--resume`` continues from it, with the samples
   and the numbers an uninterrupted run would have had: ``--steps`` is the
   total, so ``--steps 20`` then ``--resume --steps 40`` trains 40 steps.
5. The trained UNet on one sample, sharded, is checked against one process
   running it on the whole sample (output and gradients, in float64).
"""
import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import TrainingLog, add_training_options, check_against_one_process, refuse, show_blocks

import domainpar as dp

SHARD = {2: 0, 3: 1, 4: 2}  # D, H, W along grid axes 0, 1, 2


# -- the model: plain PyTorch ----------------------------------------------------------------
def conv_block(cin, cout):
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.GELU(),
                         nn.Conv3d(cout, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.GELU())


class UNet(nn.Module):
    """``levels`` resolutions (max-pooled by 2 each), trilinear up-sampling to the
    skip's size, skips joined by concatenation; predicts the change to its input."""

    def __init__(self, channels=1, width=8, levels=3):
        super().__init__()
        w = [width * 2 ** i for i in range(levels)]
        self.down = nn.ModuleList([conv_block(channels, w[0])] +
                                  [conv_block(w[i - 1], w[i]) for i in range(1, levels)])
        self.up = nn.ModuleList(conv_block(w[i] + w[i + 1], w[i]) for i in range(levels - 1))
        self.head = nn.Conv3d(w[0], channels, 1)

    def forward(self, x):
        skips, h = [], x
        for i, block in enumerate(self.down):
            h = block(F.max_pool3d(h, 2) if i else h)
            skips.append(h)
        h = skips.pop()
        for block in reversed(self.up):
            skip = skips.pop()
            h = F.interpolate(h, size=skip.shape[2:], mode="trilinear")
            h = block(torch.cat([h, skip], dim=1))
        return x + self.head(h)


# -- the synthetic dataset -------------------------------------------------------------------
def heat_block(dec, sample, seed, t, modes=6):
    """Local. This rank's block of sample ``sample`` at time ``t`` of the heat
    equation on a periodic unit cube: a sum of random Fourier modes, each damped
    by exp(-|2 pi k|^2 t). The modes come from (seed, sample), alike on every rank."""
    rng = np.random.default_rng((seed, sample))
    coords = [np.arange(n)[s] / n for n, s in zip(dec.global_shape[2:], dec.local_slices()[2:])]
    z, y, x = np.meshgrid(*coords, indexing="ij", sparse=True)
    field = np.zeros(dec.local_shape()[2:])
    for _ in range(modes):
        k = rng.integers(-3, 4, size=3)
        amplitude, phase = rng.normal(), rng.uniform(0, 2 * np.pi)
        damping = np.exp(-(2 * np.pi) ** 2 * float(k @ k) * t)
        field = field + amplitude * damping * np.cos(
            2 * np.pi * (k[0] * z + k[1] * y + k[2] * x) + phase)
    return torch.from_numpy(field).float()


def write_dataset(path, grid, samples, size, seed):
    """Collective. ``u`` (t=0) and ``v`` (t=0.005) of every sample into ``path``."""
    dec = dp.Decomposition((samples, 1, size, size, size), grid, SHARD)
    for name, t in (("u", 0.0), ("v", 0.005)):
        block = torch.stack([heat_block(dec, i, seed, t) for i in range(samples)])[:, None]
        dp.io.write(path, name, dp.DomainTensor.from_local(block, grid, shard=SHARD))


def sample_stream(ds, start):
    """Local order, collective reads. (input, target) for step ``start``, ``start
    + 1``, ...: epoch after epoch of ``ds``'s shuffled order, starting where an
    uninterrupted run would be at step ``start``."""
    epoch, skip = divmod(start, len(ds))
    while True:
        ds.set_epoch(epoch)
        order = iter(ds) if skip == 0 else (ds[i] for i in ds.order(epoch)[skip:])
        yield from order
        epoch, skip = epoch + 1, 0


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=32,
                        help="cube side of a new dataset (default %(default)s)")
    parser.add_argument("--samples", type=int, default=8,
                        help="samples in a new dataset (default %(default)s)")
    parser.add_argument("--data", default=None,
                        help="HDF5 file with datasets u and v (N, 1, D, H, W); written first "
                             "if missing (default unet3d_SIZE.h5 in the current directory)")
    parser.add_argument("--checkpoint", default="unet3d_checkpoint.h5",
                        help="checkpoint written at the end (default %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint, which must exist")
    parser.add_argument("--width", type=int, default=8,
                        help="channels of the first level (default %(default)s)")
    parser.add_argument("--levels", type=int, default=3,
                        help="UNet resolutions (default %(default)s)")
    add_training_options(parser, steps=40, lr=3e-3,
                         steps_help="optimizer steps in all, with --resume the saved ones included")
    args = parser.parse_args()
    data = args.data or f"unet3d_{args.size}.h5"

    comm = dp.init()
    if args.steps < 1 or args.size < 1 or args.samples < 1:
        refuse(comm, "--steps, --size and --samples must be positive")
    if args.resume and not os.path.exists(args.checkpoint):
        refuse(comm, f"--resume: no checkpoint {args.checkpoint}")
    grid = dp.ProcessGrid(dims=(0, 0, 0))  # MPI chooses how to cut D, H, W

    if not os.path.exists(data):
        if comm.rank == 0:
            print(f"{data} does not exist: writing {args.samples} synthetic samples "
                  f"(1 x {args.size}^3, u and v) in parallel with dp.io.write", flush=True)
        write_dataset(data, grid, args.samples, args.size, args.seed)

    torch.manual_seed(args.seed)
    unet = UNet(width=args.width, levels=args.levels)
    model = dp.DomainParallel(unet, grid)   # broadcasts rank 0's weights
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    start = 0
    if args.resume:
        start = dp.io.load_checkpoint(args.checkpoint, unet, opt, grid=grid).extra["step"]

    with dp.io.ShardedDataset(data, inputs="u", targets="v", grid=grid, shard=SHARD,
                              shuffle=True, seed=args.seed) as ds:
        x, _ = ds[0]
        if comm.rank == 0:
            print(f"{len(ds)} samples of shape {tuple(x.shape)} from {data}; "
                  f"{comm.size} rank(s) on a {'x'.join(map(str, grid.dims))} grid over D, H, W")
        show_blocks(comm, x, {2: "D", 3: "H", 4: "W"})
        if comm.rank == 0 and start:
            print(f"resumed from {args.checkpoint} at step {start}")

        log = TrainingLog(comm, args.steps, start)  # the progress line and the final loss
        samples = sample_stream(ds, start)
        for _, (x, target) in zip(log, samples):
            opt.zero_grad()
            loss = F.mse_loss(model(x), target)   # a global mean: the same on every rank
            loss.backward()                       # gradients summed over the grid
            opt.step()
            log.record(loss)
        samples.close()
        sample = ds[0][0].full_tensor()  # gathered for the check only

    dp.io.save_checkpoint(args.checkpoint, unet, opt, extra={"step": args.steps})
    if comm.rank == 0:
        print(f"checkpoint: {args.checkpoint} (step {args.steps})")
    if not args.no_check:
        check_against_one_process(comm, unet, sample, grid, SHARD)


if __name__ == "__main__":
    main()
