"""A Fourier neural operator on a 2-D field sharded over the ranks: distributed FFT.

Run with any number of ranks, e.g. ``mpiexec -n 2 python examples/fno.py``
(``--help`` lists the options).

The operator to learn: the heat equation's solution map on a periodic square,
from a field a(x) to u(x), a diffused for a while. Each training pair is made
on the sharded field itself: white noise drawn on rank 0 is scattered along H
(each rank holds H / P rows), smoothed into a random field by a filter in
Fourier space, and diffused the same way; ``torch.fft.rfft2`` and ``irfft2``
on the sharded field are domainpar's distributed FFT (local 1-D transforms
between all-to-all transposes).

The model is a plain PyTorch FNO: a 1x1 conv lifts the field to ``--width``
channels; each spectral layer takes rfft2, keeps the lowest ``--modes``
frequencies of both signs along H and the first ``--modes`` along W, mixes
channels there with complex weights (einsum), fills the rest of the spectrum
with zeros and goes back with irfft2, beside a 1x1 conv path; a 1x1 conv
projects back. rfft2 of a field sharded along H comes out sharded along W's
frequencies, and irfft2 brings it back to H; the model does not notice.

At the end the trained FNO on one batch, sharded, is checked against one
process running it on the whole fields (output and gradients, in float64).
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import TrainingLog, add_training_options, check_against_one_process, refuse, show_blocks

import domainpar as dp

SHARD = {2: 0}  # H along grid axis 0


# -- the model: plain PyTorch ----------------------------------------------------------------
class SpectralLayer(nn.Module):
    def __init__(self, width, modes):
        super().__init__()
        self.modes = modes
        # Two bands (H frequencies 0..m-1 and -m..-1) of complex (in, out, m, m)
        # weights, stored as (real, imaginary) pairs.
        self.weight = nn.Parameter(torch.randn(2, width, width, modes, modes, 2) / width ** 2)
        self.pointwise = nn.Conv2d(width, width, 1)

    def forward(self, x):
        h, w = x.shape[-2:]
        m = self.modes
        spectrum = torch.fft.rfft2(x)                 # (B, C, H, W // 2 + 1), complex
        weight = torch.view_as_complex(self.weight)
        bands = [torch.einsum("bixy,ioxy->boxy", band, wt)
                 for band, wt in zip((spectrum[..., :m, :m], spectrum[..., -m:, :m]), weight)]
        # Zeros between the two bands along H and past mode m along W.
        mixed = torch.cat([F.pad(bands[0], (0, 0, 0, h - 2 * m)), bands[1]], dim=-2)
        mixed = F.pad(mixed, (0, w // 2 + 1 - m))
        return torch.fft.irfft2(mixed, s=(h, w)) + self.pointwise(x)


class FNO(nn.Module):
    def __init__(self, width=16, modes=8, layers=3):
        super().__init__()
        self.lift = nn.Conv2d(1, width, 1)
        self.layers = nn.ModuleList(SpectralLayer(width, modes) for _ in range(layers))
        self.project = nn.Sequential(nn.Conv2d(width, 2 * width, 1), nn.GELU(),
                                     nn.Conv2d(2 * width, 1, 1))

    def forward(self, a):
        h = self.lift(a)
        for i, layer in enumerate(self.layers):
            h = layer(h)
            h = F.gelu(h) if i < len(self.layers) - 1 else h
        return self.project(h)


# -- training pairs, made on the sharded field -------------------------------------------------
def heat_filter(size, time):
    """Local. exp(-|2 pi k|^2 time) on rfft2's frequencies of a size x size field:
    a plain (H, W // 2 + 1) tensor, cut to each rank's block where it meets one."""
    kh = torch.fft.fftfreq(size, 1.0 / size)
    kw = torch.fft.rfftfreq(size, 1.0 / size)
    return torch.exp(-(2 * math.pi) ** 2 * (kh[:, None] ** 2 + kw[None, :] ** 2) * time)


def batch(step, args, grid):
    """Collective. (a, u): random smooth fields and the same fields diffused."""
    noise = None
    if grid.comm.rank == 0:
        g = torch.Generator().manual_seed(args.seed * 100003 + step)
        noise = torch.randn(args.batch, 1, args.size, args.size, generator=g)
    noise = dp.scatter(noise, grid, shard=SHARD)
    spectrum = torch.fft.rfft2(noise) * heat_filter(args.size, 2e-3) * args.size
    a = torch.fft.irfft2(spectrum, s=(args.size, args.size))
    u = torch.fft.irfft2(spectrum * heat_filter(args.size, args.time), s=(args.size, args.size))
    return a, u


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64,
                        help="side of the square field (default %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="fields a step (default %(default)s)")
    parser.add_argument("--width", type=int, default=16, help="FNO channels (default %(default)s)")
    parser.add_argument("--modes", type=int, default=8,
                        help="Fourier modes kept per dim and sign (default %(default)s)")
    parser.add_argument("--layers", type=int, default=3,
                        help="spectral layers (default %(default)s)")
    parser.add_argument("--time", type=float, default=1e-3,
                        help="how long the operator diffuses (default %(default)s)")
    add_training_options(parser, steps=40, lr=1e-2)
    args = parser.parse_args()

    comm = dp.init()
    if min(args.steps, args.batch, args.width, args.modes, args.layers) < 1:
        refuse(comm, "--steps, --batch, --width, --modes and --layers must be positive")
    if 2 * args.modes > args.size:
        refuse(comm, f"--modes {args.modes} needs --size of at least {2 * args.modes}")
    grid = dp.ProcessGrid(dims=(comm.size,))

    torch.manual_seed(args.seed)
    fno = FNO(args.width, args.modes, args.layers)
    model = dp.DomainParallel(fno, grid)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    a, _ = batch(0, args, grid)
    if comm.rank == 0:
        print(f"fields {tuple(a.shape)} (batch, channel, H, W) cut along H; "
              f"{args.layers} spectral layers, {args.modes} modes")
    show_blocks(comm, a, {2: "rows"})

    log = TrainingLog(comm, args.steps, note=" (relative mean squared error)")
    for step in log:
        a, u = batch(step, args, grid)
        opt.zero_grad()
        # Relative error: the fields' scale does not matter.
        loss = F.mse_loss(model(a), u) / u.pow(2).mean()
        loss.backward()
        opt.step()
        log.record(loss)
    if not args.no_check:
        sample = a.full_tensor()  # gathered for the check only
        check_against_one_process(comm, fno, sample, grid, SHARD)


if __name__ == "__main__":
    main()
