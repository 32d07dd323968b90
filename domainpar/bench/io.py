"""`domainpar bench io`: ShardedDataset read throughput against raw h5py
hyperslab reads of the same blocks by the same ranks, collective against
independent transfers.

The data: ``samples`` float32 samples of shape (channels, side, side) in one
(N, C, H, W) dataset, written with ``dp.io.write`` (chunked, mpio) to a
temporary directory; every rank reads its block of each sample (sharded along
H over all ranks). One timed unit is an epoch: every sample once, in order.
Paths, interleaved round-robin (``timing.interleaved``; a sample is the slowest
rank's time):

- ``dataset_collective`` / ``raw_collective``: ShardedDataset without prefetch
  (collective transfers) / h5py ``read_direct`` of ``[i:i+1, :, h0:h1, :]`` into a
  fresh array under ``dset.collective``,
- ``dataset_independent`` / ``raw_independent``: the same, independent transfers,
- ``dataset_serial`` / ``raw_serial``: the serial fallback (each rank opens the
  file with serial h5py) / raw serial h5py,
- ``compute_no_prefetch`` / ``compute_prefetch``: an epoch with a stand-in
  training step after each sample (a sleep as long as ``compute_ms``, which
  leaves the core to the prefetch thread; real compute on a machine with spare
  cores behaves alike), without and with the background prefetch.

The file is small enough to sit in the page cache after it is written: the
figures measure HDF5, MPI-IO and the library's overhead over memory bandwidth,
not a parallel file system.
"""
from __future__ import annotations

import platform
import shutil
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from mpi4py import MPI

from .output import write_json
from .timing import interleaved, median


def _raw(dset, i: int, rows: slice, collective: bool):
    """Sample i's rows by raw h5py into a fresh array (a loader hands each sample
    out, so it cannot reuse one). ``read_direct``, because h5py's ``dset[...]``
    takes a fast path for numeric dtypes that ignores ``dset.collective`` (h5py
    3.16 reads independently there: one rank alone returns, no hang)."""
    out = np.empty((1,) + dset.shape[1:2] + (rows.stop - rows.start,) + dset.shape[3:],
                   dtype=dset.dtype)
    if collective:
        with dset.collective:
            dset.read_direct(out, np.s_[i:i + 1, :, rows, :])
    else:
        dset.read_direct(out, np.s_[i:i + 1, :, rows, :])
    return out


def run(samples: int = 8, channels: int = 2, side: int = 2048, repeats: int = 5,
        compute_ms: float | None = None, directory: str | None = None,
        out: str = "bench-out/io.json") -> dict:
    """Collective. Time every path and write JSON (rank 0 prints a table)."""
    import domainpar as dp
    from ..comm import Decomposition, ProcessGrid
    from ..io import files
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    grid = ProcessGrid((size,))
    shape = (samples, channels, side, side)
    where = comm.bcast(tempfile.mkdtemp(prefix="dp-bench-io-", dir=directory)
                       if rank == 0 else None, root=0)
    path = str(Path(where) / "samples.h5")
    mpio = files.has_mpi()
    try:
        dec = Decomposition(shape, grid, {2: 0})
        block = torch.randn(dec.local_shape(), generator=torch.Generator().manual_seed(rank))
        with files.forced_mode("mpio" if mpio else "serial"):
            dp.io.write(path, "x", dp.DomainTensor(block, dec))
        del block
        rows = dec.local_slices()[2]
        sample_bytes = channels * side * side * 4
        if rank == 0:
            print(f"domainpar bench io: {samples} samples of ({channels}, {side}, {side}) "
                  f"float32 ({sample_bytes / 2**20:.0f} MiB each) on {size} rank(s), sharded "
                  f"along H; h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, "
                  f"h5py MPI: {mpio}", flush=True)
        paths, closers = {}, []

        def epoch_of(ds, compute_s=0.0):
            def go():
                for _ in ds:
                    if compute_s:
                        time.sleep(compute_s)
            return go

        def dataset(mode, **kw):
            with files.forced_mode(mode):
                ds = dp.io.ShardedDataset(path, "x", grid=grid, shard={2: 0}, **kw)
            closers.append(ds.close)
            return ds

        def raw_epoch(dset, collective):
            def go():
                for i in range(samples):
                    _raw(dset, i, rows, collective)
            return go

        if mpio:
            handle = h5py.File(path, "r", driver="mpio", comm=comm)
            closers.append(handle.close)
            paths["dataset_collective"] = epoch_of(dataset("mpio", prefetch=False))
            paths["raw_collective"] = raw_epoch(handle["x"], True)
            paths["dataset_independent"] = epoch_of(dataset("mpio", prefetch=False,
                                                            collective=False))
            paths["raw_independent"] = raw_epoch(handle["x"], False)
        serial = h5py.File(path, "r")
        closers.append(serial.close)
        paths["dataset_serial"] = epoch_of(dataset("serial", prefetch=False))
        paths["raw_serial"] = raw_epoch(serial["x"], False)
        # The stand-in step lasts as long as a read of a sample, unless given.
        default = "mpio" if mpio else "serial"
        no_prefetch = dataset(default, prefetch=False)
        probe = interleaved(comm, {"probe": epoch_of(no_prefetch)}, 3, warmup=1)["probe"]
        compute_s = compute_ms / 1e3 if compute_ms is not None else median(probe) / samples
        paths["compute_no_prefetch"] = epoch_of(no_prefetch, compute_s)
        paths["compute_prefetch"] = epoch_of(dataset(default, prefetch=True), compute_s)
        timed = interleaved(comm, paths, repeats, warmup=1)
        for close in closers[::-1]:
            close()
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(where, ignore_errors=True)
    epoch_bytes = samples * sample_bytes
    medians = {k: median(v) for k, v in timed.items()}
    throughput = {k: epoch_bytes / v / 2**20 for k, v in medians.items()
                  if not k.startswith("compute")}
    ratios = {f"dataset_over_raw_{m}": medians[f"raw_{m}"] / medians[f"dataset_{m}"]
              for m in ("collective", "independent", "serial") if f"raw_{m}" in medians}
    if mpio:
        ratios["collective_over_independent_dataset"] = (medians["dataset_independent"]
                                                         / medians["dataset_collective"])
        ratios["collective_over_independent_raw"] = (medians["raw_independent"]
                                                     / medians["raw_collective"])
    result = {
        "benchmark": "io", "ranks": size, "samples": samples,
        "sample_shape": [channels, side, side],
        "dtype": "float32", "sample_mib": sample_bytes / 2**20, "repeats": repeats,
        "host": platform.node(), "mpi_library": MPI.Get_library_version().splitlines()[0],
        "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version, "h5py_mpi": mpio,
        "median_epoch_s": medians, "samples_s": timed,
        "aggregate_read_mib_per_s": throughput,
        "speed_ratios": ratios,
        "compute_stand_in_ms": compute_s * 1e3,
        "prefetch_epoch_saving": 1 - medians["compute_prefetch"] / medians["compute_no_prefetch"],
        "note": "file in the page cache: HDF5/MPI-IO/library overhead, not disk bandwidth",
    }
    if rank == 0:
        for k, v in medians.items():
            rate = f"{throughput[k]:9.1f} MiB/s" if k in throughput else " " * 15
            print(f"  {k:<22} median epoch {v * 1e3:9.1f} ms  {rate}")
        for k, v in ratios.items():
            print(f"  {k:<40} {v:.3f}")
        print(f"  prefetch saves {result['prefetch_epoch_saving'] * 100:.0f}% of an epoch with a "
              f"{compute_s * 1e3:.1f} ms step per sample")
        write_json(result, out)
    return result
