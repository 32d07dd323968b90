"""dp.io under faults and hostile files (issue 17).

- A file or directory that one rank sees and another does not (a path on a
  filesystem that is not shared): read, write, save_checkpoint and
  load_checkpoint raise the same DataError on every rank instead of hanging in
  the collective open. The test gives each rank its own working directory and
  the same relative path, which exists in rank 0's directory only.
- ``extra`` values ``load_checkpoint`` could not read back are refused at save
  time; every way a checkpoint can be broken loads as a DataError.
- Crafted files cannot make io read other local files: external storage,
  external links and virtual sources other than the file's own part files are
  refused.
- A checkpoint save killed (SIGKILL) at random moments, again and again, always
  leaves a complete checkpoint: the previous one or the new one.
"""
from __future__ import annotations

import io
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar import launch
from domainpar.io import checkpoint
from domainpar.testing import raises_on_every_rank, shard_like
from io_cases import COMM, RANK, SIZE, fresh
from tensor_cases import global_tensor

E = dp.io.DataError
two_ranks = pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks: a path one rank sees and "
                                                "another does not")


def _x(grid, n=4):
    return shard_like(global_tensor((1, 1, n * SIZE)), grid, {2: 0})


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2).double()


# -- 5: a path some ranks see and others do not --------------------------------------------
@pytest.fixture
def own_cwd(shared_dir, monkeypatch):
    """Each rank works in a directory of its own; rank 0's holds ``data.h5`` (a
    dataset ``u``), ``ckpt.h5`` (a checkpoint saved on rank 0 alone) and a
    directory ``out``; the other ranks' hold nothing. So the same relative path
    names a file on rank 0 and nothing elsewhere, as on a non-shared filesystem."""
    base = fresh(shared_dir, "cwd")[:-3]
    mine = os.path.join(base, f"rank{RANK}")
    os.makedirs(mine)
    monkeypatch.chdir(mine)
    if RANK == 0:
        with h5py.File("data.h5", "w") as f:
            f["u"] = np.arange(4.0 * SIZE).reshape(1, 1, -1)
        os.mkdir("out")
        alone = dp.ProcessGrid((1,), comm=MPI.COMM_SELF)
        x = shard_like(global_tensor((1, 1, 4)), alone, {2: 0})
        dp.io.save_checkpoint("ckpt.h5", _model(), tensors={"x": x}, extra={"step": 1})
    COMM.Barrier()
    return mine


@pytest.mark.mpi
@two_ranks
def test_read_of_a_file_only_rank0_sees(own_cwd, mode):
    grid = dp.ProcessGrid((SIZE,))
    raises_on_every_rank(E, ["data.h5", "no such file", "rank 0"],
                         lambda: dp.io.read("data.h5", "u", grid, {2: 0}))


@pytest.mark.mpi
@two_ranks
def test_write_into_a_directory_only_rank0_has(own_cwd, mode):
    grid = dp.ProcessGrid((SIZE,))
    raises_on_every_rank(E, ["out", "no such directory"],
                         lambda: dp.io.write("out/new.h5", "u", _x(grid)))


@pytest.mark.mpi
@two_ranks
def test_write_into_a_file_only_rank0_has(own_cwd, mode):
    grid = dp.ProcessGrid((SIZE,))
    raises_on_every_rank(E, ["data.h5", "rank 0"], lambda: dp.io.write("data.h5", "v", _x(grid)))


@pytest.mark.mpi
@two_ranks
def test_save_checkpoint_into_a_directory_only_rank0_has(own_cwd, mode):
    grid = dp.ProcessGrid((SIZE,))
    raises_on_every_rank(E, ["out", "no such directory"],
                         lambda: dp.io.save_checkpoint("out/ckpt.h5", _model(),
                                                       tensors={"x": _x(grid)}))
    assert os.listdir("out" if RANK == 0 else ".") == []  # nothing left half-written


@pytest.mark.mpi
@two_ranks
def test_load_checkpoint_only_rank0_sees(own_cwd, mode):
    grid = dp.ProcessGrid((SIZE,))
    raises_on_every_rank(E, ["ckpt.h5", "rank 0"],
                         lambda: dp.io.load_checkpoint("ckpt.h5", _model(), grid=grid))


# -- 10: extra that cannot be loaded back; every broken checkpoint is a DataError ------------
UNLOADABLE = [("rng", np.random.get_state(), "numpy.ndarray"),
              ("where", pathlib.Path("/tmp/run"), "PosixPath"),
              ("loss", np.float64(0.5), "numpy.float64")]


