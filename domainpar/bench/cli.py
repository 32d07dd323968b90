"""`domainpar bench ...`: the benchmark subcommands' parsers and runners.

Benchmarks import torch and MPI only when they run, so `--help` stays instant.
"""
from __future__ import annotations

import argparse
import os
import sys

from ..launch import positive, under_launcher
from . import settings
from .step import DEFAULT_MODELS, MODELS  # torch-free at import, as --help needs


def _bench_halo(args) -> int:
    from ..comm import init
    from . import halo
    init()
    halo.run(dims=args.dims, faces_mib=args.faces, width=args.width, block=args.block,
             repeats=args.repeats, out=args.out, compare=args.compare)
    return 0


def _bench_grads(args) -> int:
    from ..comm import init
    from . import grads
    init()
    grads.run(layers=args.layers, width=args.width, side=args.side, repeats=args.repeats,
              out=args.out, compare=args.compare)
    return 0


def _bench_io(args) -> int:
    from ..comm import init
    from . import io
    init()
    io.run(samples=args.samples, channels=args.channels, side=args.side, repeats=args.repeats,
           compute_ms=args.compute_ms, directory=args.dir, out=args.out,
           compare=args.compare)
    return 0


def _bench_conv(args) -> int:
    from . import conv
    if under_launcher():
        sys.exit("domainpar bench conv launches its own jobs (N ranks and one process); "
                 "run it without mpiexec")
    conv.run(nprocs=args.nprocs, cases=args.cases, repeats=args.repeats,
             memory_repeats=args.memory_repeats, probe_repeats=args.probe_repeats,
             unet=args.unet, unet_shape=args.unet_shape, scale=args.scale, out=args.out,
             compare=args.compare)
    return 0


def _bench_attention(args) -> int:
    from . import attention
    attention.run(tokens=args.tokens, heads=args.heads, head_dim=args.head_dim,
                  causal=args.causal, repeats=args.repeats, out=args.out,
                  compare=args.compare)
    return 0


def _bench_scaling(args) -> int:
    from . import scaling
    if under_launcher():
        sys.exit("domainpar bench scaling launches its own jobs (one per rank count); "
                 "run it without mpiexec")
    try:
        shapes = scaling.shapes(args.model, args.side, args.strong_shape, args.weak_block)
    except ValueError as e:
        sys.exit(f"domainpar bench scaling: {e}")
    scaling.run(nprocs=args.nprocs, ranks=args.ranks, strong_shape=shapes[0],
                weak_block=shapes[1], repeats=args.repeats, width=args.width,
                levels=args.levels, modes=args.modes, out=args.out, compare=args.compare,
                model=args.model, inference=args.inference, rounds=args.rounds,
                contention=args.contention)
    return 0


def _bench_balance(args) -> int:
    from ..comm import init
    from . import balance
    init()
    balance.run(cases=args.cases, side=args.side, channels=args.channels, layers=args.layers,
                points=args.points, cluster=args.cluster, passes=args.passes,
                slow_rank=args.slow_rank, settle=args.settle, repeats=args.repeats,
                clock_kind=args.clock, out=args.out)
    return 0


def _bench_step(args) -> int:
    from . import stepreport as step
    if under_launcher():
        sys.exit("domainpar bench step launches its own jobs (one per rank count); "
                 "run it without mpiexec")
    step.run(ranks=args.ranks, models=args.models, unet_side=args.unet_side,
             field_side=args.field_side, levels=args.levels, repeats=args.repeats,
             out=args.out, compare=args.compare, inference=args.inference)
    return 0


def _bench_points(args) -> int:
    from . import points
    points.run(points=args.points, k=args.k, cluster=args.cluster, kinds=args.kinds,
               repeats=args.repeats, out=args.out)
    return 0


