"""`domainpar info | bench`: the command line.

MPI is started only after argument parsing, so `--help` is instant and a
benchmark asked for N ranks outside mpiexec can relaunch itself under mpiexec.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_ID", "MPI_LOCALNRANKS")


def _positive(kind):
    """argparse type: a number of ``kind`` greater than zero."""
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _under_launcher() -> bool:
    return any(v in os.environ for v in _LAUNCHER_VARS)


def mpiexec_path() -> str:
    """The MPI launcher on PATH (exits with a message when there is none)."""
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        sys.exit("domainpar: mpiexec not found; run this command under your MPI launcher")
    return mpiexec


def mpiexec_env() -> dict:
    """The environment for a job this command launches."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")  # more ranks than cores is fine here
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def _relaunch(nprocs: int) -> int:
    """Run this same command under ``mpiexec -n nprocs`` and return its exit code."""
    cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, "-m", "domainpar.cli",
           *sys.argv[1:]]
    print("domainpar: launching", " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=mpiexec_env())


def _info(args) -> int:
    from .comm import capabilities, init
    comm = init()
    report = capabilities()
    report["torch"] = _torch_report()
    if comm.Get_rank() == 0:
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            width = max(map(len, report))
            for key, value in report.items():
                print(f"{key:<{width}}  {value}")
    return 0


def _torch_report() -> str:
    try:
        import torch
    except Exception as exc:
        return f"not installed ({type(exc).__name__})"
    cuda = (f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)"
            if torch.cuda.is_available() else "no CUDA device")
    return f"{torch.__version__}, {cuda}"


def _bench_halo(args) -> int:
    from .bench import halo
    from .comm import init
    init()
    halo.run(dims=args.dims, faces_mib=args.faces, width=args.width, block=args.block,
             repeats=args.repeats, out=args.out)
    return 0


def _bench_grads(args) -> int:
    from .bench import grads
    from .comm import init
    init()
    grads.run(layers=args.layers, width=args.width, side=args.side, repeats=args.repeats,
              out=args.out)
    return 0


def _bench_io(args) -> int:
    from .bench import io
    from .comm import init
    init()
    io.run(samples=args.samples, channels=args.channels, side=args.side, repeats=args.repeats,
           compute_ms=args.compute_ms, directory=args.dir, out=args.out)
    return 0


def _bench_conv(args) -> int:
    from .bench import conv
    if _under_launcher():
        sys.exit("domainpar bench conv launches its own jobs (N ranks and one process); "
                 "run it without mpiexec")
    conv.run(nprocs=args.nprocs, cases=args.cases, repeats=args.repeats,
             memory_repeats=args.memory_repeats, probe_repeats=args.probe_repeats,
             unet=args.unet, unet_shape=args.unet_shape, scale=args.scale, out=args.out)
    return 0


def _bench_attention(args) -> int:
    from .bench import attention
    attention.run(tokens=args.tokens, heads=args.heads, head_dim=args.head_dim,
                  causal=args.causal, repeats=args.repeats, out=args.out)
    return 0


def _add_nprocs(parser: argparse.ArgumentParser) -> None:
    """The ranks option every MPI benchmark takes."""
    parser.add_argument("-n", "--nprocs", type=_positive(int), default=2,
                        help="ranks to launch with mpiexec when not already under a "
                             "launcher (default 2)")


