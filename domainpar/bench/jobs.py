"""Jobs that a benchmark launches itself (``bench conv``, ``bench scaling``): a
worker module run under mpiexec whose rank 0 writes its result as JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import settings as settings_module


def launch(module: str, nprocs: int, worker_args: list[str], result: Path,
           settings: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None):
    """Local. ``python -m module WORKER_ARGS --result RESULT`` on ``nprocs`` ranks,
    in the environment the CLI gives its jobs with configuration ``settings``
    (None: A's) and ``env`` on top; returns the JSON its rank 0 wrote. The
    settings also go to the worker as ``--compare`` words, for it to apply
    in-process (``settings.applied``) what is read once, not from the
    environment at each use."""
    from ..launch import mpiexec_env, mpiexec_path
    cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, "-m", module, *worker_args,
           *settings_module.as_args(settings), "--result", str(result)]
    full = settings_module.environment(settings, mpiexec_env())
    full.update(env or {})
    code = subprocess.call(cmd, env=full)
    if code != 0:
        raise SystemExit(f"{module}: job failed (exit {code}): {' '.join(cmd)}")
    return json.loads(result.read_text())


def write_result(result, path: str) -> None:
    """Collective. Rank 0 writes the job's ``result`` (JSON) where the launcher reads it."""
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(path).write_text(json.dumps(result))


def run_worker(args: Any, measure: Callable[[], Any]) -> int:
    """Collective (as ``measure`` is). A worker's body: one torch thread per rank,
    ``measure()`` under configuration B's in-process settings when
    ``args.compare`` names them, its result written to ``args.result``; 0."""
    import torch
    torch.set_num_threads(1)
    with settings_module.applied(args.compare):  # also in the job's environment
        result = measure()
    write_result(result, args.result)
    return 0
