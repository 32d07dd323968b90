"""Shared by the training examples: their common options, the printout of
each rank's block, the bookkeeping of a training loop (progress line, final
loss), the closing check against one process, and refusing bad options on
every rank alike.

Not an example itself. ``python examples/X.py`` puts examples/ on sys.path, so
the examples import this as ``_common``.
"""
import copy
import sys
import time

import torch

import domainpar as dp
from domainpar.progress import Progress
from domainpar.testing import assert_matches_single_process


def add_training_options(parser, steps: int, lr: float, steps_help: str = "optimizer steps"):
    """Local. --steps, --lr, --seed and --no-check, with these defaults."""
    parser.add_argument("--steps", type=int, default=steps,
                        help=steps_help + " (default %(default)s)")
    parser.add_argument("--lr", type=float, default=lr,
                        help="Adam's learning rate (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the data and the weights (default %(default)s)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the comparison with one process at the end (it runs the "
                             "model on the whole input on every rank)")


def show_blocks(comm, x, names: dict) -> None:
    """Collective. Rank 0 prints every rank's grid coordinates and the index
    range its block of the DomainTensor ``x`` covers along the dims in
    ``names`` ({dim: what to call it})."""
    dec = x.decomposition
    ranges = comm.gather((dec.grid.coords, [dec.local_slices()[d] for d in names]))
    if comm.rank == 0:
        for rank, (coords, slices) in enumerate(ranges):
            spans = ", ".join(f"{name} {s.start}..{s.stop - 1}" if s.stop > s.start else
                              f"{name} none" for name, s in zip(names.values(), slices))
            print(f"  rank {rank}: coords {tuple(coords)}, {spans}", flush=True)


class TrainingLog:
    """Local (prints on rank 0). A training loop's bookkeeping: iterating gives
    the step numbers ``start`` .. ``steps - 1``; ``record(loss)`` after each
    step updates the progress line (loss, step time); after the last step the
    final loss is printed, followed by ``note``."""

    def __init__(self, comm, steps: int, start: int = 0, note: str = ""):
        self.comm, self.steps, self.start, self.note = comm, steps, start, note
        self.loss = None
        self._t0 = 0.0
        self._bar = None

    def __iter__(self):
        self._bar = Progress(self.steps - self.start, "train", comm=self.comm)
        for step in range(self.start, self.steps):
            self._t0 = time.perf_counter()
            yield step
        self._bar.close()
        if self.comm.rank == 0 and self.loss is not None:
            print(f"final loss {self.loss:.6e} after {self.steps} steps{self.note}", flush=True)

    def record(self, loss: torch.Tensor) -> None:
        self.loss = loss.item()  # a global mean: the same on every rank
        self._bar.update(loss=f"{self.loss:.3e}",
                         step=f"{(time.perf_counter() - self._t0) * 1e3:.0f} ms")


def refuse(comm, message: str) -> None:
    """Local decision, taken alike on every rank: stop with ``message`` (printed
    once, by rank 0) and exit status 2, as argparse does for a bad option."""
    if comm.rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_against_one_process(comm, model: torch.nn.Module, sample: torch.Tensor,
                              grid: dp.ProcessGrid, shard: dict) -> None:
    """Collective. The trained ``model`` on the whole ``sample`` (a global tensor,
    the same on every rank) cut by ``shard`` over ``grid`` and wrapped in
    DomainParallel, against a copy of it run by this process alone on the whole
    sample: the output, the input gradient and every parameter gradient.

    Done in float64 so that a difference means a bug, not rounding (float32 sums
    taken in another order differ in their last bits). Prints the largest
    relative differences and "matches one process", or what differs, and exits
    with status 1.
    """
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)  # gradients of the last step would add up
    model.double()
    try:
        errors = assert_matches_single_process(
            model, sample.detach().double(), grid, shard,
            wrap=lambda m: dp.DomainParallel(m, grid))
    except AssertionError as exc:
        if comm.rank == 0:
            print(f"FAILED: {exc}", flush=True)
        raise SystemExit(1) from exc
    if comm.rank == 0:
        grads = [e for what, e in errors.items() if what.startswith("gradient of")]
        print(f"float64 check, {comm.size} rank(s) against one process: largest relative "
              f"difference of the output {errors['output']:.1e}, the input gradient "
              f"{errors['input 0 gradient']:.1e}, {len(grads)} parameter gradients "
              f"{max(grads, default=0.0):.1e}")
        print("matches one process", flush=True)
