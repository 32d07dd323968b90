"""dp.io in jobs of their own (launched under mpiexec from a one-process test):
peak memory of reading one sample's block, and a checkpoint save killed with
SIGKILL in the middle, after which the previous checkpoint is intact and loads."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import domainpar as dp
from domainpar import launch

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).with_name("io_worker.py"))


def _env(**extra):
    return dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT), **extra)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's clear_refs")
def test_reading_a_sample_costs_about_its_block(tmp_path):
    """2 ranks read sample 1 of a (2, 1, 4096, 4096) float32 dataset (128 MiB, 4x a
    rank's 32 MiB block): each rank's peak RSS rises by at most 1.3x its block,
    under mpio (collective) and under the serial fallback."""
    result = tmp_path / "memory.json"
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, WORKER, "memory", str(tmp_path),
                           str(result)], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(result.read_text())
    for rank, modes in enumerate(report["ranks"]):
        for mode, m in modes.items():
            assert m["correct"], (rank, mode)
            assert report["dataset_kib"] >= 4 * m["block_kib"]
            assert m["rise_kib"] <= 1.3 * m["block_kib"], (rank, mode, m)


@pytest.mark.parametrize("mode", ["mpio", "serial"])
def test_checkpoint_killed_mid_write_leaves_the_previous_one(tmp_path, mode):
    if mode == "mpio" and not dp.io.files.has_mpi():
        pytest.skip("h5py without MPI")
    proc = subprocess.Popen(["mpiexec", "-n", "2", sys.executable, WORKER, "killed-save",
                             str(tmp_path)], env=_env(DOMAINPAR_IO=mode),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("STALLED"):
            line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        os.kill(int(line.split()[1]), signal.SIGKILL)  # rank 0, the one that would commit
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    path = tmp_path / "ckpt.h5"
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    ck = dp.io.load_checkpoint(path, model, grid=dp.ProcessGrid((1,)))
    assert ck.extra == {"name": "A"} and sorted(ck.tensors) == ["u"]
    u = torch.arange(16.0, dtype=torch.float64).view(1, 1, -1)
    assert torch.equal(ck.tensors["u"].to_local(), u)
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)
    # It was killed mid-write: its temporary main file is there.
    left = sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name)
    assert any(n.endswith(".tmp-" + n.split(".tmp-")[1].split(".")[0]) for n in left), left
    # The next save commits and clears what the killed one left.
    dp.io.save_checkpoint(path, model, tensors={"u": ck.tensors["u"]}, extra={"name": "C"})
    assert dp.io.load_checkpoint(path, grid=dp.ProcessGrid((1,))).extra == {"name": "C"}
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name and p.name.split(".tmp-")[1][:12]
                in {n.split(".tmp-")[1][:12] for n in left}]
