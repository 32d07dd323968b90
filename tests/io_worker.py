"""Jobs the serial dp.io tests launch under mpiexec (tests/test_io_jobs.py).

    python tests/io_worker.py memory DIR RESULT
    python tests/io_worker.py killed-save DIR
    python tests/io_worker.py save-loop DIR
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import time

import h5py
import numpy as np
import torch
from mpi4py import MPI

import domainpar as dp

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
H, W = 4096, 4096  # one float32 sample of 64 MiB; two samples in the dataset


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _settle() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def memory(directory: str, result: str) -> None:
    """Peak RSS of reading one sample's block of a dataset 4x the block, per rank
    and io mode: VmHWM after a reset (clear_refs 5) minus the RSS before."""
    path = os.path.join(directory, "big.h5")
    if RANK == 0:  # a contiguous dataset, as a simulation writes it, slab by slab
        with h5py.File(path, "w") as f:
            dset = f.create_dataset("u", shape=(2, 1, H, W), dtype="f4")
            f.create_dataset("tiny", data=np.zeros((2, 1, 8 * SIZE, 4), "f4"))
            rows = np.arange(H, dtype="f4")[:, None].repeat(W, 1)
            for s in range(2):
                dset[s, 0] = rows + s * H
            del rows
    COMM.Barrier()
    grid = dp.ProcessGrid((SIZE,))
    out = {}
    for mode in ("mpio", "serial") if h5py.get_config().mpi else ("serial",):
        with dp.io.forced_mode(mode):
            # Libraries and MPI-IO components load on first use: not the read's cost.
            dp.io.read(path, "tiny", grid, {2: 0}, index=1)
            _settle()
            COMM.Barrier()
            before = _kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            x = dp.io.read(path, "u", grid, {2: 0}, index=1)
            peak = _kib("VmHWM")
            block = x.to_local()
            rows = torch.arange(x.decomposition.offsets()[2], x.decomposition.offsets()[2]
                                + block.shape[2], dtype=torch.float32) + H
            correct = bool(torch.equal(block[0, 0, :, 0], rows)
                           and torch.equal(block[0, 0, :, -1], rows))
            out[mode] = {"block_kib": block.numel() * 4 // 1024, "rss_before_kib": before,
                         "peak_kib": peak, "rise_kib": peak - before, "correct": correct}
            del x, block
            _settle()
    everyone = COMM.gather(out)
    if RANK == 0:
        with open(result, "w") as f:
            json.dump({"ranks": everyone, "dataset_kib": 2 * H * W * 4 // 1024}, f)


def killed_save(directory: str) -> None:
    """Save checkpoint A, then start saving B and stop inside it (after its first
    tensor is written) until killed."""
    path = os.path.join(directory, "ckpt.h5")
    grid = dp.ProcessGrid((SIZE,))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    u = dp.scatter(torch.arange(8 * SIZE, dtype=torch.float64).reshape(1, 1, -1), grid, {2: 0})
    dp.io.save_checkpoint(path, model, tensors={"u": u}, extra={"name": "A"})
    from domainpar.io import checkpoint
    real_write = checkpoint.write

    def write_then_stall(*args, **kwargs):
        real_write(*args, **kwargs)
        COMM.Barrier()
        if RANK == 0:
            print(f"STALLED {os.getpid()}", flush=True)
        time.sleep(600)
    checkpoint.write = write_then_stall
    with torch.no_grad():
        model.weight.add_(1.0)
    dp.io.save_checkpoint(path, model, tensors={"u": 2 * u, "v": u}, extra={"name": "B"})


def save_loop(directory: str) -> None:
    """Save checkpoints into DIR/ckpt.h5 until killed: step k (one past the step
    already there) has model weight k, bias -k, tensor u = k * arange and, on odd
    steps, a second tensor v = k (so the set of part files changes too). Prints
    ``SAVED k`` after the first save."""
    path = os.path.join(directory, "ckpt.h5")
    grid = dp.ProcessGrid((SIZE,))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    step, told = 0, False
    if os.path.exists(path):
        step = dp.io.load_checkpoint(path, grid=grid).extra["step"]
    base = dp.scatter(torch.arange(24.0 * SIZE, dtype=torch.float64).reshape(1, 2, -1),
                      grid, {2: 0})
    while True:
        step += 1
        with torch.no_grad():
            model.weight.fill_(step)
            model.bias.fill_(-step)
        tensors = {"u": step * base}
        if step % 2:
            tensors["v"] = 0 * base + step
        dp.io.save_checkpoint(path, model, tensors=tensors, extra={"step": step})
        if RANK == 0 and not told:
            print(f"SAVED {step}", flush=True)
            told = True


if __name__ == "__main__":
    {"memory": memory, "killed-save": killed_save, "save-loop": save_loop}[sys.argv[1]](
        *sys.argv[2:])
