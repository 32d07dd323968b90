"""`domainpar demo`, the main job: the whole job at a tiny size on 2 ranks (a
serial test that launches it), the domain-parallel Gray-Scott solver against
plain numpy on the whole box (MPI, 1 to 4 ranks, uneven blocks), and the
sharded-vs-one-process check catching a model that is wrong when sharded."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar import launch
from domainpar.demo.grayscott import Params, Solver, initial_blobs

ROOT = Path(__file__).resolve().parent.parent

# Small enough for a test, large enough that 24 steps visibly lower the loss.
# 4 training pairs in batches of 2: an epoch is 2 steps.
TINY = ["--side", "16", "--trajectories", "2", "--pairs", "4", "--every", "20",
        "--warmup", "20", "--steps", "24", "--batch", "2", "--width", "4", "--crop", "12",
        "--lr", "3e-3", "--memory-per-rank", "1GiB", "--plan-seconds", "2"]


def _demo(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "domainpar.cli", "demo", *args],
                          env=dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_demo_runs_end_to_end_on_two_ranks(tmp_path):
    proc = _demo("-n", "2", *TINY, "--out", str(tmp_path))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    for stage in ("[1/7] plan", "[2/7] solve", "[3/7] write", "[4/7] one process",
                  "[5/7] train", "[6/7] check", "[7/7] plots"):
        assert stage in proc.stdout, log[-4000:]
    assert "smallest rank count that fits the budget" in proc.stdout, log[-4000:]
    assert "check: done" in proc.stdout and "(PASSED)" in proc.stdout, log[-4000:]
    for name in ("sample.png", "loss.png", "memory.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 10_000, name  # a drawn figure, not an empty canvas
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ranks"] == 2
    assert summary["data"]["train"]["samples"] == 4 and summary["data"]["test"]["samples"] == 4
    losses = summary["training"]["loss"]
    assert len(losses) == 24
    # The loss went down: the last 3 epochs against the first 3. Whole epochs, so
    # both means cover every sample alike (the samples' changes differ 10-fold).
    assert np.mean(losses[-6:]) < 0.7 * np.mean(losses[:6]), losses
    # A 16^3 field fits 1 GiB in one process: the attempt says so, the plan too.
    memory = summary["memory"]
    assert memory["one_process"]["fits"] is True and memory["plan"]["ranks"] == 1, memory
    assert {"1", "2"} <= set(memory["plan"]["estimates"]), memory  # 4: blocks too small
    assert len(memory["sharded_peak_bytes"]) == 2, memory
    check = summary["check"]
    assert check["ok"] is True
    assert check["float64"]["output"]["max_rel"] < 1e-10, check
    assert set(check["float32"]) == {"output", "input gradient", "parameter gradients"}


def test_demo_runs_without_a_budget(tmp_path):
    proc = _demo("-n", "1", *TINY[:-4], "--steps", "2", "--memory-per-rank", "none",
                 "--out", str(tmp_path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "[1/5] solve" in proc.stdout and "[5/5] plots" in proc.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["memory"] is None
    assert not (tmp_path / "memory.png").exists()


def test_demo_refuses_bad_options_before_working(tmp_path):
    proc = _demo("-n", "1", "--trajectories", "1", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--trajectories 1: needs at least 2" in proc.stderr
    assert not (tmp_path / "grayscott.h5").exists()


def test_solver_refuses_an_unsharded_spatial_dim():
    grid = dp.ProcessGrid((1,), periodic=True, comm=MPI.COMM_SELF)
    dec = dp.Decomposition((2, 8, 8, 8), grid, shard={1: 0})
    with pytest.raises(dp.LayoutError, match="dims 1, 2, 3 must each be sharded"):
        Solver(dec)


# -- MPI: the solver on 1..4 ranks against numpy on the whole box ------------------------------
def _whole_box_steps(state: np.ndarray, params: Params, steps: int) -> np.ndarray:
    """Plain numpy Gray-Scott on the whole periodic box: np.roll neighbours, the
    Laplacian's terms in the solver's order (-z, +z, -y, +y, -x, +x, centre)."""
    s = state.copy()
    for _ in range(steps):
        lap = (np.roll(s, 1, 1) + np.roll(s, -1, 1) + np.roll(s, 1, 2) + np.roll(s, -1, 2)
               + np.roll(s, 1, 3) + np.roll(s, -1, 3) - 6.0 * s)
        u, v = s[0], s[1]
        uvv = u * v * v
        du = params.dt * (params.du * lap[0] - uvv + params.feed * (1.0 - u))
        dv = params.dt * (params.dv * lap[1] + uvv - (params.feed + params.kill) * v)
        s = np.stack([u + du, v + dv])
    return s


# Uneven on purpose: (11, 10, 7) cut by MPI's grid dims, or by explicit sizes.
SHAPE = (11, 10, 7)
SIZES = {2: {1: [7, 4]}, 3: {1: [5, 5, 1]}, 4: {1: [8, 3], 2: [1, 9]}}


@pytest.mark.mpi
@pytest.mark.parametrize("explicit_sizes", [False, True], ids=["balanced", "uneven"])
def test_solver_matches_numpy_on_the_whole_box(explicit_sizes):
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    if explicit_sizes and size not in SIZES:
        pytest.skip(f"explicit uneven sizes are written for 2 to 4 ranks, not {size}")
    dims = {1: (1, 1, 1), 2: (2, 1, 1), 3: (3, 1, 1), 4: (2, 2, 1)}.get(size, (0, 0, 0))
    grid = dp.ProcessGrid(dims, periodic=True)
    dec = dp.Decomposition((2, *SHAPE), grid, shard={1: 0, 2: 1, 3: 2},
                           sizes=SIZES.get(size) if explicit_sizes else None)
    params = Params()
    solver = Solver(dec, params)
    solver.set_state(initial_blobs(dec, seed=5))
    solver.run(40)
    whole_dec = dp.Decomposition((2, *SHAPE), dp.ProcessGrid((1, 1, 1), periodic=True,
                                                             comm=MPI.COMM_SELF),
                                 shard={1: 0, 2: 1, 3: 2})
    start = initial_blobs(whole_dec, seed=5)
    assert start[1].max() == 0.25  # some blobs landed in the box
    want = _whole_box_steps(start, params, 40)[dec.local_slices()]
    got = solver.state()
    # Same arithmetic in the same order on every cell: the same bits.
    problem = None if np.array_equal(got, want) else float(np.abs(got - want).max())
    problems = comm.allgather(problem)
    assert not any(p is not None for p in problems), problems


@pytest.mark.mpi
def test_check_catches_a_model_that_is_wrong_when_sharded():
    """A model that normalises by its block's own mean (not the global one) gives
    other numbers sharded than in one process: the check must say so."""
    from domainpar.demo import check
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("needs at least 2 ranks (on one, the block is the whole crop)")

    class BlockMean(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            if isinstance(x, dp.DomainTensor):  # the bug: a local mean on a block
                local = x.to_local()
                dec = x.decomposition
                return dp.DomainTensor.from_local(self.scale * (local - local.mean()),
                                                  dec.grid, dec.shard)
            return self.scale * (x - x.mean())

    grid = dp.ProcessGrid((MPI.COMM_WORLD.Get_size(),))
    crop = torch.linspace(0, 1, 2 * 12 ** 3).reshape(1, 2, 12, 12, 12) ** 2
    report = check.check(BlockMean(), crop, grid, {2: 0})
    assert report["ok"] is False
    assert report["float64"]["output"]["ok"] is False

    honest = check.check(torch.nn.Conv3d(2, 2, 3, padding=1), crop, grid, {2: 0})
    assert honest["ok"] is True, honest


# -- the check's float32 verdict: grounded in rounding, not in one lucky draw -----------------
def _rows(errors: dict) -> tuple[dict, dict, dict]:
    """got/want/truth dicts whose float32 errors against the truth are ``errors``:
    {name: (sharded error, one-process error)}, each relative to a scale of 1."""
    truth, want, got = {}, {}, {}
    for name, (sharded, one) in errors.items():
        base = torch.linspace(-1, 1, 9, dtype=torch.float64)
        truth[name] = base
        want[name] = (base + one).float()
        got[name] = (base + sharded).float()
    return got, want, truth


def test_float32_verdict_survives_a_one_process_run_exact_by_luck():
    """A bias that one process happens to get (almost) exactly right while the
    sharded run is a few roundings off is fine: the parameter gradients' noise
    level is the worst one-process error among them, not that lucky one. The
    rule before (each quantity within 10x its own one-process error) failed here,
    as it failed `make demo` on another CPU (sharded 1.2e-5, one process 1.5e-6)."""
    from domainpar.demo import check
    got, want, truth = _rows({"output": (2e-7, 1.5e-7), "input gradient": (1e-7, 1.2e-7),
                              "a.weight": (3e-5, 4e-5), "a.bias": (1.2e-5, 0.0),
                              "b.weight": (2e-6, 1.5e-6)})
    rows = check._compare(got, want, truth)
    assert all(row["ok"] for row in rows.values()), rows
    params = rows["parameter gradients"]
    assert params["worst"] == "a.weight"
    assert params["error_one_process"] == pytest.approx(4e-5, rel=0.05)


def test_float32_verdict_catches_an_error_beyond_the_groups_rounding():
    from domainpar.demo import check
    # 50x the parameter gradients' noise level: more than rounding can explain.
    got, want, truth = _rows({"output": (2e-7, 1.5e-7), "input gradient": (1e-7, 1.2e-7),
                              "a.weight": (2e-5, 4e-5), "a.bias": (2e-3, 1e-6)})
    rows = check._compare(got, want, truth)
    assert rows["parameter gradients"]["ok"] is False
    assert rows["parameter gradients"]["worst"] == "a.bias"
    assert rows["output"]["ok"] and rows["input gradient"]["ok"]
    # The output alone off by 30x its noise fails too.
    got, want, truth = _rows({"output": (4.5e-6, 1.5e-7), "a.weight": (2e-5, 4e-5)})
    assert check._compare(got, want, truth)["output"]["ok"] is False


def _trained_like_surrogate(seed: int):
    """The demo's UNet with weights as training leaves them: norm affine terms and
    biases away from their init, the zero-initialised head no longer zero."""
    from domainpar.demo.surrogate import Surrogate
    torch.manual_seed(seed)
    model = Surrogate(width=8)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
        torch.nn.init.normal_(model.unet.head.weight, std=0.05)
    return model, torch.rand(1, 2, 16, 16, 16) ** 3


@pytest.mark.mpi
def test_check_passes_an_honest_model_over_20_seeds():
    """The demo's check on 20 models and crops (float64 and float32): never a
    failure by rounding luck. Seen here before the per-group rule: a per-quantity
    ratio of 11 on 3 ranks (seed 11), over the old margin of 10."""
    from domainpar.demo import check
    grid = dp.ProcessGrid((MPI.COMM_WORLD.Get_size(),), periodic=True)
    failed = []
    for seed in range(20):
        model, crop = _trained_like_surrogate(seed)
        report = check.check(model, crop, grid, {2: 0})
        assert report["float64"]["parameter gradients"]["max_rel"] < 1e-10, (seed, report)
        if not report["ok"]:
            failed.append((seed, report))
    assert not failed, failed


@pytest.mark.mpi
def test_check_failing_on_rank0_alone_raises_on_every_rank():
    """The one-process run is rank 0's alone: a model that fails there (here: on a
    plain tensor only) must raise on every rank, not leave the others waiting."""
    from domainpar.demo import check
    from domainpar.testing import raises_on_every_rank

    class ShardedOnly(torch.nn.Conv3d):
        def forward(self, x):
            if not isinstance(x, dp.DomainTensor):
                raise KeyError("only sharded")
            return super().forward(x)

    grid = dp.ProcessGrid((MPI.COMM_WORLD.Get_size(),))
    crop = torch.rand(1, 2, 8, 8, 8)
    raises_on_every_rank(dp.DomainparError, "rank 0 failed: KeyError: 'only sharded'",
                         lambda: check.check(ShardedOnly(2, 2, 3, padding=1), crop, grid, {2: 0}))
