"""The GPU paths' logic, on the CPU: which way device buffers meet MPI (CUDA-aware
reported by the library, forced either way by DOMAINPAR_CUDA_AWARE, staged when
unknown), what `domainpar info` says of it, device binding by node-local rank,
and HaloExchange and the collectives run end to end on both paths with host
arrays posing as device arrays: same results as numpy, MPI handed only host
memory when staged, and every exchange ending with a wait for the device
stream after its last write. tests/gpu/ runs the real thing on a GPU."""
import json
import sys
import types

import numpy as np
import pytest
from mpi4py import MPI

import domainpar as dp
from domainpar import cli
from domainpar.comm import buffers, collectives, pairwise, runtime
from domainpar.comm import halo as halo_module
from domainpar.testing import adjoint_error
from layouts import global_array, random_layout, reference_fill

COMM = MPI.COMM_WORLD


@pytest.fixture
def fresh_query(monkeypatch):
    """cuda_aware_mpi() recomputed under this test's environment (it caches)."""
    monkeypatch.delenv("DOMAINPAR_CUDA_AWARE", raising=False)
    runtime.cuda_aware_mpi.cache_clear()
    yield monkeypatch
    runtime.cuda_aware_mpi.cache_clear()


# -- the decision ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value,aware", [("1", True), ("0", False), (" 1\n", True)])
def test_the_environment_forces_either_path(value, aware, fresh_query):
    fresh_query.setenv("DOMAINPAR_CUDA_AWARE", value)
    got, how = runtime.cuda_aware_mpi()
    assert got is aware and how == f"forced by DOMAINPAR_CUDA_AWARE={value.strip()}"
    assert runtime.stages_device_buffers() is not aware
    report = runtime.capabilities()
    assert report["cuda_aware_mpi"] == ("yes" if aware else "no")
    assert report["device_buffers"] == runtime.DEVICE_PATHS[aware]


def test_a_misspelt_override_is_refused_and_reported(fresh_query):
    fresh_query.setenv("DOMAINPAR_CUDA_AWARE", "yes")
    with pytest.raises(ValueError, match="DOMAINPAR_CUDA_AWARE='yes'"):
        runtime.cuda_aware_mpi()
    with pytest.raises(ValueError):
        runtime.stages_device_buffers()
    report = runtime.capabilities()  # `domainpar info` shows the mistake instead of failing
    assert report["cuda_aware_mpi"] == "unknown"
    assert "DOMAINPAR_CUDA_AWARE='yes'" in report["cuda_aware_mpi_how"]


class _FakeLibrary:
    """An MPI library as ctypes sees it, with or without MPIX_Query_cuda_support."""

    def __init__(self, answer):
        if answer is not None:
            def query():
                return answer
            self.MPIX_Query_cuda_support = query


@pytest.mark.parametrize("answer,aware", [(1, True), (0, False), (None, None)])
def test_the_library_decides_when_nothing_is_forced(answer, aware, fresh_query):
    fresh_query.setattr(runtime.ctypes, "CDLL", lambda path: _FakeLibrary(answer))
    got, how = runtime.cuda_aware_mpi()
    assert got is aware
    assert how == ("MPIX_Query_cuda_support()" if answer is not None else
                   "the MPI library has no MPIX_Query_cuda_support; set DOMAINPAR_CUDA_AWARE")
    assert runtime.stages_device_buffers() is not bool(aware)  # unknown: staged, the safe way
    assert runtime.capabilities()["device_buffers"].startswith("direct" if aware else "staged")


def test_domainpar_info_reports_the_device_path(fresh_query, capsys):
    fresh_query.setenv("DOMAINPAR_CUDA_AWARE", "1")
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cuda_aware_mpi"] == "yes"
    assert report["cuda_aware_mpi_how"] == "forced by DOMAINPAR_CUDA_AWARE=1"
    assert report["device_buffers"] == runtime.DEVICE_PATHS[True]
    assert "\x00" not in report["mpi_library"]


# -- device binding -------------------------------------------------------------------------------
@pytest.mark.parametrize("gpus,expected", [(0, [None] * 4), (1, [0, 0, 0, 0]), (2, [0, 1, 0, 1]),
                                           (4, [0, 1, 2, 3])])
