"""Runtime: init, abort on an uncaught exception, the capability report, the CLI."""
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import domainpar as dp
from domainpar import launch
from domainpar.comm import runtime

ROOT = Path(__file__).resolve().parent.parent


def mpiexec_env():
    """The environment the CLI gives its own mpiexec jobs, with this checkout importable."""
    return dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT))


def test_init_is_idempotent_without_mpiexec():
    comm = dp.init()
    assert dp.init() is comm
    grid = dp.ProcessGrid()
    assert grid.size == comm.Get_size()


def test_capability_report_names_every_item():
    report = runtime.capabilities()
    for key in ("mpi_library", "world_size", "cuda_aware_mpi", "cuda_aware_mpi_how", "cupy",
                "h5py", "native_kernels"):
        assert key in report
    assert report["cuda_aware_mpi"] in ("yes", "no", "unknown")


def test_cuda_aware_override(monkeypatch):
    runtime.cuda_aware_mpi.cache_clear()
    monkeypatch.setenv("DOMAINPAR_CUDA_AWARE", "1")
    try:
        assert runtime.cuda_aware_mpi() == (True, "forced by DOMAINPAR_CUDA_AWARE=1")
    finally:
        runtime.cuda_aware_mpi.cache_clear()


def test_uncaught_exception_on_one_rank_aborts_the_job(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(textwrap.dedent("""
        import domainpar as dp
        comm = dp.init()
        if comm.rank == 1:
            raise RuntimeError("rank 1 fails alone")
        comm.Barrier()  # rank 0 would wait here forever without the abort
    """))
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(script)],
                          env=mpiexec_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "rank 1 fails alone" in proc.stderr
    assert "aborting the job" in proc.stderr


def test_cli_info_json():
    proc = subprocess.run([sys.executable, "-m", "domainpar.cli", "info", "--json"],
                          env=mpiexec_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["world_size"] == 1
    assert "torch" in report


def test_cli_bench_halo_relaunches_under_mpiexec(tmp_path):
    """The benchmark runs end to end on tiny faces (no timing is asserted)."""
    out = tmp_path / "halo.json"
    proc = subprocess.run([sys.executable, "-m", "domainpar.cli", "bench", "halo", "-n", "2",
                           "--faces", "0.0625", "--repeats", "2", "--out", str(out)],
                          env=mpiexec_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["ranks"] == 2
    assert len(report["cases"]) == 5  # 2-D: 2 axes, 3-D: 3 axes
    for case in report["cases"]:
        assert case["face_bytes"] > 0
        assert set(case["median_s"]) >= {"sendrecv", "fill", "subarray"}
        assert "B" not in case  # no --compare: one configuration
    assert report["configurations"] == {"A": {}}
    if importlib.util.find_spec("matplotlib"):  # without it: JSON only, by design
        assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_comm_layer_never_imports_torch():
    """docs/design.md: comm/ is MPI and arrays only; torch must not come in with it."""
    code = ("import sys, domainpar.comm, domainpar.bench.halo, domainpar.testing; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    proc = subprocess.run([sys.executable, "-c", code], env=mpiexec_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# -- glibc's malloc thresholds (comm.runtime.malloc_thresholds) ----------------------------------
_MALLOC_PROBE = textwrap.dedent("""
    import ctypes, json
    import numpy as np
    import domainpar.comm
    from domainpar.comm import runtime

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = Info
    before = mallinfo2().hblkhd
    block = np.ones(64 << 20, dtype=np.uint8)  # past glibc's largest own threshold, 32 MiB
    mapped = mallinfo2().hblkhd - before
    print(json.dumps({"mapped": mapped, "report": runtime.malloc_thresholds(),
                      "info": runtime.capabilities()["malloc"]}))
""")


def _malloc_probe(**env):
    base = {k: v for k, v in mpiexec_env().items()
            if not k.startswith("MALLOC_") and k not in ("DOMAINPAR_MALLOC", "GLIBC_TUNABLES")}
    return subprocess.run([sys.executable, "-c", _MALLOC_PROBE], env=dict(base, **env),
                          capture_output=True, text=True, timeout=120)


def _glibc_with_mallinfo2() -> bool:
    import ctypes
    try:
        ctypes.CDLL(None).mallinfo2  # noqa: B018
    except (OSError, AttributeError):
        return False
    return True


needs_glibc = pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc 2.33+ "
                                 "(mallinfo2), the allocator whose thresholds domainpar fixes")


@needs_glibc
def test_malloc_thresholds_are_fixed_on_import():
    """A 64 MiB block, past any threshold of glibc's own, comes from the heap."""
    proc = _malloc_probe()
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["report"].startswith("fixed by domainpar"), out
    assert out["info"] == out["report"]
    assert out["mapped"] < 64 << 20, out


@needs_glibc
def test_malloc_thresholds_left_alone_when_asked_or_set():
    """DOMAINPAR_MALLOC=0, or thresholds of the user's own: glibc maps the block fresh."""
    for env, says in (({"DOMAINPAR_MALLOC": "0"}, "glibc's own thresholds"),
                      ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "thresholds as the environment "
                                                              "sets them (MALLOC_MMAP_THRESHOLD_)")):
        proc = _malloc_probe(**env)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["report"].startswith(says), (env, out)
        assert out["mapped"] >= 64 << 20, (env, out)


def test_malloc_setting_typo_raises_on_import():
    proc = _malloc_probe(DOMAINPAR_MALLOC="yes")
    assert proc.returncode != 0
    assert "DOMAINPAR_MALLOC='yes': use 1" in proc.stderr and "or 0" in proc.stderr
