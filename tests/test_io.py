"""dp.io read/write: every rank's block (plus halo) equals the global array's, on
1-, 2- and 3-D grids with even, uneven and zero-size blocks, under the mpio
driver and the forced serial fallback; dtypes, Fortran order, compression,
overwriting, and bad input as the same error on every rank."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import domainpar as dp
from domainpar.io import blocks, files
from domainpar.testing import check_on_every_rank, raises_on_every_rank, shard_like
from io_cases import COMM, MODES, RANK, SIZE, expected_padded, fresh
from tensor_cases import CASES, global_tensor, layout

pytestmark = pytest.mark.mpi


# -- reads and writes equal the global array --------------------------------------------------
SHAPE = (2, 3, 9, 8, 7)
PERIODIC = (True, False, True)


@pytest.mark.parametrize("grid_ndim,kind", CASES, ids=[f"{g}d-{k}" for g, k in CASES])
def test_write_then_read_blocks_and_halos(shared_dir, mode, grid_ndim, kind):
    g = global_tensor(SHAPE, torch.float64, seed=grid_ndim)
    grid, shard, sizes = layout(SHAPE, (2, 3, 4), grid_ndim, kind, periodic=PERIODIC[:grid_ndim])
    x = shard_like(g, grid, shard, sizes)
    path = fresh(shared_dir, "rw")
    dp.io.write(path, "fields/u", x)
    problems = []
    back = dp.io.read(path, "fields/u", grid, shard, sizes=sizes)
    if not isinstance(back, dp.DomainTensor) or not torch.equal(back.to_local(), x.to_local()):
        problems.append("plain read")
    # Halos: one per sharded dim; asymmetric, reaching past neighbours, on an
    # unsharded dim too; periodic axes wrap, the others fill.
    halos = [1, {2: (3, 1), 3: (0, 4), 4: 2, 1: (1, 0)}]
    for halo in halos:
        for index in (None, 1):
            h = dp.io.read(path, "fields/u", grid, shard, sizes=sizes, halo=halo, index=index,
                           fill=-7.0)
            dec = h.block.decomposition
            widths = blocks.widths(halo, dec)
            want = expected_padded(g, dec, widths, blocks.periodic_dims(dec, None), fill=-7.0,
                                   base=(index or 0,) + (0,) * 4)
            if not torch.equal(h.padded, want):
                problems.append(f"halo {halo} index {index}")
            own = g[index:index + 1] if index is not None else g
            if not torch.equal(h.block.to_local(), own[dec.local_slices()]):
                problems.append(f"owned block, halo {halo} index {index}")
    check_on_every_rank(not problems, problems)


def test_written_file_is_one_global_array(shared_dir, mode):
    """Another program (h5py, one process) sees the global array in one dataset;
    the other io mode reads it (under mpio, a virtual dataset is read serially),
    cut another way, and overwrites it."""
    g = global_tensor((3, 10, 6), torch.float32, seed=5)
    grid, shard, sizes = layout(g.shape, (1, 2), min(SIZE, 2), "uneven")
    path = fresh(shared_dir, "global")
    dp.io.write(path, "u", shard_like(g, grid, shard, sizes))
    ok = True
    if RANK == 0:
        with h5py.File(path, "r") as f:
            ok = np.array_equal(f["u"][...], g.numpy()) and f["u"].is_virtual == (mode == "serial")
    other = {"mpio": "serial", "serial": "mpio"}[mode]
    if other in MODES:
        with files.forced_mode(other):
            flat = dp.ProcessGrid((SIZE,))
            back = dp.io.read(path, "u", flat, {2: 0}, halo=1)
            ok &= torch.equal(back.block.to_local(), g[back.block.decomposition.local_slices()])
            dp.io.write(path, "u", shard_like(-g, flat, {2: 0}), overwrite=True)
            with dp.io.ShardedDataset(path, "u", grid=grid, shard=shard, sizes=sizes) as ds:
                ok &= all(torch.equal(x.to_local(), -g[k:k + 1][x.decomposition.local_slices()])
                          for k, x in enumerate(ds))
    check_on_every_rank(ok, "rank 0's h5py view of the file, the other mode's read")


DTYPES = (torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def test_dtypes_round_trip(shared_dir, mode):
    grid = dp.ProcessGrid((SIZE,))
    path = fresh(shared_dir, "dtypes")
    problems = []
    for k, dtype in enumerate(DTYPES):
        g = global_tensor((2, 2 * SIZE + 1, 3), torch.float64, seed=k) * 50
        g = g > 0 if dtype == torch.bool else (torch.complex(g, -g) if dtype.is_complex else g)
        g = g.to(dtype)
        name = str(dtype).replace("torch.", "")
        dp.io.write(path, name, shard_like(g, grid, {1: 0}))
        back = dp.io.read(path, name, grid, {1: 0}, dtype=dtype)
        own = g[back.decomposition.local_slices()]
        if back.dtype != dtype or not torch.equal(back.to_local(), own):
            problems.append(name)
    with h5py.File(path, "r") if RANK == 0 else _nothing() as f:
        if f is not None and (f["bfloat16"].dtype != np.uint16
                              or f["bfloat16"].attrs["domainpar_dtype"] != "bfloat16"):
            problems.append("bfloat16 is stored as uint16 with domainpar_dtype='bfloat16'")
    check_on_every_rank(not problems, problems)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_fortran_ordered_datasets(shared_dir, mode):
    """A simulation's Fortran array: the file holds the dims backwards; the
    ``order='F'`` attribute (or the read parameter) turns it back, block by block."""
    g = global_tensor((2, 5, 4 * SIZE + 1, 6), torch.float64, seed=9)
    grid = dp.ProcessGrid((SIZE,), periodic=True)
    path = fresh(shared_dir, "fortran")
    if RANK == 0:
        with h5py.File(path, "w") as f:
            f.create_dataset("tagged", data=g.numpy().T).attrs["order"] = "F"
            f.create_dataset("plain", data=g.numpy().T)
    COMM.Barrier()
    problems = []
    for name, order in (("tagged", None), ("plain", "F")):
        x = dp.io.read(path, name, grid, {2: 0}, order=order)
        if x.shape != g.shape or not torch.equal(x.to_local(), g[x.decomposition.local_slices()]):
            problems.append(f"{name} block")
        h = dp.io.read(path, name, grid, {2: 0}, order=order, halo={2: 2, 3: (1, 0)}, index=1)
        dec = h.block.decomposition
        want = expected_padded(g, dec, {2: (2, 2), 3: (1, 0)}, {2}, base=(1, 0, 0, 0))
        if not torch.equal(h.padded, want):
            problems.append(f"{name} halo")
    # write(order='F') stores it the same way.
    dp.io.write(path, "written", shard_like(g, grid, {2: 0}), order="F")
    if RANK == 0:
        with h5py.File(path, "r") as f:
            written = f["written"]
            if not np.array_equal(written[...], g.numpy().T) or written.attrs["order"] != "F":
                problems.append("write(order='F')")
    back = dp.io.read(path, "written", grid, {2: 0})
    if not torch.equal(back.to_local(), g[back.decomposition.local_slices()]):
        problems.append("read of write(order='F')")
    check_on_every_rank(not problems, problems)


def test_compressed_chunked_write(shared_dir, mode):
    """gzip under mpio (HDF5 >= 1.10.2: collective filtered writes) and serial."""
    g = global_tensor((1, 2, 6 * SIZE + 3, 16), torch.float32, seed=3)
    grid, shard, sizes = layout(g.shape, (2,), 1, "zero")
    path = fresh(shared_dir, "gzip")
    dp.io.write(path, "u", shard_like(g, grid, shard, sizes), compression="gzip",
                compression_opts=4)
    back = dp.io.read(path, "u", grid, shard, sizes=sizes)
    ok = torch.equal(back.to_local(), g[back.decomposition.local_slices()])
    if RANK == 0:
        with h5py.File(path, "r") as f:
            if mode == "mpio":
                ok &= f["u"].compression == "gzip" and f["u"].chunks is not None
            else:  # the compressed data lives in the part files
                for r in range(SIZE):
                    part = f"{path}.rank{r}.h5"
                    if os.path.exists(part):
                        with h5py.File(part, "r") as p:
                            ok &= p["u"].compression == "gzip"
    check_on_every_rank(ok, "compressed round trip")


def test_overwrite_and_mismatch(shared_dir, mode):
    grid = dp.ProcessGrid((SIZE,))
    g = global_tensor((1, 2, 3 * SIZE), torch.float32, seed=1)
    path = fresh(shared_dir, "over")
    dp.io.write(path, "u", shard_like(g, grid, {2: 0}))
    raises_on_every_rank(dp.io.DataError, ["exists", "overwrite=True"],
                         lambda: dp.io.write(path, "u", shard_like(g, grid, {2: 0})))
    raises_on_every_rank(dp.io.DataError, ["holds torch.float32", "torch.float64"],
                         lambda: dp.io.write(path, "u", shard_like(g.double(), grid, {2: 0}),
                                             overwrite=True))
    raises_on_every_rank(dp.io.DataError, ["shape (1, 2,"],
                         lambda: dp.io.write(path, "u", shard_like(g[:, :1], grid, {2: 0}),
                                             overwrite=True))
    dp.io.write(path, "u", shard_like(2 * g, grid, {2: 0}), overwrite=True)
    back = dp.io.read(path, "u", grid, {2: 0})
    check_on_every_rank(torch.equal(back.to_local(), (2 * g)[back.decomposition.local_slices()]),
               "overwritten values")


# -- what the first layer does with the halo ----------------------------------------------------
def test_halo_block_is_what_halo_exchange_and_conv_see(shared_dir, mode):
    grid, shard, sizes = layout((1, 2, 11, 9), (2, 3), 2, "uneven", periodic=(False, True))
    g = global_tensor((1, 2, 11, 9), torch.float64, seed=4)
    path = fresh(shared_dir, "conv")
    dp.io.write(path, "u", shard_like(g, grid, shard, sizes))
    h = dp.io.read(path, "u", grid, shard, sizes=sizes, halo={2: 1, 3: 1})
    # HaloExchange.fill on the same layout refreshes interior and periodic ghosts to
    # the values read from the file; outer non-periodic ghosts it leaves alone.
    refill = h.padded.clone()
    owned = tuple(slice(1, -1) if d in (2, 3) else slice(None) for d in range(4))
    scrambled = torch.full_like(refill, 99.0)
    scrambled[owned] = refill[owned]
    outer = torch.ones_like(refill, dtype=torch.bool)
    outer[owned] = False
    dp.HaloExchange(h.block.decomposition, h.width).fill(scrambled.numpy())
    changed = scrambled != 99.0
    ok = torch.equal(scrambled[changed], refill[changed])
    # The first conv layer: zero padding along the non-periodic dim 2, circular along dim 3.
    w = global_tensor((3, 2, 3, 3), torch.float64, seed=6)
    whole = F.conv2d(F.pad(g, (1, 1, 0, 0), mode="circular"), w, padding=(1, 0))
    local = F.conv2d(h.padded, w)
    mine = whole[(slice(None), slice(None)) + h.block.decomposition.local_slices()[2:]]
    ok &= torch.allclose(local, mine, rtol=1e-12, atol=1e-12)
    check_on_every_rank(ok, "halo fill / conv")


# -- bad input: the same error on every rank ----------------------------------------------------
def test_bad_input_raises_the_same_error_everywhere(shared_dir, mode):
    grid = dp.ProcessGrid((SIZE,))
    g = global_tensor((2, 3, 2 * SIZE + 1), torch.float32, seed=2)
    path = fresh(shared_dir, "bad")
    dp.io.write(path, "u", shard_like(g, grid, {2: 0}))
    dp.io.write(path, "grp/v", shard_like(g, grid, {2: 0}))
    E, L = dp.io.DataError, dp.LayoutError
    raises_on_every_rank(E, ["no such file"],
                         lambda: dp.io.read(path + ".nope", "u", grid, {2: 0}))
    raises_on_every_rank(E, ["no dataset 'w'", "grp, u"],
                         lambda: dp.io.read(path, "w", grid, {2: 0}))
    raises_on_every_rank(E, ["is a group"], lambda: dp.io.read(path, "grp", grid, {2: 0}))
    raises_on_every_rank(L, ["dim 3", "3 dims"], lambda: dp.io.read(path, "u", grid, {3: 0}))
    raises_on_every_rank(L, [f"sum to its global size {2 * SIZE + 1}"],
                         lambda: dp.io.read(path, "u", grid, {2: 0}, sizes={2: [1] * SIZE}))
    raises_on_every_rank(L, ["out of range"], lambda: dp.io.read(path, "u", grid, {2: 0}, index=2))
    raises_on_every_rank(E, ["holds torch.float32", "torch.float64"],
                         lambda: dp.io.read(path, "u", grid, {2: 0}, dtype=torch.float64))
    raises_on_every_rank(L, ["wraps more than once"],
                         lambda: dp.io.read(path, "u", grid, {2: 0}, halo={2: 2 * SIZE + 2},
                                            periodic={2: True}))
    # Truncated and corrupt files (and, serial fallback, a missing part file).
    broken = fresh(shared_dir, "broken")
    if RANK == 0:
        with h5py.File(broken + ".whole", "w") as f:
            f.create_dataset("u", data=g.numpy())
        size = os.path.getsize(broken + ".whole")
        with open(broken + ".whole", "rb") as src, open(broken, "wb") as dst:
            dst.write(src.read(size - 16))
        with open(broken + ".garbage", "wb") as dst:
            dst.write(os.urandom(4096))
    COMM.Barrier()
    raises_on_every_rank(E, "truncated", lambda: dp.io.read(broken, "u", grid, {2: 0}))
    raises_on_every_rank(E, ["not a readable HDF5 file"],
                         lambda: dp.io.read(broken + ".garbage", "u", grid, {2: 0}))
    # Arguments that differ between ranks.
    raises_on_every_rank(L, "",
                         lambda: dp.io.read(path, "u", grid, {2: 0},
                                            halo=RANK if SIZE > 1 else "x"))
    if mode == "serial":
        if RANK == 0:
            os.remove(f"{path}.rank{SIZE - 1}.h5")
        COMM.Barrier()
        raises_on_every_rank(E, [f"rank{SIZE - 1}.h5: no such file"],
                             lambda: dp.io.read(path, "u", grid, {2: 0}))
