"""examples/seed_conv.py, the seed's example, runs under mpiexec on 2 ranks at a
small size and reports blocks cut along H and agreement with one process.

Serial (not marked mpi): the test launches its own mpiexec.
"""
import re
import subprocess
import sys
from pathlib import Path

from domainpar import launch

ROOT = Path(__file__).resolve().parent.parent


def _env():
    """The environment the CLI gives its own mpiexec jobs, with this checkout importable."""
    return dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT))


def test_seed_example_on_two_ranks():
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable,
                           str(ROOT / "examples" / "seed_conv.py"), "--size", "66",
                           "--channels", "3"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # H = 66 cut in two along dim 2; W whole
    assert "rank 0: local gradient shape (1, 3, 33, 66)" in out, out
    assert "rank 1: local gradient shape (1, 3, 33, 66)" in out, out
    for what in ("output", "input gradient", "weight gradient"):
        match = re.search(rf"{what}: max \|difference\| (\S+) \((\S+) of", out)
        assert match, out
        assert float(match.group(2)) <= 1e-5, out
    assert out.rstrip().endswith("seed example OK"), out
