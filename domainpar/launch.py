"""The MPI launch environment: the one place that defines how domainpar starts
a job under mpiexec, and how a process tells that it runs under one.

Local: nothing here communicates. The standard library only (no MPI, no torch,
no other domainpar module), so every layer may use it and ``tests/run_mpi.py``
loads this file without importing domainpar.

Users of ``LAUNCH_ENV``: ``domainpar.cli`` (relaunching a command under
mpiexec), ``bench/`` and ``plan/`` (the jobs they start), ``tests/run_mpi.py``
(the MPI test stages) and the Makefile's ``MPI_RUN_ENV`` (``make demo``,
``make coupling``), which ``tests/test_layers.py`` keeps in step with it.
``positive`` is the argparse type the command families share.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

# Set for a launched job only, never in the caller's shell; the caller's values
# win (``setdefault``), so a site can still choose its own.
LAUNCH_ENV = {
    # CI containers run as root; Open MPI refuses that without both variables
    # (and ignores them for other users).
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    # More ranks than cores is the normal case on a workstation or in CI.
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    # N ranks x M torch threads on few cores only slows every rank down.
    "OMP_NUM_THREADS": "1",
}

# Transports a job can be limited to, as Open MPI 4.1 MCA variables (set for the
# job only; the caller's values win, as for LAUNCH_ENV). "default" leaves the
# choice to Open MPI: shared memory between ranks of one node. "tcp" is its TCP
# byte transfer layer alone over the loopback interface, shared memory (vader)
# off and ob1 as the messaging layer so UCX (which has its own shared memory)
# cannot take over: one machine standing in for the network between nodes, so
# the code path that clusters use runs here. ``tests/run_mpi.py --transport tcp``
# and the Makefile's mpi-tcp stage use it; for any other job (``domainpar bench
# halo``/``grads``) put these variables in its environment, e.g.
#   env OMPI_MCA_btl=tcp,self OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_pml=ob1 \
#       domainpar bench halo -n 2
# To see what Open MPI used, add OMPI_MCA_btl_base_verbose=100: each rank logs
# "Using tcp btl for send to" the others (with "tcp": never "vader").
TRANSPORTS = {
    "default": {},
    "tcp": {
        "OMPI_MCA_btl": "tcp,self",
        "OMPI_MCA_btl_tcp_if_include": "lo",
        "OMPI_MCA_pml": "ob1",
    },
}

# Set in every rank's environment by the usual launchers (Open MPI, MPICH/Hydra
# and PMI, PMIx, srun, Intel MPI).
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_ID",
                 "MPI_LOCALNRANKS")


def mpiexec_env(base: dict | None = None) -> dict:
    """Local. The environment for a job launched under mpiexec: ``base``
    (default ``os.environ``) with ``LAUNCH_ENV`` added where ``base`` does not
    set a variable."""
    env = dict(os.environ if base is None else base)
    for key, value in LAUNCH_ENV.items():
        env.setdefault(key, value)
    return env


def transport_env(name: str, base: dict | None = None) -> dict:
    """Local. ``mpiexec_env(base)`` with the variables of ``TRANSPORTS[name]``
    added where ``base`` does not set them."""
    env = mpiexec_env(base)
    for key, value in TRANSPORTS[name].items():
        env.setdefault(key, value)
    return env


def mpiexec_path() -> str:
    """Local. The MPI launcher on PATH (exits with a message when there is none)."""
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        sys.exit("domainpar: mpiexec not found; run this command under your MPI launcher")
    return mpiexec


def under_launcher() -> bool:
    """Local. True when this process was started by an MPI launcher."""
    return any(v in os.environ for v in LAUNCHER_VARS)


def positive(kind):
    """Local. argparse type: a number of ``kind`` greater than zero."""
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse
