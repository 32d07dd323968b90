"""ShardedDataset: the samples of (N, C, *spatial) HDF5 datasets as DomainTensors.

Sample ``i`` is ``read(..., index=i)`` of the inputs (and targets): a batch of
one, ``(1, C, *spatial)``, cut by the same ``shard`` map on every sample. The
file stays open (collectively, under mpio) until ``close()``.

Shuffling is the same on every rank: epoch ``e``'s order is a permutation drawn
from ``numpy.random.default_rng((seed, e))``, and a seed not given is drawn on
rank 0 and broadcast.

Prefetch: while the caller works on sample k, a background thread reads sample
k+1 of the iteration order. The thread makes no call that must match across
ranks: under mpio it reads with *independent* transfers (a collective read in a
thread would have to pair up across ranks with no order against the main
thread's own collectives), and only when MPI runs with MPI_THREAD_MULTIPLE (the
thread calls MPI-IO); otherwise there is no prefetch under mpio. Serial h5py
makes no MPI calls, so its prefetch always runs. h5py serialises HDF5 calls
with its own lock, so the thread and the caller never run HDF5 at once.
Read errors in the thread reach every rank when the sample is taken.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence

import numpy as np
from mpi4py import MPI

from ..comm.decomposition import Decomposition
from ..comm.errors import LayoutError, signature_of
from ..comm.errors import agree as agree_args
from ..comm.grid import ProcessGrid
from . import blocks, files
from .errors import agree
from .read import fortran, logical_shape, read_plan, result, selection


class _Source:
    """One dataset of the file, with its sample layout and box plan."""

    def __init__(self, handle, path, name, info: files.Info, grid, shard, sizes, halo,
                 periodic, fill):
        self.name, self.info, self.fill = name, info, fill
        self.fortran = fortran(info, None)
        shape = logical_shape(info, self.fortran)
        if len(shape) < 2:
            raise LayoutError(f"{path}:{name} has shape {shape}; a ShardedDataset needs "
                              f"(N, C, *spatial) or at least (N, ...)")
        self.n = shape[0]
        self.dec = Decomposition(selection(shape, 0)[1], grid, shard, sizes)
        self.plan = blocks.plan(self.dec, blocks.widths(halo, self.dec),
                                blocks.periodic_dims(self.dec, periodic))
        self.dset = handle[name]

    def read(self, i: int, collective: bool):
        base = selection((self.n,), i)[0] + (0,) * (self.dec.ndim - 1)
        padded = read_plan(self.dset, self.info.dtype, self.plan, base, self.fortran,
                           self.fill, collective)
        return result(padded, self.dec, self.plan)


class ShardedDataset:
    """Collective (construction opens the file on every rank of ``grid``). The
    samples along dim 0 of ``inputs`` (and ``targets``) in the HDF5 file ``path``.

    ``ds[i]``: ``(input, target)`` (just ``input`` without targets) of sample i,
    each a DomainTensor of shape ``(1, C, *spatial)`` cut by
    ``Decomposition(.., grid, shard, sizes)``; with ``halo`` (and ``periodic``,
    ``fill``) the input is a HaloBlock as ``read`` gives it. Collective under
    mpio: every rank asks for the same i. ``len(ds)``: the number of samples.
    ``iter(ds)``: every sample once, in order or shuffled; each ``iter`` starts
    the next epoch (``set_epoch`` chooses one). Close with ``close()`` on every
    rank, or use ``with``.

    Parameters
    ----------
    path : str or os.PathLike
        The HDF5 file.
    inputs : str
        The dataset of inputs, samples along dim 0.
    targets : str, optional
        The dataset of targets, as many samples.
    grid, shard, sizes
        The layout of each sample, as for Decomposition.
    halo, periodic, fill
        Ghost cells of the input, as ``read`` takes them.
    shuffle : bool, default False
        Iterate in an order drawn from ``(seed, epoch)``, the same on every rank.
    seed : int, optional
        The shuffle's seed.
    prefetch : bool, default True
        Read the next sample in a background thread while this one is used
        (see the module notes for mpio).
    collective : bool, default True
        Collective transfers for reads made by the calling thread under mpio
        (prefetched reads are independent).
    """

    def __init__(self, path, inputs: str, targets: str | None = None, *, grid: ProcessGrid,
                 shard: Mapping[int, int] | None = None,
                 sizes: Mapping[int, Sequence[int]] | None = None, halo=None,
                 periodic: Mapping[int, bool] | None = None, fill=0, shuffle: bool = False,
                 seed: int | None = None, prefetch: bool = True, collective: bool = True):
        self.comm, self.path = grid.comm, str(path)
        mpio = files.parallel()
        agree_args(self.comm, None, signature=signature_of(
            self.path, inputs, targets, halo, periodic, fill, shuffle, seed, prefetch,
            collective, mpio), what="ShardedDataset arguments",
            described=f"{self.path} inputs={inputs} targets={targets} mpio={mpio}")
        names = [inputs] + ([targets] if targets is not None else [])
        infos = [files.inspect(self.comm, self.path, name) for name in names]
        # Virtual datasets cannot be read in parallel (HDF5 1.10): serial for all then.
        self.mpio = mpio and not any(info.virtual for info in infos)
        self.collective = collective and self.mpio
        threads_ok = not self.mpio or MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self.prefetch = prefetch and threads_ok
        if seed is None and shuffle:
            entropy = np.random.SeedSequence().entropy
            assert isinstance(entropy, int)  # a fresh SeedSequence draws an int
            seed = int(entropy % (1 << 63))
            seed = self.comm.bcast(seed, root=0)
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self._file = files.open_file(self.path, "r", self.comm, self.mpio,
                                     [p for info in infos for p in info.parts])
        try:
            self.sources = [_Source(self._file, self.path, name, info, grid, shard, sizes,
                                    halo if k == 0 else None, periodic, fill)
                            for k, (name, info) in enumerate(zip(names, infos))]
            if len({s.n for s in self.sources}) > 1:
                raise LayoutError(f"{self.path}: {inputs} has {self.sources[0].n} samples but "
                                  f"{targets} has {self.sources[1].n}")
        except LayoutError:
            self._file.close()
            raise
        self._pool = (concurrent.futures.ThreadPoolExecutor(1, "domainpar-io-prefetch")
                      if self.prefetch else None)
        self._pending: tuple[int, concurrent.futures.Future] | None = None
        self.prefetched = 0  # samples served from the prefetch thread (a statistic)

    def __len__(self) -> int:
        return self.sources[0].n

    def _load(self, i: int, collective: bool):
        values = tuple(s.read(i, collective) for s in self.sources)
        return values if len(values) > 1 else values[0]

    def _index(self, i) -> int:
        n = len(self)
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or not -n <= i < n:
            raise IndexError(f"sample index {i!r} out of range for {n} samples")
        return int(i) % n

    def _take(self, i: int, future=None):
        """Collective. Sample i: the prefetched one, or read now; a failure on any
        rank raises the same DataError on every rank."""
        value, problem = None, None
        try:
            value = future.result() if future is not None else self._load(i, self.collective)
        except (OSError, KeyError, ValueError) as exc:
            problem = f"reading sample {i} of {self.path}: {exc}"
        agree(self.comm, problem)
        return value

    def __getitem__(self, i):
        i = self._index(i)
        future = None
        if self._pending is not None:
            j, pending = self._pending
            self._pending = None
            if j == i:
                future = pending
                self.prefetched += 1
            else:
                pending.exception()  # let it finish; HDF5 calls go one at a time anyway
        return self._take(i, future)

    def order(self, epoch: int | None = None) -> list[int]:
        """Local. The sample order of ``epoch`` (default: the next one ``iter`` uses)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(len(self)))
        assert self.seed is not None  # drawn when shuffle is on
        return [int(v) for v in np.random.default_rng((self.seed, epoch)).permutation(len(self))]

    def set_epoch(self, epoch: int) -> None:
        """Local (alike on every rank). The epoch the next ``iter`` runs."""
        self.epoch = int(epoch)

    def __iter__(self):
        order = self.order()
        self.epoch += 1
        for k, i in enumerate(order):
            value = self[i]
            if self._pool is not None and k + 1 < len(order):
                nxt = order[k + 1]
                self._pending = (nxt, self._pool.submit(self._load, nxt, False))
            yield value

    def close(self) -> None:
        """Collective under mpio. Stop the prefetch thread and close the file."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._pending = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
