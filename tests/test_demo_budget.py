"""`domainpar demo --memory-per-rank`: the budget is enforced by the kernel, the
one-process training step really runs out of it and the sharded one on 2 ranks
really fits it (the demo's own code, its own field and budget, one step);
sizes parse, and a bad one is the same clear error on every rank."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from domainpar import launch
from domainpar.demo import budget, dataset, fit

ROOT = Path(__file__).resolve().parent.parent

# The demo's default field (batch 4 x 2 x 64^3, UNet width 8) and budget: one
# process needs more than 640 MiB above its baseline here, each of 2 ranks
# fits in 512 MiB (both measured under the limit), so either side of 576 MiB
# has a margin of 64 MiB.
BUDGET = 576 * 2**20
BATCH, WIDTH, SIDE = 4, 8, 64


@pytest.fixture(scope="module")
def h5(tmp_path_factory):
    """A small Gray-Scott file of the default field size (2 training pairs)."""
    path = tmp_path_factory.mktemp("budget") / "grayscott.h5"
    spec = dataset.Spec(side=SIDE, trajectories=2, pairs=2, every=5, warmup=5)
    solver, states = dataset.solve(spec, comm=MPI.COMM_SELF)
    dataset.write(path, states, solver, spec, dataset.Params())
    return path


def test_one_process_runs_out_of_the_budget_and_two_ranks_fit_it(h5, tmp_path):
    alone = budget.one_process(h5, budget=BUDGET, batch=BATCH, width=WIDTH, seed=0,
                               out=tmp_path, steps=1)
    assert alone["fits"] is False, alone
    assert alone["returncode"] == 0, alone  # caught and reported, not a crash
    assert "can't allocate memory" in alone["error"], alone
    assert alone["requested_bytes"] > 0 and alone["peak_bytes"] > BUDGET // 2, alone

    report = tmp_path / "sharded.json"
    proc = subprocess.run(
        [launch.mpiexec_path(), "-n", "2", sys.executable, "-m", "domainpar.demo.budget",
         str(h5), "--budget", str(BUDGET), "--batch", str(BATCH), "--width", str(WIDTH),
         "--steps", "1", "--report", str(report)],
        env=dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=240, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    sharded = json.loads(report.read_text())
    assert sharded["fits"] is True and sharded["ranks"] == 2, sharded
    # It ran: each rank's training step touched a good part of the budget.
    assert all(p > BUDGET // 4 for p in sharded["peaks"]), sharded


def test_the_limit_is_enforced_in_this_process():
    """enforce() makes an allocation past the budget fail (torch's error, caught)."""
    import torch
    script = ("import torch\nfrom domainpar.demo import budget\n"
              "limit = budget.enforce(64 * 2**20)\n"
              "small = torch.ones(8 * 2**20 // 4)\n"
              "try:\n    torch.ones(128 * 2**20 // 4)\nexcept RuntimeError as exc:\n"
              "    assert budget.out_of_memory(exc), exc\n    print('refused')\n"
              "limit.release()\nbig = torch.ones(128 * 2**20 // 4)\nprint('released')\n")
    assert torch  # the script imports it in a process of its own
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=budget.solo_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["refused", "released"], proc.stdout


@pytest.mark.parametrize("text, want", [("2GiB", 2 * 2**30), ("1500MiB", 1500 * 2**20),
                                        ("3e8", 300_000_000), ("none", None), ("OFF", None)])
def test_memory_per_rank_parses_sizes(text, want):
    assert budget.memory_size(text) == want


@pytest.mark.parametrize("text", ["2XB", "-1GiB", "0", "lots"])
def test_memory_per_rank_refuses_what_is_not_a_size(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a memory size|must be > 0"):
        budget.memory_size(text)


def test_a_bad_budget_is_the_same_error_on_every_rank(tmp_path):
    proc = subprocess.run(
        [launch.mpiexec_path(), "-n", "2", sys.executable, "-m", "domainpar.cli", "demo",
         "--memory-per-rank", "2XB", "--out", str(tmp_path)],
        env=dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert proc.stderr.count("argument --memory-per-rank: not a memory size: '2XB'") == 2, \
        proc.stderr[-3000:]
    assert not (tmp_path / "grayscott.h5").exists()


def test_the_plan_verdict_refuses_too_few_ranks_clearly():
    assert fit.problem({"ranks": 2, "estimates": {}}, 2) is None
    assert fit.problem({"ranks": 1, "estimates": {}}, 2) is None
    assert "run it on 4 (-n 4" in fit.problem({"ranks": 4, "estimates": {}}, 2)
    assert "no rank count fits" in fit.problem({"ranks": None, "estimates": {}}, 2)


def test_memory_png_marks_the_failed_run(tmp_path):
    from domainpar.demo import plots
    mib = 2**20
    memory = {"budget_bytes": 576 * mib, "allowance_bytes": 160 * mib,
              "plan": {"estimates": {1: 620 * mib, 2: 320 * mib, 4: 170 * mib}, "ranks": 2},
              "one_process": {"fits": False, "peak_bytes": 560 * mib,
                              "requested_bytes": 64 * mib, "error": "RuntimeError: ..."},
              "sharded_peak_bytes": [480 * mib, 478 * mib]}
    assert plots._measured(memory) == {1: (560.0, 64.0, True), 2: (480.0, None, False)}
    png = plots.memory_png(tmp_path / "memory.png", memory, title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