@pytest.mark.mpi
@pytest.mark.parametrize("key,value,kind", UNLOADABLE, ids=[u[0] for u in UNLOADABLE])
def test_extra_that_cannot_be_loaded_is_refused_at_save(shared_dir, mode, key, value, kind):
    grid = dp.ProcessGrid((SIZE,))
    path = fresh(shared_dir, "extra")
    raises_on_every_rank(E, [f"extra['{key}']", kind],
                         lambda: dp.io.save_checkpoint(path, _model(), tensors={"x": _x(grid)},
                                                       extra={"step": 3, key: value}))
    assert not [p for p in os.listdir(shared_dir) if os.path.basename(path) in p]
    # What can be read back is stored and comes back equal.
    fine = {"step": 3, "rng": np.random.default_rng(5).bit_generator.state,
            "torch_rng": torch.get_rng_state(), "where": str(value)}
    dp.io.save_checkpoint(path, _model(), tensors={"x": _x(grid)}, extra=fine)
    back = dp.io.load_checkpoint(path, grid=grid).extra
    assert back["rng"] == fine["rng"] and torch.equal(back["torch_rng"], fine["torch_rng"])


def _blob(obj) -> np.ndarray:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return np.frombuffer(buffer.getvalue(), dtype=np.uint8)


def _craft(path: str, blob=None, shard="{\"2\": 0}", fmt=checkpoint.FORMAT) -> None:
    """Rank 0: a checkpoint file with the given state bytes (a correct crc32) and
    one tensor ``x`` with the given shard attribute (None: no attribute)."""
    with h5py.File(path, "w") as f:
        f.attrs.update({"format": fmt, "version": checkpoint.VERSION, "ranks": 1})
        if blob is not None:
            f["state"] = blob
            f["state"].attrs["crc32"] = zlib.crc32(blob.tobytes())
        x = f.create_dataset("tensors/x", data=np.zeros((1, 1, 4)))
        if shard is not None:
            x.attrs["shard"] = shard


