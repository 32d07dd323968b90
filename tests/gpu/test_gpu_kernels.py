"""The CUDA pack kernels (kernels/pack.cu) on a GPU against numpy slicing, for
every dtype and the boxes of the C kernels' tests: compiled at run time by
NVRTC (the default) and loaded from a fatbin built ahead by nvcc (what CMake's
DOMAINPAR_BUILD_CUDA=ON installs)."""
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gpu_env import GPU_MISSING

from domainpar.comm import packing
from test_kernels import BOXES, DTYPES

if GPU_MISSING:  # one skip for the module, none of its cases built
    pytest.skip(GPU_MISSING, allow_module_level=True)
ROOT = Path(__file__).resolve().parents[2]


def _data(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape) * 50
    if np.dtype(dtype).kind == "c":
        a = a + 1j * rng.standard_normal(shape) * 50
    return a.astype(dtype)


def _check_box(cupy, host, box):
    """pack, unpack and unpack-add of ``host[box]`` on the device equal numpy's;
    returns whether the CUDA kernels (not CuPy's copy) ran for pack and unpack."""
    a = cupy.asarray(host)
    view, want = a[box], host[box]
    buf = cupy.full(view.nbytes, 0xAB, cupy.uint8)  # poisoned: every byte must be written
    ran = packing._cuda_copy(view, buf, "pack") if view.size else False
    packing.pack(view, buf)
    np.testing.assert_array_equal(cupy.asnumpy(buf).view(want.dtype).reshape(want.shape), want)
    b = cupy.zeros_like(a)
    packing.unpack(b[box], buf)
    expected = np.zeros_like(host)
    expected[box] = want
    np.testing.assert_array_equal(cupy.asnumpy(b), expected)
    c = a.copy()
    packing.unpack(c[box], buf, add=True)
    expected = host.copy()
    expected[box] += want
    np.testing.assert_array_equal(cupy.asnumpy(c), expected)
    return ran


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,box", BOXES)
def test_cuda_kernels_match_numpy(dtype, shape, box):
    import cupy
    ran = _check_box(cupy, _data(shape, dtype, 0), box)
    assert packing._cuda_module() is not None, packing._cuda_state.get("why")
    assert ran, "the CUDA pack kernel did not run for this box"


@pytest.mark.parametrize("dtype", [np.float32, np.complex128, np.int64])
def test_reversed_transposed_and_empty_views(dtype):
    import cupy
    host = _data((6, 7, 9), dtype, 1)
    for box in [(slice(None, None, -1), slice(1, 5), slice(2, 3)),
                (slice(4, 0, -2), slice(None), slice(None, None, -3)),
                (slice(2, 2), slice(None), slice(None))]:
        _check_box(cupy, host, box)
    # a transposed array: its boxes have large inner strides
    t = np.ascontiguousarray(host.transpose(2, 0, 1)).transpose(1, 2, 0)
    _check_box(cupy, t, (slice(1, 4), slice(None), slice(0, 2)))


def test_kernels_come_from_nvrtc_by_default():
    import cupy
    _check_box(cupy, _data((5, 6), np.float64, 2), (slice(None), slice(2, 3)))
    why = packing._cuda_state["why"]
    assert why.startswith(("compiled", "loaded")), why


def test_a_prebuilt_fatbin_is_loaded_and_agrees(tmp_path, monkeypatch):
    """nvcc builds the fatbin for this GPU (as CMake's DOMAINPAR_BUILD_CUDA=ON
    does for a list of architectures); packing loads it instead of NVRTC."""
    import cupy
    nvcc = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
    if nvcc is None:
        pytest.skip("needs nvcc (the CUDA toolkit) to build the fatbin")
    arch = f"sm_{cupy.cuda.Device().compute_capability}"  # e.g. "90" on an H100
    proc = subprocess.run([nvcc, "--fatbin", f"-arch={arch}", "-o", str(tmp_path / "pack.fatbin"),
                           str(ROOT / "kernels" / "pack.cu")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    monkeypatch.setattr(packing, "_NATIVE_DIR", tmp_path)
    monkeypatch.setattr(packing, "_cuda_state", {})
    assert packing.cuda_kernels().startswith("prebuilt")
    for dtype in (np.float64, np.complex64, np.uint8):
        assert _check_box(cupy, _data((7, 9, 11), dtype, 3), BOXES[4][1])
    assert packing._cuda_state["why"].startswith("loaded"), packing._cuda_state["why"]
