"""Strong and weak scaling of a 3-D UNet training step, at the launched rank count.

Run it at several rank counts and compare the figures, e.g.

    mpiexec -n 1 python examples/scaling.py
    mpiexec -n 2 python examples/scaling.py

(``domainpar bench scaling`` launches those runs itself and plots the
efficiencies.) The step is one of ``domainpar.testing.models.UNet3d`` in
``DomainParallel``: forward, mean-squared-error loss, backward and an SGD
step, on a float32 field cut along its depth (dim 2) into one block per rank.

- strong scaling: the same global field at every rank count (default
  1x2x64x64x64), so each rank's block shrinks as ranks are added; ideally the
  step time falls as 1/n.
- weak scaling: the same block per rank (default 1x2x32x64x64), so the field
  grows with the ranks; ideally the step time stays flat.

Each figure is the median over ``--repeats`` steps of the slowest rank's step
time. The timing is ``domainpar.bench.scaling.measure``, the function the
benchmark's jobs call.
"""
import argparse
import os

import torch

import domainpar as dp
from domainpar.bench import scaling


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strong-shape", type=int, nargs=5, default=[1, 2, 64, 64, 64],
                        metavar=("N", "C", "D", "H", "W"),
                        help="the global field of strong scaling (default 1 2 64 64 64)")
    parser.add_argument("--weak-block", type=int, nargs=5, default=[1, 2, 32, 64, 64],
                        metavar=("N", "C", "D", "H", "W"),
                        help="each rank's block in weak scaling (default 1 2 32 64 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--levels", type=int, default=4, help="UNet levels (default 4)")
    args = parser.parse_args()

    comm = dp.init()
    torch.set_num_threads(1)  # one core per rank: ranks, not threads, do the scaling
    n = comm.Get_size()
    figures = scaling.measure(comm, args.strong_shape, args.weak_block, args.repeats,
                              levels=args.levels)
    if comm.Get_rank() != 0:
        return
    cores = os.cpu_count()
    print(f"UNet3d training step on {n} rank(s), {cores} cores"
          + (" (more ranks than cores: they share cores)" if n > cores else ""))
    for mode, f in figures.items():
        field = "x".join(map(str, f["global_shape"]))
        block = "x".join(map(str, f["local_shape"]))
        cells = 1
        for extent in f["global_shape"]:
            cells *= extent
        print(f"  {mode:<6} field {field:>14}, block per rank {block:>14}: "
              f"median step {f['median_step_s']:.3f} s "
              f"(min {min(f['samples_s']):.3f}, max {max(f['samples_s']):.3f}), "
              f"{cells / f['median_step_s'] / 1e6:.2f} M cells/s")
    print("strong efficiency at n ranks = T1 / (n Tn); weak = T1 / Tn "
          "(T1: this script on 1 rank)")


if __name__ == "__main__":
    main()