GOOD = {"model": None, "optimizer": None, "extra": 1}
BROKEN = {"not a pickle": dict(blob=np.frombuffer(b"garbage" * 20, np.uint8)),
          "unpicklable numpy": dict(blob=_blob({**GOOD, "extra": np.zeros(2)})),
          "not a dict": dict(blob=_blob([1, 2])),
          "missing keys": dict(blob=_blob({"optimizer": None, "extra": 1})),
          "no state": dict(blob=None),
          "no shard map": dict(blob=_blob(GOOD), shard=None),
          "bad shard json": dict(blob=_blob(GOOD), shard="{2: 0"),
          "bad shard map": dict(blob=_blob(GOOD), shard="{\"x\": [1]}"),
          "wrong format": dict(blob=_blob(GOOD), fmt="something-else")}


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(BROKEN) + ["empty file", "truncated"])
def test_every_broken_checkpoint_is_a_data_error(shared_dir, case):
    grid = dp.ProcessGrid((SIZE,))
    path = fresh(shared_dir, "craft")
    if RANK == 0:
        if case in BROKEN:
            _craft(path, **BROKEN[case])
        else:
            _craft(path, _blob(GOOD))
            raw = open(path, "rb").read()
            open(path, "wb").write(b"" if case == "empty file" else raw[:len(raw) // 3])
    COMM.Barrier()
    raises_on_every_rank(E, [path], lambda: dp.io.load_checkpoint(path, _model(), grid=grid))


# -- 11: crafted files cannot read other local files -----------------------------------------
SECRET = np.arange(1000.0, 1016.0)  # stands for a local file the process may read


def _secret(directory: str) -> str:
    path = os.path.join(directory, "secret.bin")
    if RANK == 0:
        SECRET.tofile(path)
    return path


def _leaked(t) -> bool:
    return bool(torch.isin(t.to_local(), torch.as_tensor(SECRET)).any())


@pytest.mark.mpi
def test_external_storage_is_refused(shared_dir, mode):
    grid = dp.ProcessGrid((SIZE,))  # not sharded: every rank reads it all
    secret = _secret(shared_dir)
    data, ckpt = fresh(shared_dir, "external"), fresh(shared_dir, "external-ckpt")
    if RANK == 0:
        with h5py.File(data, "w") as f:
            f.create_dataset("u", shape=(16,), dtype="f8", external=[(secret, 0, 128)])
        _craft(ckpt, _blob(GOOD), shard="{}")
        with h5py.File(ckpt, "a") as f:
            del f["tensors/x"]
            f.create_dataset("tensors/x", shape=(16,), dtype="f8", external=[(secret, 0, 128)])
            f["tensors/x"].attrs["shard"] = "{}"
    COMM.Barrier()
    got = []

    def read():
        got.append(dp.io.read(data, "u", grid))

    def load():
        got.append(dp.io.load_checkpoint(ckpt, grid=grid).tensors["x"])
    raises_on_every_rank(E, ["external storage"], read)
    raises_on_every_rank(E, ["external storage"], load)
    assert not any(_leaked(t) for t in got)


@pytest.mark.mpi
def test_external_link_is_refused(shared_dir, mode):
    grid = dp.ProcessGrid((SIZE,))
    other, data = fresh(shared_dir, "other"), fresh(shared_dir, "link")
    if RANK == 0:
        with h5py.File(other, "w") as f:
            f["u"] = SECRET
        with h5py.File(data, "w") as f:
            f["u"] = h5py.ExternalLink(other, "u")
    COMM.Barrier()
    raises_on_every_rank(E, ["external link"], lambda: dp.io.read(data, "u", grid))


@pytest.mark.mpi
def test_virtual_sources_other_than_own_parts_are_refused(shared_dir, mode):
    grid = dp.ProcessGrid((SIZE,))
    other, data = fresh(shared_dir, "other"), fresh(shared_dir, "virtual")
    if RANK == 0:
        with h5py.File(other, "w") as f:
            f["u"] = SECRET
        layout = h5py.VirtualLayout(shape=(16,), dtype="f8")
        layout[:] = h5py.VirtualSource(os.path.abspath(other), "u", shape=(16,))
        with h5py.File(data, "w") as f:
            f.create_virtual_dataset("u", layout)
            # The right name, a directory up: still not this file's part.
            layout[:] = h5py.VirtualSource(os.path.join("..", os.path.basename(data)
                                                        + ".rank0.h5"), "u", shape=(16,))
            f.create_virtual_dataset("w", layout)
    COMM.Barrier()
    raises_on_every_rank(E, ["virtual", other], lambda: dp.io.read(data, "u", grid, {0: 0}))
    raises_on_every_rank(E, "virtual", lambda: dp.io.read(data, "w", grid, {0: 0}))
    # domainpar's own virtual datasets (the serial fallback's output) still read.
    x = _x(grid)
    own = fresh(shared_dir, "own")
    with dp.io.forced_mode("serial"):
        dp.io.write(own, "u", x)
        dp.io.save_checkpoint(own + ".ckpt", _model(), tensors={"x": x})
    assert torch.equal(dp.io.read(own, "u", grid, {2: 0}).to_local(), x.to_local())
    back = dp.io.load_checkpoint(own + ".ckpt", grid=grid).tensors["x"]
    assert torch.equal(back.to_local(), x.to_local())


# -- a checkpoint save killed at random moments ----------------------------------------------
WORKER = str(Path(__file__).with_name("io_worker.py"))
KILLS = 6


def _job(directory: Path, ranks: int, io_mode: str) -> subprocess.Popen:
    env = dict(launch.mpiexec_env(), PYTHONPATH=str(Path(__file__).resolve().parent.parent),
               DOMAINPAR_IO=io_mode)
    return subprocess.Popen(["mpiexec", "-n", str(ranks), sys.executable, WORKER, "save-loop",
                             str(directory)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` at once: mpiexec and its ranks (the
    ranks run in process groups of their own)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) == sid:
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait_gone(sid: int, timeout: float = 30) -> None:
    """Until no process of session ``sid`` is left (zombies aside)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                alive.append(stat.parent.name)
        if not alive:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes {alive} of the killed job are still running")


def _check_complete(path: Path, at_least: int) -> None:
    """The checkpoint at ``path`` is one whole save: its step, model, tensors and
    extra all agree, and it is not older than step ``at_least``."""
    model = _model()
    ck = dp.io.load_checkpoint(path, model, grid=dp.ProcessGrid((1,)))
    step = ck.extra["step"]
    assert step >= at_least, (step, at_least)
    assert torch.all(model.weight == step) and torch.all(model.bias == -step)
    assert sorted(ck.tensors) == (["u", "v"] if step % 2 else ["u"])
    u = ck.tensors["u"].to_local()
    assert torch.equal(u, step * torch.arange(float(u.numel()), dtype=torch.float64).view(u.shape))
    if step % 2:
        assert torch.all(ck.tensors["v"].to_local() == step)


def test_checkpoint_save_killed_at_random_moments(tmp_path):
    """KILLS jobs (1 and 2 ranks, mpio and serial io) save checkpoints in a loop
    into the same path; each is killed with SIGKILL (mpiexec and every rank at once) at a
    random moment after its first save. Every time, the path loads as one whole
    checkpoint, the last one saved or a later one."""
    modes = ["mpio", "serial"] if dp.io.files.has_mpi() else ["serial"]
    rng = random.Random(17)
    path = tmp_path / "ckpt.h5"
    for k in range(KILLS):
        job = _job(tmp_path, 1 + k % 2, modes[(k // 2) % len(modes)])
        try:
            line = job.stdout.readline()
            assert line.startswith("SAVED"), (line, job.stderr.read()[-3000:] if not line else "")
            saved = int(line.split()[1])
            time.sleep(rng.uniform(0.0, 0.4))
        finally:
            _kill_session(job.pid)
            job.wait(timeout=30)
            _wait_gone(job.pid)
        _check_complete(path, saved)