def _ops(args) -> int:
    from .ops import table
    return table.main(["--write", args.write] if args.write else [])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="domainpar",
                                     description="Domain parallelism for scientific ML on MPI.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="MPI library, CUDA-aware MPI, CuPy, torch, h5py, "
                                       "native kernels")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.set_defaults(run=_info, nprocs=1)

    ops = sub.add_parser("ops", help="the table of torch ops that work on DomainTensors",
                         description="Print the table of torch ops that work on DomainTensors "
                         "(Markdown), generated from the dispatch table, or rewrite it in a "
                         "file between its markers.")
    ops.add_argument("--write", metavar="FILE",
                     help="replace the table between the op-table markers in FILE (README.md)")
    ops.set_defaults(run=_ops, nprocs=1)

    bench = sub.add_parser("bench", help="benchmarks (JSON out)")
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
    halo.add_argument("--faces", type=_positive(float), nargs="+", default=[1, 4, 16, 64],
                      help="face sizes in MiB (default: 1 4 16 64)")
    halo.add_argument("--width", type=_positive(int), default=1, help="halo width (default 1)")
    halo.add_argument("--block", type=_positive(int), default=8,
                      help="block extent along the sharded axis (default 8)")
    halo.add_argument("--repeats", type=_positive(int), default=11,
                      help="timed runs per path (default 11; halved for faces > 16 MiB)")
    halo.add_argument("--out", default="bench-out/halo.json", help="JSON output path")
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
    grads.add_argument("--layers", type=_positive(int), default=20, help="layers (default 20)")
    grads.add_argument("--width", type=_positive(int), default=700,
                       help="channels per layer (default 700: 9.8M parameters with 20 layers)")
    grads.add_argument("--side", type=_positive(int), default=16,
                       help="spatial side of the (1, side, side, width) field (default 16)")
    grads.add_argument("--repeats", type=_positive(int), default=7,
                       help="timed steps per variant (default 7)")
    grads.add_argument("--out", default="bench-out/grads.json", help="JSON output path")
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
    attention.add_argument("--tokens", type=_positive(int), nargs="+",
                           default=[16384, 32768, 65536],
                           help="sequence lengths (default: 16384 32768 65536)")
    attention.add_argument("--heads", type=_positive(int), default=1, help="heads (default 1)")
    attention.add_argument("--head-dim", type=_positive(int), default=32,
                           help="channels per head (default 32)")
    attention.add_argument("--causal", action="store_true", help="is_causal=True")
    attention.add_argument("--repeats", type=_positive(int), default=3,
                           help="timed steps per side (default 3)")
    attention.add_argument("--out", default="bench-out/attention.json", help="JSON output path")
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
    conv.add_argument("--repeats", type=_positive(int), default=7,
                      help="timed steps per side (default 7)")
    conv.add_argument("--memory-repeats", type=_positive(int), default=2,
                      help="fresh jobs per memory measurement, side and allocator setting "
                           "(default 2)")
    conv.add_argument("--probe-repeats", type=_positive(int), default=5,
                      help="timed runs of the interior/boundary split probe (default 5)")
    conv.add_argument("--unet", default="domainpar.bench.conv:small_unet",
                      help="MODULE:CALLABLE that takes the input's channel count and returns "
                           "the model of the memory-measured training step (default: a small "
                           "3-D UNet-like net)")
    conv.add_argument("--unet-shape", type=_positive(int), nargs="+", default=[1, 2, 64, 64, 64],
                      help="its input shape (default 1 2 64 64 64)")
    conv.add_argument("--scale", type=_positive(float), default=1.0,
                      help="multiply every spatial size by this, for a quick run (default 1)")
    conv.add_argument("--out", default="bench-out/conv.json", help="JSON output path")
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
    io.add_argument("--samples", type=_positive(int), default=8, help="samples (default 8)")
    io.add_argument("--channels", type=_positive(int), default=2, help="channels (default 2)")
    io.add_argument("--side", type=_positive(int), default=2048,
                    help="H = W of a sample (default 2048: 32 MiB per sample)")
    io.add_argument("--repeats", type=_positive(int), default=5,
                    help="timed epochs per path (default 5)")
    io.add_argument("--compute-ms", type=float, default=None,
                    help="the stand-in step per sample in ms (default: one sample's read time)")
    io.add_argument("--dir", default=None, help="where the temporary file goes (default: $TMPDIR)")
    io.add_argument("--out", default="bench-out/io.json", help="JSON output path")
    io.set_defaults(run=_bench_io)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "benchmark", None) == "halo" and args.block < args.width:
        parser.error(f"--block {args.block} must be at least --width {args.width} "
                     "(the raw baselines send one face per neighbour)")
    if args.nprocs > 1 and not _under_launcher() and not getattr(args, "launches_jobs", False):
        return _relaunch(args.nprocs)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
