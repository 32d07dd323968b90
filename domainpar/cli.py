"""`domainpar info | ops | bench | plan | demo`: the command line.

Each command family defines its own parser and runner in its own module
(``bench/cli.py``, ...); this file builds the top level and relaunches under
mpiexec (in the launch environment that ``launch.py`` defines).

MPI is started only after argument parsing, so `--help` is instant and a
benchmark asked for N ranks outside mpiexec can relaunch itself under mpiexec.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import subprocess
import sys

from .launch import mpiexec_env, mpiexec_path, under_launcher

# The modules that add a command family: each has ``add_parser(subparsers)``
# and imports torch and MPI only when its command runs.
COMMAND_MODULES = ("domainpar.bench.cli", "domainpar.plan.cli", "domainpar.plan.timecli",
                   "domainpar.demo.cli")


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
    if args.nodes:
        return _nodes(comm, report, args.json)
    if comm.Get_rank() == 0:
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            width = max(map(len, report))
            for key, value in report.items():
                print(f"{key:<{width}}  {value}")
    return 0


def _placement(comm) -> dict:
    """Local. Where this rank runs: host, node-local rank, the cores it may use
    (its CPU affinity), the GPUs it sees."""
    from .comm.runtime import local_rank
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    spans, start = [], None
    for i, c in enumerate(cpus):  # 0,1,2,5 -> "0-2,5"
        start = c if start is None else start
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            spans.append(f"{start}-{c}" if c > start else f"{c}")
            start = None
    return {"rank": comm.Get_rank(), "host": socket.gethostname(), "node_rank": local_rank(),
            "cpus": ",".join(spans), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "all")}


def _nodes(comm, report: dict, as_json: bool) -> int:
    """Collective. Rank 0 prints every node's report (once per distinct report)
    and every rank's placement."""
    everything = comm.gather((_placement(comm), report), root=0)
    if comm.Get_rank() != 0:
        return 0
    hosts: dict = {}
    for place, rep in everything:
        hosts.setdefault(place["host"], {"report": rep, "ranks": []})["ranks"].append(place)
    if as_json:
        print(json.dumps(hosts, indent=1))
        return 0
    print(f"{comm.Get_size()} ranks on {len(hosts)} node(s)")
    for host, h in hosts.items():
        print(f"\n== node {host}: {len(h['ranks'])} rank(s)")
        for p in h["ranks"]:
            print(f"  rank {p['rank']} (node rank {p['node_rank']}): cpus {p['cpus']}, "
                  f"gpus {p['gpus']}")
        width = max(map(len, h["report"]))
        for key, value in h["report"].items():
            print(f"  {key:<{width}}  {value}")
    return 0


def _torch_report() -> str:
    try:
        import torch
    except Exception as exc:
        return f"not installed ({type(exc).__name__})"
    cuda = (f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)"
            if torch.cuda.is_available() else "no CUDA device")
    return f"{torch.__version__}, {cuda}"


def _ops(args) -> int:
    from .ops import table
    return table.main(["--write", args.write] if args.write else [])


def build_parser() -> argparse.ArgumentParser:
    """Local. The ``domainpar`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="domainpar",
                                     description="Domain parallelism for scientific ML on MPI.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="MPI library, CUDA-aware MPI, CuPy, torch, h5py, "
                                       "native kernels")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.add_argument("--nodes", action="store_true",
                      help="every node's report and every rank's placement (host, node rank, "
                           "CPU affinity, visible GPUs); run with all of a job's ranks")
    info.set_defaults(run=_info, nprocs=1)

    ops = sub.add_parser("ops", help="the table of torch ops that work on DomainTensors",
                         description="Print the table of torch ops that work on DomainTensors "
                         "(Markdown), generated from the dispatch table, or rewrite it in a "
                         "file between its markers.")
    ops.add_argument("--write", metavar="FILE",
                     help="replace the table between the op-table markers in FILE (docs/ops.md)")
    ops.set_defaults(run=_ops, nprocs=1)

    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv=None) -> int:
    """Collective when the subcommand is (most run on every rank of the job). The
    ``domainpar`` command: parse ``argv``, relaunch under mpiexec for ``-n`` > 1 when not
    already launched, run the subcommand; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "benchmark", None) == "halo" and args.block < args.width:
        parser.error(f"--block {args.block} must be at least --width {args.width} "
                     "(the raw baselines send one face per neighbour)")
    if args.nprocs > 1 and not under_launcher() and not getattr(args, "launches_jobs", False):
        return _relaunch(args.nprocs)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
