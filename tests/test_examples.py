"""The training examples (examples/unet3d.py, transformer.py, fno.py,
batch_x_domain.py) run under mpiexec at tiny sizes: they exit 0, print a final
loss and end with their check against one process ("matches one process").
unet3d.py also writes its HDF5 dataset first and resumes from its checkpoint
with the numbers of an uninterrupted run; batch_x_domain.py prints its ranks'
grid coordinates and blocks.

Serial (not marked mpi): each test launches its own mpiexec job.
"""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from domainpar import launch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TRAINING = ["unet3d.py", "transformer.py", "fno.py", "batch_x_domain.py"]


def _env():
    """The environment the CLI gives its own mpiexec jobs, with this checkout importable."""
    return dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT))


def _run(ranks, script, *args, cwd=None):
    """The example's stdout; fails with its output when it exits non-zero."""
    proc = subprocess.run([launch.mpiexec_path(), "-n", str(ranks), sys.executable,
                           str(EXAMPLES / script), *map(str, args)],
                          env=_env(), cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def _final_loss(out, steps):
    match = re.search(rf"^final loss (\S+) after {steps} steps", out, re.MULTILINE)
    assert match, out
    assert math.isfinite(float(match.group(1))), out
    return match.group(1)


def _matches(out, ranks):
    assert f"float64 check, {ranks} rank(s) against one process" in out, out
    assert out.rstrip().endswith("matches one process"), out


def _tiny_unet(data):
    return ["--size", 8, "--samples", 2, "--levels", 2, "--width", 4, "--data", data]


@pytest.fixture(scope="module")
def unet_run(tmp_path_factory):
    """unet3d.py on 2 ranks, 3 steps from a dataset it writes first: (stdout, dir)."""
    where = tmp_path_factory.mktemp("unet3d")
    out = _run(2, "unet3d.py", "--steps", 3, *_tiny_unet(where / "data.h5"),
               "--checkpoint", where / "straight.h5", cwd=where)
    return out, where


def test_unet3d_writes_its_data_trains_and_matches_one_process(unet_run):
    out, where = unet_run
    assert "does not exist: writing 2 synthetic samples (1 x 8^3, u and v)" in out, out
    assert "rank 1: coords (1, 0, 0), D 4..7, H 0..7, W 0..7" in out, out
    _final_loss(out, 3)
    _matches(out, 2)
    assert (where / "data.h5").exists() and (where / "straight.h5").exists()


def test_unet3d_resumed_run_ends_where_the_uninterrupted_one_does(unet_run):
    straight, where = unet_run
    ckpt = where / "resumed.h5"
    _run(2, "unet3d.py", "--steps", 1, *_tiny_unet(where / "data.h5"), "--checkpoint", ckpt,
         "--no-check", cwd=where)
    out = _run(2, "unet3d.py", "--steps", 3, *_tiny_unet(where / "data.h5"), "--checkpoint", ckpt,
               "--no-check", "--resume", cwd=where)
    assert "does not exist" not in out, out
    assert f"resumed from {ckpt} at step 1" in out, out
    # the samples (shuffled order) and the Adam state of the straight run
    assert _final_loss(out, 3) == _final_loss(straight, 3), out


def test_transformer_causal_ring_attention_matches_one_process():
    out = _run(2, "transformer.py", "--causal", "--length", 48, "--dim", 8, "--heads", 2,
               "--steps", 2)
    assert "causal attention" in out, out
    assert "rank 1: coords (1,), tokens 24..47" in out, out
    _final_loss(out, 2)
    _matches(out, 2)


def test_fno_distributed_fft_matches_one_process():
    out = _run(2, "fno.py", "--size", 24, "--batch", 2, "--width", 4, "--modes", 3,
               "--layers", 2, "--steps", 2)
    assert "rank 1: coords (1,), rows 12..23" in out, out
    _final_loss(out, 2)
    _matches(out, 2)


def test_batch_x_domain_on_a_2x2_grid():
    out = _run(4, "batch_x_domain.py", "--size", 12, "--batch", 3, "--width", 4, "--steps", 2)
    assert "on a 2 x 2 grid" in out, out
    # batch 3 over 2 grid rows (2 + 1 samples), H = 12 over 2 columns (6 + 6 rows)
    for line in ("rank 0: coords (0, 0), samples 0..1, rows 0..5",
                 "rank 1: coords (0, 1), samples 0..1, rows 6..11",
                 "rank 2: coords (1, 0), samples 2..2, rows 0..5",
                 "rank 3: coords (1, 1), samples 2..2, rows 6..11"):
        assert line in out, out
    _final_loss(out, 2)
    _matches(out, 4)


# Prints each script's --help in one process (torch is imported once).
HELP = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
for script in sys.argv[2:]:
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        print(f"=== {script} exit {exc.code}", flush=True)
"""


def test_examples_explain_themselves_with_help():
    proc = subprocess.run([sys.executable, "-c", HELP, str(EXAMPLES),
                           *(str(EXAMPLES / script) for script in TRAINING)],
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    texts = re.split(r"^=== .* exit (\S+)$", proc.stdout, flags=re.MULTILINE)
    assert len(texts) == 2 * len(TRAINING) + 1, proc.stdout
    for script, out, code in zip(TRAINING, texts[0::2], texts[1::2]):
        assert code in ("0", "None"), (script, out)
        assert "mpiexec -n" in out and f"examples/{script}" in out, out
        assert "--steps" in out and "--no-check" in out, out
