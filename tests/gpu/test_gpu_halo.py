"""HaloExchange on CuPy arrays and torch CUDA tensors, staged through pinned
host memory and (where MPI is CUDA-aware) direct: fill and accumulate equal the
same exchange on numpy bit for bit, on random layouts (1- to 4-D grids, uneven
and empty blocks, periodic axes, widths wider than a neighbour's block), for
every dtype, on strided views and through reused plans; the dot-product test on
the device; and the stream tests: work queued on a non-default stream right
before an exchange must reach the ghosts, and the exchange's results must be
there for the next kernel on that stream."""
import numpy as np
import pytest
from gpu_env import GPU_MISSING, KINDS, needs_torch_cuda, to_device, to_host
from mpi4py import MPI

import domainpar as dp
from domainpar.comm import halo as halo_module
from domainpar.testing import adjoint_error
from layouts import global_array, random_layout, reference_fill
from test_halo import padded_with_block

if GPU_MISSING:  # one skip for the module, none of its cases built
    pytest.skip(GPU_MISSING, allow_module_level=True)
pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
CASES = [(grid_ndim, seed) for grid_ndim in (1, 2, 3, 4) for seed in range(4)]
DTYPES = [np.float32, np.float64, np.complex64, np.complex128, np.int32, np.int64,
          np.float16, np.uint8]
# GPU clock cycles the producer spins before writing: tens of milliseconds, far
# longer than an exchange that does not wait for it takes.
SPIN_CYCLES = 10**8


def _assert_path(halo, path):
    """The device plans of ``halo`` went the way ``path`` forced."""
    plans = [p for p in halo._plans.values() if p.device]
    assert plans and all(p.staged == (path == "staged") for p in plans), \
        [(p.staged, path) for p in plans]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grid_ndim,seed", CASES)
def test_fill_and_accumulate_equal_numpy(grid_ndim, seed, kind, path):
    _, dec, width = random_layout(seed, COMM, grid_ndim)
    halo = dp.HaloExchange(dec, width)
    glob = global_array(dec.global_shape, seed)
    host = padded_with_block(halo, glob, seed, np.float64)
    dev = to_device(host, kind)
    assert halo.fill(dev) is dev
    np.testing.assert_array_equal(to_host(dev), reference_fill(glob, halo, host),
                                  err_msg=f"{dec} width={width}")
    rng = np.random.default_rng(seed + 7919 * RANK)
    x, y = rng.standard_normal((2,) + halo.padded_shape)
    dev = to_device(y, kind)
    halo.accumulate(dev)
    np.testing.assert_array_equal(to_host(dev), halo.accumulate(y.copy()))
    fx = to_host(halo.fill(to_device(x, kind)))
    aty = to_host(halo.accumulate(to_device(y, kind)))
    assert adjoint_error(fx, y, x, aty, COMM) < 1e-13
    _assert_path(halo, path)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(dtype, kind, path):
    grid = dp.ProcessGrid((0, 0), periodic=(True, False))
    dec = dp.Decomposition((7, 5, 6), grid, shard={1: 0, 2: 1})
    halo = dp.HaloExchange(dec, {1: (2, 1), 2: 1})
    complex_ = np.dtype(dtype).kind == "c"
    glob = (global_array(dec.global_shape, 3, np.complex128 if complex_ else np.float64)
            * 10).astype(dtype)
    host = padded_with_block(halo, glob, 3, dtype)
    dev = to_device(host, kind)
    halo.fill(dev)
    np.testing.assert_array_equal(to_host(dev), reference_fill(glob, halo, host))
    dev = to_device(host, kind)  # accumulate: the same sums as numpy's, bit for bit
    halo.accumulate(dev)
    np.testing.assert_array_equal(to_host(dev), halo.accumulate(host.copy()))
    _assert_path(halo, path)


