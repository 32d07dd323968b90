"""The seed example: a Conv2d on an image sharded along its height.

Run with any number of ranks, e.g. ``mpiexec -n 2 python examples/seed_conv.py``.
The image (1 x 8 x 1024 x 1024 by default) is cut into blocks along H (dim 2),
one per rank. The conv needs no manual communication or padding: domainpar
fills each block's ghost rows from its neighbours in forward and sends their
gradients back in backward. For the check, every rank also runs the conv on the
whole image in one process and compares its own block of the output and of the
input gradient, and the weight gradient (summed over the ranks), with it.
"""
import argparse

import torch
from mpi4py import MPI

import domainpar as dp


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024,
                        help="image height and width (default 1024)")
    parser.add_argument("--channels", type=int, default=8,
                        help="in and out channels (default 8)")
    args = parser.parse_args()
    comm = dp.init()
    grid = dp.ProcessGrid((comm.size,))

    torch.manual_seed(0)  # the same weights and image on every rank
    conv = torch.nn.Conv2d(args.channels, args.channels, 3, padding=1)
    image = torch.randn(1, args.channels, args.size, args.size)

    # Domain-parallel: rank 0's image cut along H, one block per rank.
    x = dp.scatter(image, grid, shard={2: 0}, requires_grad=True)
    y = conv(x)               # ghost rows filled inside; y is sharded on H like x
    y.mean().backward()       # a global mean; backward sends ghost gradients home
    grad = x.grad.to_local()  # this rank's block of the input gradient
    shapes = comm.gather(tuple(grad.shape))  # printed by rank 0, in rank order
    for rank, shape in enumerate(shapes or []):
        print(f"rank {rank}: local gradient shape {shape}")

    # One process on the whole image, the same weights.
    ref_conv = torch.nn.Conv2d(args.channels, args.channels, 3, padding=1)
    ref_conv.load_state_dict(conv.state_dict())
    ref = image.clone().requires_grad_(True)
    y_ref = ref_conv(ref)
    y_ref.mean().backward()

    mine = x.decomposition.local_slices()  # where this rank's block sits in the image
    # (got, want, tolerance relative to the largest value). float32 sums taken in
    # another order differ in the last bits; the weight gradient sums over every
    # pixel (a million terms here), so its rounding grows with the image.
    checks = {"output": (y.to_local(), y_ref[mine], 1e-5),
              "input gradient": (grad, ref.grad[mine], 1e-5),
              "weight gradient": (conv.weight.grad, ref_conv.weight.grad, 1e-4)}
    ok = True
    for what, (got, want, tol) in checks.items():
        diff = comm.allreduce((got - want).abs().max().item(), op=MPI.MAX)
        rel = diff / comm.allreduce(want.abs().max().item(), op=MPI.MAX)
        ok = ok and rel <= tol
        if comm.rank == 0:
            print(f"{what:>15}: max |difference| {diff:.2e} ({rel:.1e} of the largest value)")
    if comm.rank == 0:
        print("seed example OK" if ok else "seed example FAILED: differs from one process")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
