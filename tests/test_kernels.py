"""The C pack kernels (kernels/pack.c) against numpy slicing. Their CUDA twin
(kernels/pack.cu): tests/test_cuda_build.py compiles it, tests/gpu/ runs it."""
import numpy as np
import pytest

from domainpar.comm import packing

DTYPES = [np.uint8, np.float16, np.float32, np.float64, np.complex64, np.complex128,
          np.int32, np.int64]
BOXES = [  # (array shape, box) pairs: faces along every axis, several widths, corners
    ((7, 9, 11), (slice(None), slice(None), slice(10, 11))),
    ((7, 9, 11), (slice(None), slice(None), slice(1, 4))),
    ((7, 9, 11), (slice(None), slice(3, 5), slice(None))),
    ((7, 9, 11), (slice(0, 2), slice(None), slice(None))),
    ((7, 9, 11), (slice(1, 3), slice(2, 4), slice(5, 11))),
    ((5, 6), (slice(None), slice(2, 3))),
    ((13,), (slice(4, 9),)),
    ((3, 4, 5, 6), (slice(1, 2), slice(0, 4), slice(2, 3), slice(1, 5))),
]


def needs_native():
    found, why = packing.native_library()
    if not found:
        pytest.fail(f"the C pack kernels were not built ({why}); `make kernels` builds them")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,box", BOXES)
def test_c_pack_unpack_match_numpy(dtype, shape, box):
    needs_native()
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(shape) * 50).astype(dtype)
    view = a[box]
    buf = np.empty(view.nbytes, np.uint8)
    packing.pack(view, buf)
    np.testing.assert_array_equal(buf.view(dtype).reshape(view.shape), view)
    b = np.zeros_like(a)
    packing.unpack(b[box], buf)
    expected = np.zeros_like(a)
    expected[box] = view
    np.testing.assert_array_equal(b, expected)
    c = a.copy()
    packing.unpack(c[box], buf, add=True)
    expected = a.copy()
    expected[box] += view
    np.testing.assert_array_equal(c, expected)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.float64, np.complex128])
def test_c_kernels_on_single_element_rows(dtype):
    """packing hands single-element rows to numpy, but the kernels are general:
    call them directly on such a face."""
    needs_native()
    a = (np.random.default_rng(1).standard_normal((6, 7, 9)) * 50).astype(dtype)
    view = a[:, 1:5, 8:9]
    shape, strides = packing._merged_layout(view)
    assert strides[-1] != view.itemsize  # really single-element rows
    buf = np.empty(view.nbytes, np.uint8)
    packing._LIB.dp_pack(*packing._c_args(view, shape, strides), view.itemsize,
                         buf.ctypes.data)
    np.testing.assert_array_equal(buf.view(dtype).reshape(view.shape), view)
    b = np.zeros_like(a)
    target = b[:, 1:5, 8:9]
    packing._LIB.dp_unpack(*packing._c_args(target, shape, strides), view.itemsize,
                           buf.ctypes.data)
    np.testing.assert_array_equal(target, view)


def test_c_kernels_used_only_when_enabled(monkeypatch):
    """The numpy fallback gives the same bytes (and is what runs without the build)."""
    a = np.arange(7 * 9 * 11, dtype=np.float32).reshape(7, 9, 11)
    view = a[:, :, 3:5]
    native, fallback = np.empty(view.nbytes, np.uint8), np.empty(view.nbytes, np.uint8)
    packing.pack(view, native)
    monkeypatch.setattr(packing, "use_native", False)
    packing.pack(view, fallback)
    np.testing.assert_array_equal(native, fallback)
