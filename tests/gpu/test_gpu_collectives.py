"""Collectives on device buffers (CuPy arrays, torch CUDA tensors), staged
through the host and (where MPI is CUDA-aware) direct: allreduce and iallreduce
in place on contiguous and strided arrays, bcast, allgatherv, gatherv, scatterv
and repartition between random layouts (uneven and empty blocks, replicated
axes), the mirror exchange and the ring shift. Same values as on numpy, and
results that stay on the device."""
import itertools

import numpy as np
import pytest
from gpu_env import GPU_MISSING, KINDS, to_device, to_host
from mpi4py import MPI

from domainpar.comm import (
    allgatherv,
    allreduce,
    bcast,
    buffers,
    gatherv,
    iallreduce,
    pairwise,
    repartition,
    scatterv,
)
from layouts import global_array, random_decomposition, random_layout
from test_collectives import REDUCE, random_grid, random_shape, typed, values_of

if GPU_MISSING:  # one skip for the module, none of its cases built
    pytest.skip(GPU_MISSING, allow_module_level=True)
pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD
SIZE, RANK = COMM.Get_size(), COMM.Get_rank()
LAYOUTS = list(itertools.product((1, 2, 3), range(4)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_allreduce_and_iallreduce(op, dtype, strided, kind, path):
    shape = (3, 4, 5)
    contrib = [values_of(r, shape, dtype) for r in range(SIZE)]
    want = REDUCE[op](np.stack(contrib)).astype(dtype)
    base = np.full((3, 8, 5, 2), 99, dtype)
    base[:, ::2, :, 1] = contrib[RANK]
    dev_base = to_device(base, kind)
    a = dev_base[:, ::2, :, 1] if strided else to_device(contrib[RANK], kind)
    assert allreduce(a, COMM, op) is a
    np.testing.assert_array_equal(to_host(a), want)
    if strided:  # the cells around the view are untouched
        around = to_host(dev_base)
        around[:, ::2, :, 1] = 99
        assert (around == 99).all()
    b = to_device(contrib[RANK], kind)
    iallreduce(b, COMM, op).wait()
    np.testing.assert_array_equal(to_host(b), want)


@pytest.mark.parametrize("kind", KINDS)
def test_bcast(kind, path):
    root = SIZE - 1
    a = to_device(values_of(RANK, (4, 3), np.float64), kind)
    assert bcast(a, COMM, root=root) is a
    np.testing.assert_array_equal(to_host(a), values_of(root, (4, 3), np.float64))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grid_ndim,seed", LAYOUTS)
def test_gathers_and_scatter_on_random_layouts(grid_ndim, seed, kind, path):
    _, dec, _ = random_layout(seed, COMM, grid_ndim)
    glob = global_array(dec.global_shape, seed)
    block = to_device(np.ascontiguousarray(glob[dec.local_slices()]), kind)
    out = allgatherv(block, dec)
    assert buffers.is_device(out)
    np.testing.assert_array_equal(to_host(out), glob, err_msg=repr(dec))
    root = seed % SIZE
    out = gatherv(block, dec, root=root)
    if RANK == root:
        assert buffers.is_device(out)
        np.testing.assert_array_equal(to_host(out), glob, err_msg=repr(dec))
    else:
        assert out is None
    mine = scatterv(to_device(glob, kind) if RANK == root else None, dec, root=root)
    assert buffers.is_device(mine)  # the root's array is on a GPU, so every block is
    np.testing.assert_array_equal(to_host(mine), glob[dec.local_slices()], err_msg=repr(dec))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float64, np.complex64, np.int32, np.float16])
@pytest.mark.parametrize("grid_ndim,seed", LAYOUTS)
def test_repartition_between_random_layouts(grid_ndim, seed, dtype, kind, path):
    rng, grid = random_grid(seed, grid_ndim)
    shape = random_shape(rng, int(rng.integers(1, 5)))
    src = random_decomposition(rng, grid, shape)
    dst = random_decomposition(rng, grid, shape)
    glob = typed(global_array(shape, seed, np.complex128), dtype)
    block = to_device(np.ascontiguousarray(glob[src.local_slices()]), kind)
    out = repartition(block, src, dst)
    assert buffers.is_device(out) and out.shape == dst.local_shape()
    np.testing.assert_array_equal(to_host(out), glob[dst.local_slices()],
                                  err_msg=f"{src} -> {dst}")
    back = repartition(out, dst, src)
    np.testing.assert_array_equal(to_host(back), glob[src.local_slices()])


@pytest.mark.parametrize("kind", KINDS)
def test_mirror_exchange_and_ring_shift(kind, path):
    send = to_device(np.arange(5.0) + 100 * RANK, kind)
    recv = to_device(np.zeros(5), kind)
    pairwise.mirror_exchange(send, recv, COMM)
    np.testing.assert_array_equal(to_host(recv), np.arange(5.0) + 100 * (SIZE - 1 - RANK))
    for shift in (1, -1, SIZE):
        sends = [to_device(np.full((3, 2), RANK, np.float32), kind),
                 to_device(np.arange(4) + 10 * RANK, kind)]
        recvs = [to_device(np.zeros((3, 2), np.float32), kind),
                 to_device(np.zeros(4, np.int64), kind)]
        pairwise.ring_shift(sends, recvs, COMM, shift=shift).wait()
        src = (RANK - shift) % SIZE
        np.testing.assert_array_equal(to_host(recvs[0]), np.full((3, 2), src, np.float32))
        np.testing.assert_array_equal(to_host(recvs[1]), np.arange(4) + 10 * src)
