"""`domainpar plan`: its parser and runner (torch and MPI load only when it runs)."""
from __future__ import annotations

import argparse
import json
import sys

from ..launch import positive
from .units import parse_bytes

DESCRIPTION = """\
Estimate a model's per-rank peak memory for training and for inference on a
field of a given shape, for process grids of 1, 2, 3, 4, 6, 8, 12, 16 ...
ranks; recommend a grid per rank count (which dims to shard, how many ranks
along each) and name the smallest rank count that fits a per-device budget.

How: the model is run for real on a few scaled-down blocks of the field, in
this one process, and its peak of live tensor memory is measured for two
training steps (forward, backward, optimizer step: the second holds the
optimizer's state) and for one forward pass under no_grad. Each block runs as
a DomainTensor on a one-rank grid sharding every shardable dim, which is what
a rank of a sharded run holds (halo-padded conv inputs, halo slabs,
DomainParallel's gradient buckets). A least-squares line
  peak = a + b * cells + c * faces
(cells: the block's elements; faces: its cross-sections over the shardable
dims, where the halos are) is fitted to the points and evaluated at each
grid's largest block: a holds the replicated parameters, gradients and
optimizer state, b the activations. One rank means domainpar on a one-rank
grid (plain torch may differ: on CPU it runs small 3-D convs by im2col, with
large scratch buffers, where domainpar calls oneDNN). On CPU the bytes come
from the profiler's allocation records, on CUDA from max_memory_allocated;
neither counts allocator caches, MPI's buffers or library workspaces outside
torch's allocator, so leave some margin. Ops that move whole blocks between
ranks (the distributed FFT's transposes, ring attention) run locally on a
one-rank grid, so their buffers are missing: FNO2d on 256x256 over 2 ranks
peaked 10% below the training estimate but 40% above the inference one.
--verify measures a real run of the recommended grid on the full field (it
needs the ranks and the memory) and prints it beside the estimate.

Prints how the estimate was made (blocks, fits, R^2), a table, and the line
"smallest rank count that fits the budget" (--memory) or the best grid for
--ranks N. --json writes all of it, with the measured points and residuals."""

EXAMPLES = """\
examples:
  domainpar plan domainpar.testing.models:UNet3d --shape 1 2 256 256 256 --memory 16GiB
  domainpar plan domainpar.testing.models:UNet3d --kwargs '{"width": 16}' \\
      --shape 4 2 128 128 128 --ranks 8 --optimizer sgd
  domainpar plan domainpar.testing.models:UNet3d --kwargs '{"width": 32}' \\
      --shape 1 4 512 512 512 --memory 80GB --device cuda --dtype bfloat16
  domainpar plan domainpar.testing.models:UNet3d --shape 1 2 128 128 128 --ranks 2 --verify"""


def _memory(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _kwargs(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({exc.msg})") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--kwargs must be a JSON object, got {text!r}")
    return value


def add_parser(subparsers) -> None:
    """Add `plan` to the top-level subparsers."""
    plan = subparsers.add_parser(
        "plan", help="estimate per-rank memory and recommend a process grid",
        description=DESCRIPTION, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("entry", help="MODULE:CALLABLE returning the torch.nn.Module, e.g. "
                                    "domainpar.testing.models:UNet3d")
    plan.add_argument("--kwargs", type=_kwargs, default={},
                      help="JSON object of keyword arguments for CALLABLE "
                           "(e.g. '{\"width\": 8}'; default: none)")
    plan.add_argument("--shape", type=positive(int), nargs="+", required=True,
                      help="the full input's shape, batch and channels first "
                           "(e.g. 1 2 256 256 256)")
    plan.add_argument("--dtype", default="float32",
                      choices=["float32", "float64", "bfloat16", "float16"],
                      help="parameter and input dtype (default float32)")
    target = plan.add_argument_group("what to plan for (either, both or neither)")
    target.add_argument("--ranks", type=positive(int),
                        help="the rank count you have: rank its grids and name the best")
    target.add_argument("--memory", type=_memory,
                        help="per-device budget, e.g. 16GiB, 80GB, 500MiB: name the smallest "
                             "rank count whose per-rank peak fits it")
    plan.add_argument("--shard-dims", type=int, nargs="+",
                      help="the dims that may be sharded (default: the spatial dims, 2 and up)")
    plan.add_argument("--device", choices=["cpu", "cuda"],
                      help="where to measure, and so the device planned for "
                           "(default: cuda if available, else cpu)")
    plan.add_argument("--optimizer", choices=["adam", "sgd", "none"], default="adam",
                      help="optimizer whose state counts in training: adam (2 tensors per "
                           "parameter), sgd (with momentum: 1), none (default adam)")
    how = plan.add_argument_group("the measurement")
    how.add_argument("--points", type=positive(int), default=4,
                     help="scaled-down blocks to measure (default 4; at least 3 where the "
                          "field allows, whatever the time budget)")
    how.add_argument("--time-budget", type=positive(float), default=60.0,
                     help="seconds for the measurement; larger blocks are measured only while "
                          "it lasts (default 60)")
    how.add_argument("--multiple", type=positive(int),
                     help="measured blocks' extents are multiples of this (default: the "
                          "product of the model's down-sampling strides)")
    how.add_argument("--min-block", type=positive(int),
                     help="flag grids whose blocks have fewer cells than this along a sharded "
                          "dim (default: that product, or the widest kernel if wider)")
    plan.add_argument("--max-ranks", type=positive(int), default=4096,
                      help="the largest rank count searched (default 4096)")
    plan.add_argument("--verify", action="store_true",
                      help="then run the recommended grid for real on the full field under "
                           "mpiexec and print measured against estimated peaks per rank")
    plan.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    plan.set_defaults(run=_plan, nprocs=1)


def _plan(args) -> int:
    from .measure import PlanError
    from .run import run
    try:
        return run(args)
    except PlanError as exc:
        print(f"domainpar plan: {exc}", file=sys.stderr)
        return 2