@pytest.mark.parametrize("kind", KINDS)
def test_strided_views_and_plan_reuse(kind, path):
    """A view inside a bigger device array (boxes go through the pack kernels
    on either path), filled several times, then many arrays in turn through one
    plan (persistent requests are kept per device address)."""
    grid = dp.ProcessGrid((0, 0), periodic=(True, True))
    dec = dp.Decomposition((9, 7, 5), grid, shard={0: 0, 1: 1})
    halo = dp.HaloExchange(dec, {0: 1, 1: (2, 1), 2: 1})
    glob = global_array(dec.global_shape, 11)
    base = padded_with_block(halo, glob, 11, np.float64)
    want = reference_fill(glob, halo, base)
    big = np.zeros(base.shape[:2] + (base.shape[2] + 2, 3))
    big[:, :, 1:-1, 1] = base
    dev_big = to_device(big, kind)
    view = dev_big[:, :, 1:-1, 1]
    for _ in range(3):
        halo.fill(view)
        np.testing.assert_array_equal(to_host(view), want)
    untouched = to_host(dev_big)
    untouched[:, :, 1:-1, 1] = big[:, :, 1:-1, 1]
    np.testing.assert_array_equal(untouched, big)  # nothing outside the view was written
    count = halo_module._KEPT_ADDRESSES + 2
    globs = [global_array(dec.global_shape, 100 + i) for i in range(count)]
    hosts = [padded_with_block(halo, g, 100 + i, np.float64) for i, g in enumerate(globs)]
    devs = [to_device(h, kind) for h in hosts]
    for _ in range(2):
        for d, g, h in zip(devs, globs, hosts):
            np.testing.assert_array_equal(to_host(halo.fill(d)), reference_fill(g, halo, h))
    _assert_path(halo, path)


def _stream_case(op):
    """A halo, this rank's padded array before and after its owned cells are
    rewritten, the new owned block, and what ``op`` must give on the new array."""
    grid = dp.ProcessGrid((0,), periodic=True)
    dec = dp.Decomposition((4, 96 * COMM.Get_size(), 512), grid, shard={1: 0})
    halo = dp.HaloExchange(dec, {1: 8, 2: 2})
    old = padded_with_block(halo, global_array(dec.global_shape, 1), 1, np.float64)
    block = global_array(dec.global_shape, 2)[dec.local_slices()]
    new = old.copy()
    new[halo.owned] = block
    want = getattr(halo, op)(new.copy())
    return halo, old, block, want


@needs_torch_cuda
@pytest.mark.parametrize("op", ["fill", "accumulate"])
def test_work_on_a_torch_side_stream_reaches_the_exchange(op, path):
    """The owned cells are written on a torch side stream that is still busy
    when the exchange is called: MPI must see the new values. Right after, the
    same stream copies the array: it must see the exchange's results."""
    import cupy
    import torch
    halo, old, block, want = _stream_case(op)
    t = to_device(old, "torch")
    new_block = to_device(block, "torch")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN_CYCLES)
        t[halo.owned] = new_block
        getattr(halo, op)(t)
        assert cupy.cuda.get_current_stream().done  # nothing of the exchange left queued
        seen = t.clone()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(seen.cpu().numpy(), want)
    np.testing.assert_array_equal(t.cpu().numpy(), want)
    _assert_path(halo, path)


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


@pytest.mark.parametrize("op", ["fill", "accumulate"])
def test_work_on_a_cupy_stream_reaches_the_exchange(op, path):
    import cupy
    halo, old, block, want = _stream_case(op)
    a = cupy.asarray(old)
    new_block = cupy.asarray(block)
    cupy.cuda.Device().synchronize()
    spin = cupy.RawKernel(_SPIN, "spin")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        spin((1,), (1,), (np.int64(SPIN_CYCLES),))
        a[halo.owned] = new_block
        getattr(halo, op)(a)
        seen = a.copy()
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(seen), want)
    _assert_path(halo, path)


@needs_torch_cuda
def test_domain_tensor_conv_on_a_side_stream(path):
    """The same through the torch layer: a sharded conv (halo fill forward,
    accumulate backward) run on a busy side stream equals the default stream's."""
    import torch

    from domainpar.testing import shard_like
    grid = dp.ProcessGrid((COMM.Get_size(),))
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(2, 3, 5, padding=2).double().cuda()
    x = torch.randn((2, 2, 40 * COMM.Get_size(), 64), dtype=torch.float64)

    def run():
        xs = shard_like(x, grid, {2: 0}).cuda().requires_grad_(True)
        y = conv(xs)
        y.sum().backward()
        return y.full_tensor().cpu(), xs.grad.full_tensor().cpu()

    want = run()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN_CYCLES)
        got = run()
    torch.cuda.synchronize()
    for g, w in zip(got, want):  # stale ghosts would differ by O(1); cuDNN may round differently
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
