"""`domainpar bench balance` end to end at tiny sizes on 2 ranks: JSON with both
layouts per case, per-rank compute and blocked time, the ideal step, and a PNG
beside it. Serial (not marked mpi): the command launches its own mpiexec job.
No timing is asserted: only that the report holds what it says it does."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from domainpar import launch

ROOT = Path(__file__).resolve().parent.parent


def test_bench_balance_reports_both_layouts(tmp_path):
    out = tmp_path / "balance.json"
    proc = subprocess.run(
        [sys.executable, "-m", "domainpar.cli", "bench", "balance", "-n", "2",
         "--side", "24", "--channels", "2", "--layers", "1", "--points", "600", "--passes", "2",
         "--settle", "3", "--repeats", "2", "--clock", "cpu", "--out", str(out)],
        env=dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == "balance" and report["ranks"] == 2
    assert report["slow_rank"] == 1 and report["clock"] == "cpu"
    assert sorted(report["cases"]) == ["grid", "points"] and not report["skipped"]
    for case, result in report["cases"].items():
        for layout in ("even", "balanced"):
            assert len(result["samples_s"][layout]) == 2
            per_rank = result["per_rank"][layout]
            assert len(per_rank["compute_s"]) == len(per_rank["blocked_s"]) == 2
        blocks = result["sizes" if case == "grid" else "counts"]
        total = 24 if case == "grid" else 600
        assert sum(blocks["even"]) == sum(blocks["balanced"]) == total
        assert result["ideal_step_s"] > 0 and result["balanced_over_ideal"] > 0
        assert len(result["balancer"]["history"]) >= 1
        assert result["ideal_plus_communication_s"] >= result["ideal_step_s"]
        assert f"{case:<7} even" in proc.stdout
    assert len(report["loadavg_start_end"]) == 2
    png = out.with_suffix(".png")
    pytest.importorskip("matplotlib", reason="matplotlib is needed for the PNG")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
