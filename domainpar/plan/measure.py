"""Measured peaks: one training step and one inference pass of a model on a
block, the way a rank of a sharded run holds it.

What is counted: the bytes of live tensors at their peak, from building the
model to the end of its second training step (parameters, gradients, the
optimizer's state, the input, the activations saved for backward and every
temporary; the loss is the mean square of the output) or to the end of one
forward pass under ``no_grad``. On CPU the bytes come from the profiler's raw
allocation and free records, every one of them, so that the scratch buffers
an op allocates and frees inside itself count too (``domainpar bench``'s
live-tensor peak sums each op's net memory instead, which misses them: 58 MiB
against 89 MiB for a 64^3 UNet3d step, whose RSS rose 109 MiB). On CUDA the
bytes are the caching allocator's ``max_memory_allocated`` above what was
allocated before. Neither counts the allocator's cached free memory, MPI's
buffers (numpy) or the libraries' own memory.

A sharded rank's pattern is reproduced in one process by running the model on
a DomainTensor over a one-rank grid that shards every shardable dim: every
conv then pads its block with a halo (zeros here, a neighbour's cells in a
real run; the bytes are the same) and the parameters pass through
DomainParallel, so the padded copies, halo slabs and gradient buckets of a
real rank are all counted. A conv's backward goes in pieces on all but tiny
blocks (``ops.conv``); the scaled-down blocks are cut the same way even where
they would be too small, so that they hold per cell what a full-size block
holds. One rank is estimated the same way: plain torch
can differ (on CPU it runs small 3-D convs by im2col, with scratch buffers
many times the input, where domainpar calls oneDNN).

Run as ``python -m domainpar.plan.measure`` under mpiexec, this module
measures a real sharded run on the full field, rank by rank (``domainpar plan
--verify`` and the tests use it to check the estimates).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import torch

from ..bench.timing import profiled_peak_bytes
from ..comm import DomainparError
from .model import features

OPTIMIZERS = ("adam", "sgd", "none")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
START_ELEMENTS = 8192   # the smallest measured block's elements (where the field allows)


class PlanError(DomainparError, ValueError):
    """A model, entry point, shape or option that the planner cannot work with."""


# -- the model --------------------------------------------------------------------------------
def load_factory(entry: str, kwargs: dict | None = None) -> Callable[[], torch.nn.Module]:
    """Local. ``"package.module:callable"`` (called with ``kwargs``) as a
    function returning a fresh model; PlanError on a bad entry point."""
    module_name, sep, name = entry.partition(":")
    if not sep or not module_name or not name:
        raise PlanError(f"entry point {entry!r}: write MODULE:CALLABLE, e.g. "
                        "domainpar.testing.models:UNet3d")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PlanError(f"entry point {entry!r}: cannot import {module_name!r}: {exc}") from exc
    target = module
    for part in name.split("."):
        if not hasattr(target, part):
            raise PlanError(f"entry point {entry!r}: {module_name} has no {name!r}")
        target = getattr(target, part)
    if not callable(target):
        raise PlanError(f"entry point {entry!r}: {name} is not callable")
    kwargs = dict(kwargs or {})

    def build() -> torch.nn.Module:
        try:
            model = target(**kwargs)
        except TypeError as exc:
            raise PlanError(f"entry point {entry!r} with kwargs {kwargs}: {exc}") from exc
        if not isinstance(model, torch.nn.Module):
            raise PlanError(f"entry point {entry!r} returned a {type(model).__name__}, "
                            "not a torch.nn.Module")
        return model
    return build


_DOWNSAMPLERS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.MaxPool1d,
                 torch.nn.MaxPool2d, torch.nn.MaxPool3d, torch.nn.AvgPool1d, torch.nn.AvgPool2d,
                 torch.nn.AvgPool3d)


def constraints(model: torch.nn.Module) -> tuple[int, int]:
    """Local. ``(multiple, min_block)`` read off the layers: ``multiple`` is the
    product of the down-sampling strides (a UNet's ``2**(levels-1)``, a patch
    embedding's patch size), so a block of that many cells keeps one at the
    coarsest level; ``min_block`` is that or the widest kernel, if wider."""
    multiple, kernel = 1, 1
    for layer in model.modules():
        if isinstance(layer, _DOWNSAMPLERS):
            multiple *= max(_tuple(layer.stride))
            size = _tuple(layer.kernel_size)
            dilation = _tuple(getattr(layer, "dilation", 1))
            dilation = dilation * len(size) if len(dilation) == 1 else dilation
            kernel = max(kernel, max((k - 1) * d + 1 for k, d in zip(size, dilation)))
    return multiple, max(multiple, kernel)


def _tuple(v) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


# -- one measured window ----------------------------------------------------------------------
@dataclass
class Setup:
    """What the planner measures: a model factory, the full input ``shape``, the
    shardable ``dims``, dtype, device and optimizer (``adam``: two state tensors
    per parameter; ``sgd``: SGD with momentum, one; ``none``: no step)."""
    factory: Callable[[], torch.nn.Module]
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    optimizer: str = "adam"


def peak_bytes(setup: Setup, block: Sequence[int], train: bool, grid,
               global_shape: Sequence[int] | None = None) -> int:
    """Collective over ``grid``. The peak live-tensor bytes of two training
    steps (``train``) or one inference pass of the model on this rank's
    ``block`` of a DomainTensor over ``grid`` sharding ``setup.dims``
    (``global_shape``: the field, default the block: a one-rank grid)."""
    def work():
        _run(setup, tuple(block), train, grid, tuple(global_shape or block))
    gc.collect()
    if setup.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        work()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - before)
    return profiled_peak_bytes(work)


def _run(setup: Setup, block, train: bool, grid, global_shape) -> None:
    """Build the model and its input on ``block`` and run the step; all freed on return."""
    torch.manual_seed(0)
    model = setup.factory().to(device=setup.device, dtype=setup.dtype)
    model.train(train)
    import domainpar as dp

    from ..comm import Decomposition
    x = dp.DomainTensor(torch.randn(block, dtype=setup.dtype, device=setup.device),
                        Decomposition(global_shape, grid, {d: i for i, d in enumerate(setup.dims)}))
    if not train:
        with torch.no_grad():
            _output(model, x)
        return
    model = dp.DomainParallel(model, grid)
    opt = _optimizer(setup.optimizer, model.parameters())
    for _ in range(2):  # the second step holds the optimizer's state
        model.zero_grad(set_to_none=True)
        _output(model, x).pow(2).mean().backward()
        if opt is not None:
            opt.step()


def _output(model, x) -> torch.Tensor:
    out = model(x)
    if not isinstance(out, torch.Tensor):
        raise PlanError(f"the model returned a {type(out).__name__}; the planner needs a "
                        "tensor (its loss is the mean square of the output)")
    return out


def _optimizer(name: str, params):
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if name == "none":
        return None
    raise PlanError(f"optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")


# -- the scaled-down points -------------------------------------------------------------------
@dataclass
class Point:
    """One measured block's peaks, in bytes."""
    block: tuple[int, ...]
    cells: int
    faces: int
    train: int
    inference: int
    seconds: float

    def as_dict(self) -> dict:
        """Local. The measurement as a plain dict (for JSON)."""
        return asdict(self)


def ladder(shape: Sequence[int], dims: Sequence[int], multiple: int,
           min_block: int) -> Iterator[tuple[int, ...]]:
    """Local. Growing blocks to measure. The other dims keep their full extent;
    the shardable dims start at one side, the least that gives the block
    ``START_ELEMENTS`` elements (but at least ``min_block``, and at most half the
    field's smallest shardable extent), rounded up to ``multiple``, and grow so
    that the elements about double per step (each dim by at least
    ``multiple``), capped at the field. Stops once the block is the whole field."""
    n = len(dims)
    fixed = math.prod(e for d, e in enumerate(shape) if d not in dims)
    side = math.ceil((START_ELEMENTS / fixed) ** (1 / n))
    start = max(min_block, min(side, min(shape[d] for d in dims) // 2))
    block = list(shape)
    for step in range(10_000):
        target = start * 2 ** (step / n)
        grown = list(block)
        for d in dims:
            side = _round_up(target, multiple)
            grown[d] = min(shape[d], side if step == 0 else max(side, block[d] + multiple))
        if step and grown == block:
            return
        block = grown
        yield tuple(block)
        if block == list(shape):
            return


def _round_up(value: float, multiple: int) -> int:
    return max(multiple, multiple * math.ceil(value / multiple - 1e-9))


def measure(setup: Setup, points: int, budget_s: float, multiple: int, min_block: int,
            progress=None) -> tuple[list[Point], list[str]]:
    """Local. Measure up to ``points`` blocks from ``ladder`` (at least three
    where the field has them, more only while ``budget_s`` seconds last), on a
    one-rank grid. A block the model fails on (too small for it: a BatchNorm
    with one value, a halo wider than the block ...) is skipped and its error
    kept; an op domainpar has no rule for is a PlanError at once. Returns the
    points and the skipped blocks' errors."""
    from mpi4py import MPI

    from ..comm import ProcessGrid
    from ..ops.conv import backward_in_pieces_at_any_size
    grid = ProcessGrid((1,) * len(setup.dims), comm=MPI.COMM_SELF)
    # A full-size block's conv backward goes in pieces; a scaled-down one must too.
    with backward_in_pieces_at_any_size():
        return _measure_ladder(setup, grid, points, budget_s, multiple, min_block, progress)


def _measure_ladder(setup: Setup, grid, points: int, budget_s: float, multiple: int,
                    min_block: int, progress) -> tuple[list[Point], list[str]]:
    """``measure``'s loop over the block sizes."""
    from ..tensor import UnsupportedOpError
    measured: list[Point] = []
    failures: list[str] = []
    t0 = time.perf_counter()
    last = 0.0
    for block in ladder(setup.shape, setup.dims, multiple, min_block):
        spent = time.perf_counter() - t0
        if len(measured) >= points or (len(measured) >= 3 and spent + 2.5 * last > budget_s):
            break
        start = time.perf_counter()
        try:
            train, inference = (peak_bytes(setup, block, mode, grid) for mode in (True, False))
        except (PlanError, UnsupportedOpError) as exc:
            raise PlanError(f"the model cannot run sharded over dims {list(setup.dims)}: "
                            f"{exc}") from exc
        except (RuntimeError, ValueError, IndexError) as exc:
            failures.append(f"{_shape(block)}: {type(exc).__name__}: {exc}")
            if len(failures) >= 4 and not measured:
                break
            continue
        last = time.perf_counter() - start
        cells, faces = features(block, setup.dims)
        measured.append(Point(tuple(block), cells, faces, train, inference, last))
        if progress is not None:
            from .units import format_bytes
            progress.update(block=_shape(block), train=format_bytes(train),
                            inference=format_bytes(inference))
    if len({p.cells for p in measured}) < 2:
        detail = "; ".join(failures[-2:]) or "the field has only one block size to measure"
        raise PlanError(f"could not measure the model on two block sizes ({detail})")
    return measured, failures


def _shape(block) -> str:
    return "x".join(map(str, block))


# -- a real sharded run (under mpiexec) -------------------------------------------------------
def measure_grid(setup: Setup, ranks: Sequence[int]) -> dict:
    """Collective over COMM_WORLD (whose size is the product of ``ranks``). Each
    rank's measured peaks of the sharded run on the full field over
    ``ProcessGrid(ranks)``:
    ``{"train": [bytes per rank], "inference": [...]}`` on every rank."""
    from ..comm import Decomposition, ProcessGrid, init
    comm = init()
    grid = ProcessGrid(tuple(ranks), comm=comm)
    block = Decomposition(setup.shape, grid,
                          {d: i for i, d in enumerate(setup.dims)}).local_shape()
    return {mode: comm.allgather(peak_bytes(setup, block, mode == "train", grid, setup.shape))
            for mode in ("train", "inference")}


def setup_from(entry: str, kwargs: dict, shape, dims, dtype: str, device: str,
               optimizer: str) -> Setup:
    """Local. A Setup from command-line values."""
    if dtype not in DTYPES:
        raise PlanError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return Setup(load_factory(entry, kwargs), tuple(shape), tuple(dims), DTYPES[dtype], device,
                 optimizer)


def main(argv=None) -> int:
    """``python -m domainpar.plan.measure ENTRY --shape ... --grid ...``: a real run's
    per-rank peaks as JSON (rank 0 prints, or writes ``--out``)."""
    parser = argparse.ArgumentParser(prog="python -m domainpar.plan.measure",
                                     description=main.__doc__)
    parser.add_argument("entry")
    parser.add_argument("--kwargs", default="{}")
    parser.add_argument("--shape", type=int, nargs="+", required=True)
    parser.add_argument("--dims", type=int, nargs="+", required=True)
    parser.add_argument("--grid", type=int, nargs="+", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    setup = setup_from(args.entry, json.loads(args.kwargs), args.shape, args.dims, args.dtype,
                       args.device, args.optimizer)
    result = measure_grid(setup, args.grid)
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 0:
        text = json.dumps({"grid": args.grid, "shape": args.shape, **result})
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        else:
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
