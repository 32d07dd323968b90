"""dp.io checkpoints: a same-count round trip on every rank count (model,
optimizer, DomainTensors, extra), a save replacing an older one, a checkpoint
saved on a 2x2 grid that continues training on 2 ranks and on 1 to the result
of the uninterrupted run (sub-communicators of one 4-rank job), and broken
checkpoints as the same error on every rank."""
from __future__ import annotations

import glob
import os

import h5py
import pytest
import torch
import torch.nn.functional as F

import domainpar as dp
from domainpar.testing import check_on_every_rank, raises_on_every_rank, shard_like
from io_cases import COMM, RANK, SIZE, fresh
from tensor_cases import global_tensor, layout

pytestmark = pytest.mark.mpi

SHAPE = (1, 2, 10, 9)


def _model(seed: int):
    torch.manual_seed(seed)  # the same parameters on every rank
    return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.Tanh(),
                               torch.nn.Conv2d(4, 1, 3, padding=1)).double()


def _train(model, opt, x, target, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), target).backward()
        opt.step()


def _data():
    x = global_tensor(SHAPE, torch.float64, seed=11)
    return x, torch.tanh(x[:, :1].roll(1, dims=2))


def _state(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()})


def _same_state(a, b, rtol=1e-10, atol=1e-12) -> list[str]:
    problems = []
    for k in a[0]:
        if not torch.allclose(a[0][k], b[0][k], rtol=rtol, atol=atol):
            problems.append(f"parameter {k}")
    for k in a[1]:
        for n in a[1][k]:
            if not torch.allclose(a[1][k][n], b[1][k][n], rtol=rtol, atol=atol):
                problems.append(f"optimizer state {k}.{n}")
    return problems


def test_round_trip_on_the_same_ranks(shared_dir, mode):
    grid, shard, sizes = layout(SHAPE, (2, 3), 2, "uneven")
    gx, gt = _data()
    x, t = shard_like(gx, grid, shard, sizes), shard_like(gt, grid, shard, sizes)
    b = shard_like(global_tensor((3, 2 * SIZE + 1), torch.float32, seed=2).bfloat16(),
                   grid, {1: 0})
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, x, t, 2)
    path = fresh(shared_dir, "ckpt")
    dp.io.save_checkpoint(path, model, opt, tensors={"x": x, "b": b}, extra={"step": 2})
    saved = _state(model, opt)
    _train(model, opt, x, t, 1)  # move away from the saved state
    ck = dp.io.load_checkpoint(path, model, opt, grid=grid, shard={"b": {1: 0}}, sizes={"x": sizes})
    problems = _same_state(_state(model, opt), saved, rtol=0, atol=0)
    if ck.extra != {"step": 2}:
        problems.append(f"extra {ck.extra}")
    if not torch.equal(ck.tensors["x"].to_local(), x.to_local()):
        problems.append("tensor x")
    got_b = ck.tensors["b"]
    if got_b.dtype != torch.bfloat16 or not torch.equal(got_b.to_local(), b.to_local()):
        problems.append("tensor b")
    # A second save replaces the first; the first one's part files and the
    # temporary files are gone, only the new checkpoint's remain.
    dp.io.save_checkpoint(path, model, opt, tensors={"x": 2 * x}, extra={"step": 3})
    ck = dp.io.load_checkpoint(path, grid=grid, sizes=sizes)
    if ck.extra != {"step": 3} or not torch.equal(ck.tensors["x"].to_local(), 2 * x.to_local()):
        problems.append("second save")
    if RANK == 0:
        left = glob.glob(glob.escape(path) + ".tmp-*")
        with h5py.File(path, "r") as f:
            x_set = f["tensors/x"]
            sources = {s.file_name for s in x_set.virtual_sources()} if x_set.is_virtual else set()
        if {os.path.basename(p) for p in left} != sources:
            problems.append(f"left over {left}, referenced {sources}")
    check_on_every_rank(not problems, problems)


@pytest.mark.skipif(SIZE != 4, reason="saves on a 2x2 grid of 4 ranks")
def test_saved_on_2x2_continues_on_2_ranks_and_on_1(shared_dir, mode):
    grid = dp.ProcessGrid((2, 2))
    shard = {2: 0, 3: 1}
    gx, gt = _data()
    x, t = shard_like(gx, grid, shard), shard_like(gt, grid, shard)
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, x, t, 2)
    path = fresh(shared_dir, "restart")
    dp.io.save_checkpoint(path, model, opt, tensors={"x": x, "t": t}, extra={"step": 2})
    _train(model, opt, x, t, 3)
    uninterrupted = _state(model, opt)
    # Restart: ranks 0-1 as a 2-rank job (cut along dim 3 this time), ranks 2 and
    # 3 each as a 1-rank job; fresh models with other initial parameters.
    color = 0 if RANK < 2 else RANK - 1
    sub = COMM.Split(color, RANK)
    sub_grid = dp.ProcessGrid((sub.Get_size(),), comm=sub)
    restarted = _model(100 + color)
    opt2 = torch.optim.Adam(restarted.parameters(), lr=1e-2)
    ck = dp.io.load_checkpoint(path, restarted, opt2, grid=sub_grid,
                               shard={3: 0} if color == 0 else {2: 0})
    problems = []
    if ck.tensors["x"].decomposition.grid.size != sub.Get_size() or ck.extra != {"step": 2}:
        problems.append("loaded layout or extra")
    if not torch.equal(ck.tensors["x"].full_tensor(), gx):
        problems.append("loaded x")
    _train(restarted, opt2, ck.tensors["x"], ck.tensors["t"], 3)
    problems += _same_state(_state(restarted, opt2), uninterrupted)
    sub.Free()
    check_on_every_rank(not problems, problems)


def test_broken_checkpoints(shared_dir, mode):
    grid = dp.ProcessGrid((SIZE,))
    model = _model(0)
    path = fresh(shared_dir, "broken")
    x = shard_like(global_tensor((1, 1, 4 * SIZE)), grid, {2: 0})
    dp.io.save_checkpoint(path, model, tensors={"x": x})
    E = dp.io.DataError
    raises_on_every_rank(E, ["no such file"],
                         lambda: dp.io.load_checkpoint(path + ".nope", model, grid=grid))
    raises_on_every_rank(E, ["holds no optimizer state"],
                         lambda: dp.io.load_checkpoint(path, model, torch.optim.SGD(
           model.parameters(), lr=1), grid=grid))
    other = fresh(shared_dir, "plain")
    corrupt, truncated = fresh(shared_dir, "corrupt"), fresh(shared_dir, "truncated")
    if RANK == 0:
        with h5py.File(other, "w") as f:
            f["u"] = [1.0]
        raw = bytearray(open(path, "rb").read())
        with h5py.File(path, "r") as f:
            offset = f["state"].id.get_offset()
        raw[offset + 100] ^= 0xFF  # one flipped byte inside the pickled state
        open(corrupt, "wb").write(raw)
        open(truncated, "wb").write(raw[: len(raw) // 2])
    COMM.Barrier()
    raises_on_every_rank(E, ["not a domainpar checkpoint"],
                         lambda: dp.io.load_checkpoint(other, model, grid=grid))
    raises_on_every_rank(E, ["corrupt (crc32 mismatch)"],
                         lambda: dp.io.load_checkpoint(corrupt, model, grid=grid))
    raises_on_every_rank(E, ["not a readable HDF5 file"],
                         lambda: dp.io.load_checkpoint(truncated, model, grid=grid))
    raises_on_every_rank(E, ["without '/'"],
                         lambda: dp.io.save_checkpoint(path, model, tensors={"a/b": x}))
