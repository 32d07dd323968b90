"""README.md's quickstart runs as written on 4 ranks, and its losses are the
ones plain PyTorch gives on the whole field in one process; the README stays a
front page (the rest lives in docs/, tests/test_docs.py).

Serial (not marked mpi): the test launches its own mpiexec.
"""
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn

from domainpar import launch
from training import train

ROOT = Path(__file__).resolve().parent.parent


def _quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"## Quickstart\s+```python\n(.*?)```", text, re.S)
    assert match, "README.md has no python block under '## Quickstart'"
    return match.group(1)


def _one_process_losses(steps: int) -> list[float]:
    """The quickstart's training, in plain PyTorch on the whole field."""
    torch.manual_seed(0)
    field = torch.randn(1, 2, 64, 64, 64)
    target = torch.randn(1, 2, 64, 64, 64)
    model = nn.Sequential(nn.Conv3d(2, 16, 3, padding=1), nn.GELU(),
                          nn.Conv3d(16, 2, 3, padding=1))
    return train(model, field, target, model.parameters(), steps,
                 optimizer=lambda params: torch.optim.Adam(params, lr=1e-3))


def test_quickstart_runs_on_four_ranks_with_one_process_numbers(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(_quickstart())
    proc = subprocess.run(["mpiexec", "-n", "4", sys.executable, str(script)],
                          env=dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split(maxsplit=2) for line in proc.stdout.splitlines()]
    assert len(rows) == 10, proc.stdout
    assert all(r[2] == "torch.Size([1, 2, 32, 32, 64])" for r in rows), proc.stdout
    sharded = [float(r[1]) for r in rows]
    expected = _one_process_losses(len(rows))
    torch.testing.assert_close(torch.tensor(sharded, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-5, atol=0)


def test_readme_stays_a_front_page():
    """What a newcomer needs first (what, two commands, the quickstart, the models
    that run, links); reference text, guides and figures go to docs/ (issue 19)."""
    text = (ROOT / "README.md").read_text()
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[:2] == ["Two commands", "Quickstart"], sections
    assert "Documentation" in sections, sections
    lines = len(text.splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move detail to a page in docs/"