def _count(text: str) -> int:
    """argparse type: a whole number >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _add_out(parser: argparse.ArgumentParser, name: str) -> None:
    """The output option every benchmark takes."""
    parser.add_argument("--out", default=f"bench-out/{name}.json",
                        help=f"JSON output path; the PNG goes beside it, same name with .png "
                             f"(default bench-out/{name}.json)")


def _add_nprocs(parser: argparse.ArgumentParser) -> None:
    """The ranks option every MPI benchmark takes."""
    parser.add_argument("-n", "--nprocs", type=positive(int), default=2,
                        help="ranks to launch with mpiexec when not already under a "
                             "launcher (default 2)")


def add_parser(subparsers) -> None:
    """Add `bench` and its subcommands to the top-level subparsers."""
    bench = subparsers.add_parser(
        "bench", help="benchmarks (table, JSON and PNG out; --compare times a second "
                      "configuration beside the first)",
        description="Benchmarks. Each prints a table on stdout and progress on stderr, and "
                    "writes JSON (--out) and a PNG of it beside it (same name, .png; "
                    "matplotlib needed). Each takes --compare KEY=VALUE ...: a second "
                    "configuration B, the environment with those domainpar settings "
                    "changed, timed beside the first (A, the environment as it is), "
                    "interleaved sample by sample in one run (conv and scaling, which "
                    "launch their own jobs, alternate A's and B's jobs); the JSON gets both "
                    "(B's figures under \"B\") and the B/A median ratios "
                    "(\"ratio_B_over_A\"). Keys: " + ", ".join(settings.KEYS) + ".")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    halo = bench_sub.add_parser(
        "halo", help="HaloExchange.fill against raw mpi4py Sendrecv of the same bytes",
        description="Times HaloExchange.fill against raw mpi4py Sendrecv of contiguous "
                    "buffers of the same bytes between the same ranks, interleaved in one "
                    "run, for 2-D and 3-D float32 fields sharded along each axis in turn. "
                    "Beside them: fill without its agreement allreduce, fill with strided "
                    "faces forced through the C pack kernels, numpy, or MPI derived "
                    "datatypes, and raw Sendrecv with MPI subarray datatypes. Prints a "
                    "table of medians and writes JSON.")
    _add_nprocs(halo)
    halo.add_argument("--dims", type=int, nargs="+", default=[2, 3], choices=[2, 3],
                      help="field dimensionalities (default: 2 3)")
    halo.add_argument("--faces", type=positive(float), nargs="+", default=[1, 4, 16, 64],
                      help="face sizes in MiB (default: 1 4 16 64)")
    halo.add_argument("--width", type=positive(int), default=1, help="halo width (default 1)")
    halo.add_argument("--block", type=positive(int), default=8,
                      help="block extent along the sharded axis (default 8)")
    halo.add_argument("--repeats", type=positive(int), default=11,
                      help="timed runs per path (default 11; halved for faces > 16 MiB)")
    _add_out(halo, "halo")
    settings.add_argument(halo)
    halo.set_defaults(run=_bench_halo)

    grads = bench_sub.add_parser(
        "grads", help="training step with DomainParallel against per-op gradient reductions",
        description="Times one training step (forward, global loss, backward, SGD) of a "
                    "stack of Linear+tanh layers over the channel dim of a field sharded "
                    "over all ranks, three ways interleaved in one run: per-op gradient "
                    "reductions, DomainParallel with nonblocking bucketed reductions "
                    "overlapped with backward, and DomainParallel with blocking ones per "
                    "bucket (overlap=False). Prints medians, their ratios to per-op and "
                    "allreduce counts; writes JSON.")
    _add_nprocs(grads)
    grads.add_argument("--layers", type=positive(int), default=20, help="layers (default 20)")
    grads.add_argument("--width", type=positive(int), default=700,
                       help="channels per layer (default 700: 9.8M parameters with 20 layers)")
    grads.add_argument("--side", type=positive(int), default=16,
                       help="spatial side of the (1, side, side, width) field (default 16)")
    grads.add_argument("--repeats", type=positive(int), default=7,
                       help="timed steps per variant (default 7)")
    _add_out(grads, "grads")
    settings.add_argument(grads)
    grads.set_defaults(run=_bench_grads)

    attention = bench_sub.add_parser(
        "attention", help="ring attention (SDPA) on N ranks against one process: speedup, "
                          "exposed communication, per-rank memory",
        description="F.scaled_dot_product_attention forward and .sum().backward() on q, k, v "
                    "of shape (1, heads, T, head_dim), float32, sharded along the sequence "
                    "over all ranks (ring attention), against torch's fused kernel on the "
                    "whole tensors in one process, interleaved step by step in one job. "
                    "Reports per sequence length the speedup, the ring's communication left "
                    "exposed beside the same transfers alone, and the live-tensor peak per "
                    "rank against one process. Prints a table; writes JSON.")
    _add_nprocs(attention)
    attention.add_argument("--tokens", type=positive(int), nargs="+",
                           default=[16384, 32768, 65536],
                           help="sequence lengths (default: 16384 32768 65536)")
    attention.add_argument("--heads", type=positive(int), default=1, help="heads (default 1)")
    attention.add_argument("--head-dim", type=positive(int), default=32,
                           help="channels per head (default 32)")
    attention.add_argument("--causal", action="store_true", help="is_causal=True")
    attention.add_argument("--repeats", type=positive(int), default=3,
                           help="timed steps per side (default 3)")
    _add_out(attention, "attention")
    settings.add_argument(attention)
    attention.set_defaults(run=_bench_attention)

    conv = bench_sub.add_parser(
        "conv", help="conv forward+backward on N ranks against one process: speedup, "
                     "per-rank peak memory, exposed halo time",
        description="Conv3d(4, 4, 3, padding=1) on 1x4x128^3 and Conv2d(8, 8, 3, padding=1) "
                    "on 1x8x1024^2, float32, sharded along dim 2, one torch thread per rank: "
                    "forward and .mean().backward() on N ranks against one process, "
                    "interleaved step by step in one N-rank job (the one-process step runs "
                    "on rank 0 while the others sleep). Reports the speedup (of wall and of "
                    "CPU time), the halo time left exposed, where the time goes (profiler), "
                    "the cost of splitting the conv into interior and boundary (what "
                    "overlapping the exchange needs), and, each in a fresh job, per-rank "
                    "peak memory above the import baseline of the conv steps and of a "
                    "training step of a small 3-D UNet-like net (glibc's default malloc, "
                    "and with a fixed mmap threshold, where RSS follows live memory). "
                    "Targets: speedup >= 1.9 (3-D); UNet memory ratio <= 0.55. Run it "
                    "without mpiexec: it launches its own jobs. Prints a summary; writes "
                    "JSON.")
    _add_nprocs(conv)
    conv.add_argument("--cases", nargs="+", choices=["conv3d", "conv2d"],
                      default=["conv3d", "conv2d"], help="conv cases (default: both)")
    conv.add_argument("--repeats", type=positive(int), default=7,
                      help="timed steps per side (default 7)")
    conv.add_argument("--memory-repeats", type=_count, default=2,
                      help="fresh jobs per memory measurement, side and allocator setting "
                           "(default 2; 0 measures no memory)")
    conv.add_argument("--probe-repeats", type=positive(int), default=5,
                      help="timed runs of the interior/boundary split probe (default 5)")
    conv.add_argument("--unet", default="domainpar.bench.conv:small_unet",
                      help="MODULE:CALLABLE that takes the input's channel count and returns "
                           "the model of the memory-measured training step (default: a small "
                           "3-D UNet-like net)")
    conv.add_argument("--unet-shape", type=positive(int), nargs="+", default=[1, 2, 64, 64, 64],
                      help="its input shape (default 1 2 64 64 64)")
    conv.add_argument("--scale", type=positive(float), default=1.0,
                      help="multiply every spatial size by this, for a quick run (default 1)")
    _add_out(conv, "conv")
    settings.add_argument(conv)
    conv.set_defaults(run=_bench_conv, launches_jobs=True)

    io = bench_sub.add_parser(
        "io", help="ShardedDataset read throughput against raw h5py hyperslab reads, "
                   "collective against independent",
        description="Writes N float32 samples (C, side, side) into one HDF5 dataset in a "
                    "temporary directory, then times epochs of reading every rank's block "
                    "(sharded along H) of every sample, interleaved: ShardedDataset against "
                    "raw h5py hyperslab reads by the same ranks, with collective and with "
                    "independent MPI-IO transfers, and the serial fallback; and an epoch with "
                    "a stand-in training step per sample with and without prefetch. The file "
                    "sits in the page cache: the figures are HDF5, MPI-IO and library "
                    "overhead, not disk bandwidth. Prints a table; writes JSON.")
    _add_nprocs(io)
    io.add_argument("--samples", type=positive(int), default=8, help="samples (default 8)")
    io.add_argument("--channels", type=positive(int), default=2, help="channels (default 2)")
    io.add_argument("--side", type=positive(int), default=2048,
                    help="H = W of a sample (default 2048: 32 MiB per sample)")
    io.add_argument("--repeats", type=positive(int), default=5,
                    help="timed epochs per path (default 5)")
    io.add_argument("--compute-ms", type=float, default=None,
                    help="the stand-in step per sample in ms (default: one sample's read time)")
    io.add_argument("--dir", default=None, help="where the temporary file goes (default: $TMPDIR)")
    _add_out(io, "io")
    settings.add_argument(io)
    io.set_defaults(run=_bench_io)

    scaling = bench_sub.add_parser(
        "scaling", help="strong and weak scaling of a training step or inference forward "
                        "(UNet3d, ViT2d, FNO2d) over 1..N ranks",
        description="Times one training step (forward, MSE loss, backward, SGD step) or, "
                    "with --inference, one forward (eval mode, torch.no_grad) of a model of "
                    "domainpar.testing.models in DomainParallel: --model unet3d (width 4, 4 "
                    "levels, field 1x2xSxSxS), vit2d or fno2d (field 1x1xSxS; the models "
                    "of `bench step`) or resnet3d (field 1x2xSxSxS), float32, sharded "
                    "along dim 2, one torch thread per rank, on 1, 2, 4, ... N ranks, each "
                    "rank count in its own job: strong "
                    "scaling (a fixed global field; speedup T1 / Tn, efficiency "
                    "T1 / (n Tn)) and weak scaling (a fixed block per rank, the global "
                    "extent along dim 2 growing with the ranks; efficiency T1 / Tn). "
                    "--rounds R runs the jobs R times, alternating rank counts, and pools "
                    "the samples (medians of interleaved runs), and prints each rank "
                    "count's efficiency round by round (its job against the fewest ranks' job of "
                    "that round): how far the machine moved it. Strong scaling at a rank "
                    "count whose block the weak run's 1-rank job also ran (2, by default) "
                    "gets a ceiling, T1 / (n x the 1-rank step on that block): what it "
                    "would reach if each rank took what one process takes on its block "
                    "alone, and the efficiency against it. More ranks than cores "
                    "oversubscribe them: the output says how many cores there are. Run it "
                    "without mpiexec: it launches its own jobs. Prints a table; writes JSON "
                    "(model, mode, machine: cores and load average at start and end) and a "
                    "PNG of step time and efficiency against ranks. examples/scaling.py "
                    "times the same step at one rank count. Example, issue 24's targets: "
                    "--model unet3d --side 128 --ranks 1 2 --rounds 3.")
    scaling.add_argument("-n", "--nprocs", type=positive(int), default=os.cpu_count() or 1,
                         help="the most ranks: 1, 2, 4, ... up to N, and N (default: the "
                              f"core count, {os.cpu_count()} here)")
    scaling.add_argument("--ranks", type=positive(int), nargs="+", default=None,
                         help="the rank counts to run instead (e.g. 1 2 3 4)")
    scaling.add_argument("--model", choices=MODELS, default="unet3d",
                         help="the model (default unet3d; resnet3d: a norm-free 3-D ResNet "
                              "of width 2 x --width and --levels - 1 residual blocks, whose "
                              "conv chains --compare DOMAINPAR_FUSE_HALOS=1 fuses)")
    scaling.add_argument("--inference", action="store_true",
                         help="time one forward in eval mode under torch.no_grad (no loss, "
                              "no backward) instead of a training step")
    scaling.add_argument("--contention", action="store_true",
                         help="also time, beside each multi-rank step, every rank running "
                              "the step on a block of its size over a one-rank grid, all at "
                              "once and with no messages: what the machine's shared caches "
                              "and memory bandwidth cost; efficiency against it is "
                              "domainpar's own share (doubles the run time)")
    scaling.add_argument("--side", type=positive(int), default=None,
                         help="the field's side S: strong scaling's global field is "
                              "1x2xSxSxS (unet3d, resnet3d) or 1x1xSxS (vit2d, fno2d), weak "
                              "scaling's "
                              "block per rank is that field with S/2 along dim 2 (default: "
                              "64 for unet3d and resnet3d, 256 for vit2d, 512 for fno2d)")
    scaling.add_argument("--strong-shape", type=positive(int), nargs="+", default=None,
                         metavar="EXTENT",
                         help="strong scaling's global field instead: N C D H W (3-D models) or "
                              "N C H W (vit2d, fno2d)")
    scaling.add_argument("--weak-block", type=positive(int), nargs="+", default=None,
                         metavar="EXTENT",
                         help="weak scaling's block per rank instead, dim 2 growing with the "
                              "ranks: N C D H W (3-D models) or N C H W (vit2d, fno2d)")
    scaling.add_argument("--modes", nargs="+", choices=["strong", "weak"],
                         default=["strong", "weak"], help="which scalings (default both)")
    scaling.add_argument("--repeats", type=positive(int), default=5,
                         help="timed steps per rank count and round, after one warm-up "
                              "(default 5)")
    scaling.add_argument("--rounds", type=positive(int), default=1,
                         help="run every rank count's job this many times, alternating rank "
                              "counts, and pool the samples; with more than one, the "
                              "efficiency round by round too (default 1)")
    scaling.add_argument("--width", type=positive(int), default=4,
                         help="unet3d: the channels at the first level; resnet3d: half "
                              "its width (default 4)")
    scaling.add_argument("--levels", type=positive(int), default=4,
                         help="unet3d: the levels (default 4; a block's side along dim 2 "
                              "must hold 2**(levels-1) cells); resnet3d: one more than its "
                              "residual blocks")
    _add_out(scaling, "scaling")
    settings.add_argument(scaling)
    scaling.set_defaults(run=_bench_scaling, launches_jobs=True)

    _add_balance(bench_sub)
    _add_points(bench_sub)
    _add_step(bench_sub)
    from .swap import add_parser as add_swap  # torch-free at import, as --help needs
    add_swap(bench_sub, _add_out)


def _add_points(bench_sub) -> None:
    points = bench_sub.add_parser(
        "points", help="point clouds: knn, radius search and a set-abstraction step on N "
                       "ranks against one process; imbalance of clustered data",
        description="Uniform and clustered float64 clouds in the unit cube, spatially "
                    "partitioned by dp.points.partition (recursive coordinate bisection). "
                    "Reports the imbalance (max/mean points per rank) of input-order blocks, "
                    "equal-volume slabs and the partition; knn, radius_search and a "
                    "PointNet++-style set-abstraction step (forward and backward) on N ranks "
                    "against one process, interleaved step by step in one job (speedup), the "
                    "knn halo size, and the step's live-tensor peak per rank against one "
                    "process. Timings on a shared machine are rough: the load average is "
                    "reported. Prints a table; writes JSON.")
    _add_nprocs(points)
    points.add_argument("--points", type=positive(int), default=20_000,
                        help="reference points, and as many queries (default 20000)")
    points.add_argument("-k", type=positive(int), default=16, help="neighbours (default 16)")
    points.add_argument("--cluster", type=float, default=0.8,
                        help="clustered cloud: fraction of the points in one small ball "
                             "(default 0.8)")
    points.add_argument("--kinds", nargs="+", choices=["uniform", "clustered"],
                        default=["uniform", "clustered"], help="clouds (default: both)")
    points.add_argument("--repeats", type=positive(int), default=3,
                        help="timed steps per side (default 3)")
    _add_out(points, "points")
    points.set_defaults(run=_bench_points)


def _add_balance(bench_sub) -> None:
    balance = bench_sub.add_parser(
        "balance", help="dynamic load balancing (dp.Balancer) with one rank slowed: step "
                        "time on even and on balanced blocks, interleaved, against the ideal",
        description="One rank (--slow-rank) is slowed by a per-cell delay spread over the "
                    "step: each layer's forward runs --passes extra times on that rank's "
                    "block, and its backward 2 x --passes extra forwards. A "
                    "dp.Balancer measures --settle steps from even blocks and moves them; "
                    "then the even and the balanced layouts are timed step by step, "
                    "interleaved. Cases: grid (a Conv2d stack on a field sharded along H) "
                    "and points (a pointwise MLP on a clustered point set partitioned by "
                    "dp.points.partition, re-partitioned with capacity=balancer.shares()). "
                    "Reports each layout's median step, the speedup, the ideal step (total "
                    "cells over the sum of the ranks' measured throughputs) and "
                    "balanced/ideal (target <= 1.15), per-rank compute and time blocked in "
                    "communication, and the load average. Prints a table; writes JSON.")
    _add_nprocs(balance)
    balance.add_argument("--cases", nargs="+", choices=["grid", "points"],
                         default=["grid", "points"], help="cases (default: both)")
    balance.add_argument("--side", type=positive(int), default=512,
                         help="grid case: H = W of the (1, C, H, W) field (default 512)")
    balance.add_argument("--channels", type=positive(int), default=16,
                         help="channels C (grid) or features per point (default 16)")
    balance.add_argument("--layers", type=positive(int), default=4,
                         help="conv layers (grid) or MLP layers (points) (default 4)")
    balance.add_argument("--points", type=positive(int), default=400_000,
                         help="points case: points (default 400000)")
    balance.add_argument("--cluster", type=float, default=0.7,
                         help="points case: fraction of the points in one small ball "
                              "(default 0.7)")
    balance.add_argument("--passes", type=_count, default=1,
                         help="extra forwards of each layer on the slowed rank's block, in "
                              "forward (twice as many in backward) (default 1: about twice "
                              "its compute)")
    balance.add_argument("--slow-rank", type=int, default=None,
                         help="the slowed rank (default: the last)")
    balance.add_argument("--settle", type=positive(int), default=16,
                         help="balancer steps before timing (default 16: room for a second "
                              "move, which corrects for fixed costs)")
    balance.add_argument("--repeats", type=positive(int), default=7,
                         help="timed steps per layout (default 7)")
    balance.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                         help="what the Balancer measures compute in: wall time (default) "
                              "or CPU time (steadier on a loaded machine)")
    _add_out(balance, "balance")
    balance.set_defaults(run=_bench_balance)


def _add_step(bench_sub) -> None:
    step = bench_sub.add_parser(
        "step", help="where a training step's time goes, per rank: compute, dispatch, "
                     "halo, allreduce, waiting (UNet3d, ViT2d, FNO2d on 1, 2, 4 ranks)",
        description="One training step (forward, MSE loss, backward, SGD; DomainParallel, "
                    "float32, one torch thread per rank) of UNet3d, ViT2d and FNO2d "
                    "(domainpar.testing.models), sharded along dim 2 over all ranks, each "
                    "rank count in its own job. Each rank's step is split, in one run, into "
                    "local compute, domainpar's Python around the local work of each "
                    "DomainTensor op (dispatch), agreement checks, halo exchange, allreduce, "
                    "other communication, waiting for other ranks inside communication, and "
                    "the instrumentation's own cost; plain steps run interleaved beside the "
                    "instrumented ones. Also times one DomainTensor op against plain torch on "
                    "a one-rank grid for blocks of 1k to 1M cells. --inference splits a "
                    "no_grad forward instead. Run it without mpiexec. "
                    "Prints tables; writes JSON and a stacked-bar PNG (docs/benchmarks.md).")
    step.add_argument("--ranks", type=positive(int), nargs="+", default=[1, 2, 4],
                      help="rank counts, one job each (default 1 2 4)")
    step.add_argument("--models", nargs="+", choices=MODELS, default=list(DEFAULT_MODELS),
                      help="models (default: unet3d vit2d fno2d; resnet3d, a norm-free 3-D "
                           "ResNet on the UNet's field, is the one whose conv chains "
                           "fuse)")
    step.add_argument("--unet-side", type=positive(int), default=64,
                      help="the UNet3d's field: 1x2xS^3 (default 64)")
    step.add_argument("--field-side", type=positive(int), default=128,
                      help="the 2-D models' field: 1x1xS^2 (default 128)")
    step.add_argument("--levels", type=positive(int), default=4,
                      help="the UNet3d's levels (default 4; the field's side per rank must "
                           "hold 2**(levels-1) cells)")
    step.add_argument("--repeats", type=positive(int), default=3,
                      help="instrumented steps per model and rank count, each beside a plain "
                           "one, after one warm-up (default 3)")
    step.add_argument("--inference", action="store_true",
                      help="split one forward in eval mode under torch.no_grad (no loss, no "
                           "backward) instead of a training step")
    _add_out(step, "step")
    settings.add_argument(step)
    step.set_defaults(run=_bench_step, launches_jobs=True, nprocs=1)
