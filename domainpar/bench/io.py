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

import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch
from mpi4py import MPI

from ..progress import Progress
from .output import write_json
from .settings import applied, configurations, context_for, describe, parts, ratio_line
from .timing import interleaved, median, ratios, split_configurations


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


class _Paths:
    """Local. The timed epochs of one configuration over the file at ``path``:
    datasets and raw h5py handles opened under the settings in force when it is
    built (configuration B builds its own under B's), closed by ``close()``."""

    def __init__(self, comm, grid, path: str, rows: slice, samples: int, mpio: bool):
        import domainpar as dp

        from ..io import files
        self.closers: list[Callable[[], object]] = []
        # The read paths name their driver; the epochs with a step follow
        # DOMAINPAR_IO (mpio where h5py has it, unless set otherwise).
        self.driver = "mpio" if files.parallel() else "serial"

        def dataset(mode, **kw):
            with files.forced_mode(mode):
                ds = dp.io.ShardedDataset(path, "x", grid=grid, shard={2: 0}, **kw)
            self.closers.append(ds.close)
            return ds

        def raw_epoch(dset, collective):
            def go():
                for i in range(samples):
                    _raw(dset, i, rows, collective)
            return go

        self.paths = {}
        if mpio:
            handle = h5py.File(path, "r", driver="mpio", comm=comm)
            self.closers.append(handle.close)
            self.paths["dataset_collective"] = _epoch(dataset("mpio", prefetch=False))
            self.paths["raw_collective"] = raw_epoch(handle["x"], True)
            self.paths["dataset_independent"] = _epoch(dataset("mpio", prefetch=False,
                                                               collective=False))
            self.paths["raw_independent"] = raw_epoch(handle["x"], False)
        serial = h5py.File(path, "r")
        self.closers.append(serial.close)
        self.paths["dataset_serial"] = _epoch(dataset("serial", prefetch=False))
        self.paths["raw_serial"] = raw_epoch(serial["x"], False)
        self.no_prefetch = dataset(None, prefetch=False)
        self.prefetch = dataset(None, prefetch=True)

    def add_compute(self, compute_s: float) -> None:
        """The epochs with a stand-in step of ``compute_s`` per sample."""
        self.paths["compute_no_prefetch"] = _epoch(self.no_prefetch, compute_s)
        self.paths["compute_prefetch"] = _epoch(self.prefetch, compute_s)

    def close(self) -> None:
        for close in self.closers[::-1]:
            close()


def _epoch(ds, compute_s: float = 0.0):
    def go():
        for _ in ds:
            if compute_s:
                time.sleep(compute_s)
    return go


def _figures(timed: dict, epoch_bytes: int, mpio: bool, driver: str) -> dict:
    """One configuration's medians, throughputs and ratios."""
    medians = {k: median(v) for k, v in timed.items()}
    throughput = {k: epoch_bytes / v / 2**20 for k, v in medians.items()
                  if not k.startswith("compute")}
    speed = {f"dataset_over_raw_{m}": medians[f"raw_{m}"] / medians[f"dataset_{m}"]
             for m in ("collective", "independent", "serial") if f"raw_{m}" in medians}
    if mpio:
        speed["collective_over_independent_dataset"] = (medians["dataset_independent"]
                                                        / medians["dataset_collective"])
        speed["collective_over_independent_raw"] = (medians["raw_independent"]
                                                     / medians["raw_collective"])
    return {"median_epoch_s": medians, "samples_s": timed,
            "aggregate_read_mib_per_s": throughput, "speed_ratios": speed,
            "prefetch_epoch_saving": 1 - medians["compute_prefetch"]
            / medians["compute_no_prefetch"],
            "compute_epochs_driver": driver}


def run(samples: int = 8, channels: int = 2, side: int = 2048, repeats: int = 5,
        compute_ms: float | None = None, directory: str | None = None,
        out: str = "bench-out/io.json", compare=None) -> dict:
    """Collective. Time every path (and under ``compare``'s settings too,
    interleaved, when given) and write JSON and PNG (rank 0 prints a table)."""
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
            if compare:
                print(f"compared, interleaved: {describe(compare)}", flush=True)
        a = _Paths(comm, grid, path, rows, samples, mpio)
        # The stand-in step lasts as long as a read of a sample, unless given.
        probe = interleaved(comm, {"probe": _epoch(a.no_prefetch)}, 3, warmup=1)["probe"]
        compute_s = compute_ms / 1e3 if compute_ms is not None else median(probe) / samples
        a.add_compute(compute_s)
        paths, b = dict(a.paths), None
        if compare:
            with applied(compare):
                b = _Paths(comm, grid, path, rows, samples, mpio)
                b.add_compute(compute_s)
            paths.update({f"B:{k}": go for k, go in b.paths.items()})
        load = [os.getloadavg()]
        bar = Progress(repeats, "bench io", comm=comm)
        timed, timed_b = split_configurations(
            interleaved(comm, paths, repeats, warmup=1, context=context_for(compare),
                        progress=bar))
        bar.close()
        for p in (b, a):
            if p is not None:
                p.close()
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(where, ignore_errors=True)
    epoch_bytes = samples * sample_bytes
    result = {
        "benchmark": "io", "ranks": size, "samples": samples,
        "sample_shape": [channels, side, side],
        "dtype": "float32", "sample_mib": sample_bytes / 2**20, "repeats": repeats,
        "host": platform.node(), "cpus": os.cpu_count(),
        "loadavg_start_end": load + [os.getloadavg()],
        "mpi_library": MPI.Get_library_version().splitlines()[0],
        "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version, "h5py_mpi": mpio,
        "configurations": configurations(compare),
        **_figures(timed, epoch_bytes, mpio, a.driver),
        "compute_stand_in_ms": compute_s * 1e3,
        "note": "file in the page cache: HDF5/MPI-IO/library overhead, not disk bandwidth",
    }
    if compare:
        assert timed_b is not None and b is not None  # both made when comparing
        result["B"] = _figures(timed_b, epoch_bytes, mpio, b.driver)
        result["ratio_B_over_A"] = ratios(result["B"]["median_epoch_s"],
                                          result["median_epoch_s"])
    if rank == 0:
        _print(result, compare)
        write_json(result, out)
    return result


def _print(result: dict, compare) -> None:
    for name, part in parts(result):
        tag = f"{name} " if compare else ""
        for k, v in part["median_epoch_s"].items():
            rate = part["aggregate_read_mib_per_s"].get(k)
            rate = f"{rate:9.1f} MiB/s" if rate is not None else " " * 15
            print(f"  {tag}{k:<22} median epoch {v * 1e3:9.1f} ms  {rate}")
    for name, part in parts(result):
        tag = f"{name} " if compare else ""
        for k, v in part["speed_ratios"].items():
            print(f"  {tag}{k:<40} {v:.3f}")
        print(f"  {tag}prefetch saves {part['prefetch_epoch_saving'] * 100:.0f}% of an epoch "
              f"with a {result['compute_stand_in_ms']:.1f} ms step per sample "
              f"({part['compute_epochs_driver']})")
    if compare:
        print("  " + ratio_line("epoch", result["ratio_B_over_A"]))
