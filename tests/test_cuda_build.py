"""kernels/pack.cu built ahead of time, without a GPU: nvcc compiles it free of
warnings to PTX and to a fatbin for two architectures, the compiled module
holds exactly the kernels the Python side looks up
(domainpar.comm.packing.cuda_kernel_names), and CMake's DOMAINPAR_BUILD_CUDA=ON
builds the fatbin into domainpar/_native/, where packing reports and would
load it. The GPU suite (tests/gpu/) runs the kernels."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from domainpar.comm import packing

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "kernels" / "pack.cu"


@pytest.fixture(scope="module")
def nvcc():
    found = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
    if found is None:
        pytest.skip("needs nvcc (the CUDA toolkit) to compile kernels/pack.cu")
    return found


def _run(cmd, **kw):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300,
                          **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _fatbin_images(path: Path) -> list[set[str]]:
    """The kernels of each machine-code image (one ELF cubin per architecture)
    in the fatbin: a cubin has a section named .text.<kernel> for each kernel."""
    images = path.read_bytes().split(b"\x7fELF")[1:]
    return [{name for name in packing.cuda_kernel_names()
             if b".text." + name.encode() + b"\0" in image} for image in images]


def test_ptx_has_exactly_the_kernels_python_loads(nvcc, tmp_path):
    ptx = tmp_path / "pack.ptx"
    _run([nvcc, "-ptx", "--Werror", "all-warnings", "-o", ptx, SOURCE])
    entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx.read_text()))
    assert entries == packing.cuda_kernel_names()


def test_fatbin_for_two_architectures(nvcc, tmp_path):
    fatbin = tmp_path / "pack.fatbin"
    _run([nvcc, "--fatbin", "-gencode", "arch=compute_80,code=sm_80",
          "-gencode", "arch=compute_90,code=[sm_90,compute_90]", "-o", fatbin, SOURCE])
    images = _fatbin_images(fatbin)  # sm_80 and sm_90 machine code, every kernel in each
    assert images == [packing.cuda_kernel_names()] * 2, images


def test_cmake_option_builds_the_fatbin_packing_loads(nvcc, tmp_path, monkeypatch):
    """A copy of the project's CMake build (the native kernels only, so that the
    fatbin lands in the copy's domainpar/_native/ and not in this checkout's)."""
    if shutil.which("cmake") is None:
        pytest.skip("needs cmake")
    src = tmp_path / "src"
    for rel in ("CMakeLists.txt", "kernels/pack.c", "kernels/rowwise.c", "kernels/pack.cu"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, src / rel)
    build = tmp_path / "build"
    _run(["cmake", "-S", src, "-B", build, "-DDOMAINPAR_BUILD_CUDA=ON",
          "-DDOMAINPAR_CUDA_ARCH=sm_90", "-DDOMAINPAR_BUILD_COUPLING=OFF",
          f"-DDOMAINPAR_NVCC={nvcc}"])
    _run(["cmake", "--build", build, "-j2"])
    native = src / "domainpar" / "_native"
    fatbin = native / "pack.fatbin"
    assert (native / "libdomainpar_pack.so").exists()
    assert (native / "libdomainpar_rowwise.so").exists()
    assert _fatbin_images(fatbin) == [packing.cuda_kernel_names()]
    monkeypatch.setattr(packing, "_NATIVE_DIR", native)
    assert packing.cuda_kernels() == f"prebuilt: {fatbin}"
