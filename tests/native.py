"""The native targets (kernels/, examples/coupling/) brought up to date by CMake,
for the tests that run C and Fortran programs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"


def _run(*cmd) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"


def cmake_build(*targets: str) -> None:
    """Configure build/ if it is not yet (else re-run CMake, which picks up a target
    added since the configure), then build ``targets``."""
    if not (BUILD / "CMakeCache.txt").exists():
        _run("cmake", "-S", str(ROOT), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release",
             f"-DPython3_EXECUTABLE={sys.executable}", f"-DPython_EXECUTABLE={sys.executable}")
    else:
        _run("cmake", str(BUILD))
    _run("cmake", "--build", str(BUILD), "-j2", "--target", *targets)