def test_ranks_bind_gpu_by_node_local_rank(gpus, expected, monkeypatch):
    torch = pytest.importorskip("torch")
    used = []
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda i: types.SimpleNamespace(use=lambda: used.append(("cupy", i)))))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(runtime, "gpu_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: used.append(("torch", i)))
    for local, want in enumerate(expected):
        used.clear()
        monkeypatch.setattr(runtime, "local_rank", lambda local=local: local)
        assert runtime.bind_gpu() == want
        assert used == ([] if want is None else [("cupy", want), ("torch", want)])


# -- both paths end to end, with host arrays posing as device arrays ------------------------------
class FakeDevice(np.ndarray):
    """Host memory that buffers.is_device calls device memory; ``get`` copies to
    a plain numpy array, as CuPy's does."""
    gets = 0

    def get(self, out=None):
        FakeDevice.gets += 1
        host = np.asarray(self)
        if out is None:
            return host.copy()
        out[...] = host
        return out


class Pinned(np.ndarray):
    """A 'pinned' host staging buffer."""


@pytest.fixture(params=["staged", "direct"])
def fake_gpu(request, monkeypatch):
    """buffers pointed at FakeDevice, DOMAINPAR_CUDA_AWARE forcing the path, and
    a log of what the exchanges do: 'sync' (wait for the device stream), 'unpack'
    (a halo box written from a received buffer), 'write' (a copy into a device
    array)."""
    log = []

    class LoggedNumpy:  # what buffers.namespace gives for a device array
        def __getattr__(self, name):
            return getattr(np, name)

        def copyto(self, dst, src, **kw):
            log.append("write")
            np.copyto(dst, src, **kw)

    logged = LoggedNumpy()
    monkeypatch.setattr(buffers, "namespace",
                        lambda arr: logged if isinstance(arr, FakeDevice) else np)
    monkeypatch.setattr(buffers, "is_device", lambda a: isinstance(a, FakeDevice))
    monkeypatch.setattr(buffers, "empty", lambda shape, dtype, like: (
        np.empty(shape, dtype).view(FakeDevice) if isinstance(like, FakeDevice)
        else np.empty(shape, dtype)))
    monkeypatch.setattr(buffers, "pinned_empty", lambda n: np.empty(n, np.uint8).view(Pinned))
    monkeypatch.setattr(buffers, "to_device", lambda host: host.copy().view(FakeDevice))
    monkeypatch.setattr(buffers, "synchronize",
                        lambda arr: log.append("sync") if isinstance(arr, FakeDevice) else None)
    unpack = halo_module._Plan._unpack

    def logged_unpack(self, view, buf, add):
        log.append("unpack")
        return unpack(self, view, buf, add)
    monkeypatch.setattr(halo_module._Plan, "_unpack", logged_unpack)
    monkeypatch.setenv("DOMAINPAR_CUDA_AWARE", "1" if request.param == "direct" else "0")
    runtime.cuda_aware_mpi.cache_clear()
    FakeDevice.gets = 0
    yield request.param, log
    runtime.cuda_aware_mpi.cache_clear()


def _check_wires(halo, staged):
    """Staged: every box goes through a pinned buffer (sums included). Direct:
    contiguous boxes straight from the array, others packed on the device."""
    (plan,) = [p for p in halo._plans.values() if p.device]
    assert plan.staged is staged
    for sends, recvs in plan.rounds:
        for w in sends + recvs:
            if w.mode == "local":
                continue
            bufs = [b for b in (w.buf, w.sum_buf) if b is not None]
            if staged:
                assert w.mode == "pack" and all(isinstance(b, Pinned) for b in bufs), w
            else:
                assert w.mode in ("direct", "pack") and not any(isinstance(b, Pinned) for b in bufs)
                assert (w.mode == "direct") == (w.buf is None)


@pytest.mark.mpi
@pytest.mark.parametrize("grid_ndim,seed", [(1, 0), (1, 3), (2, 1), (2, 5), (3, 2), (4, 4)])
def test_halo_on_both_paths(grid_ndim, seed, fake_gpu):
    path, log = fake_gpu
    _, dec, width = random_layout(seed, COMM, grid_ndim)
    halo = dp.HaloExchange(dec, width)
    glob = global_array(dec.global_shape, seed)
    rng = np.random.default_rng(seed + 1000 * COMM.Get_rank())
    host = rng.standard_normal(halo.padded_shape)
    host[halo.owned] = glob[dec.local_slices()]
    dev = host.copy().view(FakeDevice)
    log.clear()
    halo.fill(dev)
    np.testing.assert_array_equal(dev, reference_fill(glob, halo, host))
    assert log.count("sync") >= len(halo._rounds)  # before each round's sends ...
    if log:
        assert log[-1] == "sync"  # ... and after the last write to the array
    x, y = rng.standard_normal((2,) + halo.padded_shape)
    log.clear()
    aty = halo.accumulate(y.copy().view(FakeDevice))
    if log:
        assert log[-1] == "sync"
    np.testing.assert_array_equal(aty, halo.accumulate(y.copy()))  # numpy's own exchange
    fx = halo.fill(x.copy().view(FakeDevice))
    assert adjoint_error(np.asarray(fx), y, x, np.asarray(aty), COMM) < 1e-13
    _check_wires(halo, path == "staged")
    if path == "staged" and any(p.peer != COMM.Get_rank() for _, s, r in halo._rounds
                                for p in s + r):
        assert FakeDevice.gets > 0  # boxes were copied off the "device"


class _CheckedComm:
    """A communicator that records whether MPI was handed device memory."""

    def __init__(self, comm):
        self.comm, self.saw_device = comm, False

    def __getattr__(self, name):
        method = getattr(self.comm, name)

        def call(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                for part in (a if isinstance(a, (list, tuple)) else [a]):
                    self.saw_device |= isinstance(part, FakeDevice)
            return method(*args, **kwargs)
        return call


@pytest.mark.mpi
def test_collectives_on_both_paths(fake_gpu):
    path, log = fake_gpu
    size, rank = COMM.Get_size(), COMM.Get_rank()
    comm = _CheckedComm(COMM)

    def settled():
        """The last write into a device array, if any, was waited for."""
        writes = [i for i, event in enumerate(log) if event == "write"]
        done = not writes or "sync" in log[writes[-1]:]
        log.clear()
        return done

    base = np.zeros((4, 6)).view(FakeDevice)
    a = base[:, ::2]  # strided: reduced through a contiguous copy
    a[...] = rank + 1
    log.clear()
    assert collectives.allreduce(a, comm) is a
    assert (np.asarray(a) == size * (size + 1) / 2).all() and (np.asarray(base[:, 1::2]) == 0).all()
    assert settled()
    b = np.full(5, float(rank)).view(FakeDevice)
    collectives.iallreduce(b, comm, "max").wait()
    assert (np.asarray(b) == size - 1).all() and settled()
    c = np.full(3, float(rank)).view(FakeDevice)
    collectives.bcast(c, comm, root=size - 1)
    assert (np.asarray(c) == size - 1).all() and settled()
    send, recv = np.arange(4.0).view(FakeDevice) + rank, np.zeros(4).view(FakeDevice)
    pairwise.mirror_exchange(send, recv, comm)
    assert (np.asarray(recv) == np.arange(4.0) + size - 1 - rank).all() and settled()
    recv = np.zeros(4).view(FakeDevice)
    pairwise.ring_shift([send], [recv], comm).wait()
    assert (np.asarray(recv) == np.arange(4.0) + (rank - 1) % size).all() and settled()
    if size > 1:
        assert comm.saw_device is (path == "direct")
        assert (FakeDevice.gets > 0) is (path == "staged")
    grid = dp.ProcessGrid((size,))
    src = dp.Decomposition((7, 3), grid, shard={0: 0}, sizes={0: [7] + [0] * (size - 1)})
    dst = dp.Decomposition((7, 3), grid, shard={1: 0})
    glob = global_array((7, 3), 9)
    out = collectives.repartition(glob[src.local_slices()].copy().view(FakeDevice), src, dst)
    assert isinstance(out, FakeDevice)
    np.testing.assert_array_equal(out, glob[dst.local_slices()])
    whole = collectives.allgatherv(out, dst)
    assert isinstance(whole, FakeDevice)
    np.testing.assert_array_equal(whole, glob)
