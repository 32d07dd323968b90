"""The C row loops (kernels/rowwise.c through ops/rowwise.py) against float64
references and torch's ops: moments under a large offset, the two sums of a
row pair, the affine map with and without its gradient term; rows of any
length (none, one, not a multiple of the loops' unrolling or blocks); the
group norm's per-group arithmetic against float64 torch formulas; where
they apply and where torch's ops run instead; DOMAINPAR_NATIVE=0 and a
missing library."""
import os
import subprocess
import sys

import pytest
import torch

from domainpar.bench import settings
from domainpar.comm import native
from domainpar.ops import rowwise

LENGTHS = [0, 1, 7, 8, 127, 129, 3 * 128 + 5, 40000]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """The loops apply where torch runs on one thread (the Makefile's setting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def needs_library():
    if rowwise._LIB is None:
        pytest.fail("the C row loops were not built (domainpar/_native/libdomainpar_rowwise.so "
                    "missing: `make kernels` builds it)")


def _rows(dtype, n, rows=3, offset=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (offset + torch.randn(rows, n, dtype=torch.float64, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("n", LENGTHS)
def test_moments_exact_under_a_large_offset(dtype, rtol, n):
    """mean and M2 of x = 1e4 + randn, against float64 sums of the same values:
    sum x^2 - n mean^2 would lose every digit of M2 in float32 at this offset."""
    needs_library()
    x = _rows(dtype, n, offset=1e4)
    mean, m2 = rowwise.moments(x, 3)
    xd = x.double()
    if n == 0:
        assert mean.tolist() == [0.0] * 3 and m2.tolist() == [0.0] * 3
        return
    true_mean = xd.mean(1)
    true_m2 = ((xd - true_mean[:, None]) ** 2).sum(1)
    torch.testing.assert_close(mean, true_mean, rtol=rtol, atol=0)
    torch.testing.assert_close(m2, true_m2, rtol=rtol, atol=rtol * n)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("n", LENGTHS)
def test_dots(dtype, rtol, n):
    needs_library()
    g, x = _rows(dtype, n, seed=1), _rows(dtype, n, offset=0.5, seed=2)
    sum_g, sum_gx = rowwise.dots(g, x, 3)
    scale = max(n, 1)
    torch.testing.assert_close(sum_g, g.double().sum(1), rtol=0, atol=rtol * scale)
    torch.testing.assert_close(sum_gx, (g.double() * x.double()).sum(1), rtol=0,
                               atol=rtol * scale)


def test_dots_long_row_of_one_sign():
    """2^21 float32 terms of one sign per row (g all ones, x a constant 0.1): a few
    roundings off (1.5e-7 here, as torch's cascaded sum); one float32 accumulator
    would be off by 1e-3 or more."""
    needs_library()
    g = torch.ones(2, 1 << 21)
    x = torch.full((2, 1 << 21), 0.1)
    sum_g, sum_gx = rowwise.dots(g, x, 2)
    exact = (g.double() * x.double()).sum(1)
    assert sum_g.tolist() == [float(1 << 21)] * 2
    assert ((sum_gx - exact).abs() / exact).max() < 1e-6


GROUP_CASES = [  # (samples, groups, per, cells per member; 0: a member without cells)
    (1, 2, 2, (30, 30)), (2, 3, 1, (17, 0, 40)), (3, 1, 4, (5,)), (2, 2, 3, (0, 0))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no affine"])
@pytest.mark.parametrize("samples,groups,per,cells", GROUP_CASES)
def test_group_norm_arithmetic(dtype, affine, samples, groups, per, cells):
    """The group norm's per-group math in C (``group_coefs``, ``group_grad_sums``,
    ``group_grad_coefs``) against its formulas in float64 torch on the members'
    rows of a group norm: members that hold no cells left out, offsets large
    against the spread, weight and bias or neither."""
    needs_library()
    gen = torch.Generator().manual_seed(11)
    ng, members = samples * groups, len(cells)
    counts = torch.tensor([float(c * per) for c in cells], dtype=torch.float64)
    live = counts > 0
    stats = torch.zeros(members, 2, ng, dtype=torch.float64)
    stats[:, 0] = 50 + torch.randn(members, ng, generator=gen, dtype=torch.float64)
    stats[:, 1] = counts[:, None] * torch.rand(members, ng, generator=gen, dtype=torch.float64)
    stats[~live] = 0
    w = torch.randn(groups * per, generator=gen, dtype=torch.float64).to(dtype) if affine else None
    b = torch.randn(groups * per, generator=gen, dtype=torch.float64).to(dtype) if affine else None
    eps = 1e-5
    mean, invstd, a, c = rowwise.group_coefs(stats, counts, groups, per, eps, w, b, dtype)

    # float64 torch: Chan's combination of the live members, each row's a and c
    n = counts.sum()
    if n > 0:
        m_i, q_i, n_i = stats[live, 0], stats[live, 1], counts[live][:, None]
        want_mean = (n_i * m_i).sum(0) / n
        want_m2 = (q_i + n_i * (m_i - want_mean) ** 2).sum(0)
    else:
        want_mean = want_m2 = torch.zeros(ng, dtype=torch.float64)
    want_invstd = torch.rsqrt(want_m2 / max(float(n), 1.0) + eps)
    torch.testing.assert_close(mean, want_mean, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(invstd, want_invstd, rtol=1e-12, atol=0)
    wd = torch.ones(groups * per, dtype=torch.float64) if w is None else w.double()
    bd = torch.zeros(groups * per, dtype=torch.float64) if b is None else b.double()
    by_row = want_invstd.reshape(samples, groups, 1)  # rows: (sample, group, channel)
    want_a = (by_row * wd.reshape(1, groups, per)).reshape(-1)
    want_c = (bd.reshape(1, groups, per) - want_mean.reshape(samples, groups, 1)
              * want_a.reshape(samples, groups, per)).reshape(-1)
    tol = {"rtol": 1e-6, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-11}
    torch.testing.assert_close(a.double(), want_a, **tol)
    torch.testing.assert_close(c.double(), want_c, **tol)

    rows = ng * per
    sg = torch.randn(rows, generator=gen, dtype=torch.float64)
    sgx = torch.randn(rows, generator=gen, dtype=torch.float64)
    ab = rowwise.group_grad_sums(sg, sgx, mean, groups, per, w, dtype)
    w_rows = wd.repeat(samples)
    mean_rows = mean.repeat_interleave(per)
    want_ab = torch.stack([(w_rows * sg).reshape(ng, per).sum(1),
                           (w_rows * (sgx - mean_rows * sg)).reshape(ng, per).sum(1)])
    torch.testing.assert_close(ab, want_ab, rtol=1e-13, atol=1e-12)
    a, c, bb, gw, gb = rowwise.group_grad_coefs(ab, mean, invstd, groups, per, w, int(n), sg,
                                                sgx, dtype)
    inv_n = 1 / max(float(n), 1.0)
    k1 = -(invstd ** 3) * ab[1] * inv_n
    k0 = -invstd * ab[0] * inv_n - k1 * mean
    torch.testing.assert_close(a.double(), k1.repeat_interleave(per), **tol)
    torch.testing.assert_close(c.double(), k0.repeat_interleave(per), **tol)
    torch.testing.assert_close(bb.double(), invstd.repeat_interleave(per) * w_rows, **tol)
    inv_rows = invstd.repeat_interleave(per)
    torch.testing.assert_close(gw, (inv_rows * (sgx - mean_rows * sg)).reshape(samples, -1).sum(0),
                               rtol=1e-13, atol=1e-12)
    torch.testing.assert_close(gb, sg.reshape(samples, -1).sum(0), rtol=1e-13, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", LENGTHS)
def test_affine_as_torch(dtype, n):
    """out = x * a + c and out = x * a + c + g * b, per row, as torch's ops compute
    them (to a rounding: a compiler may fuse a multiply-add); in place too."""
    needs_library()
    x, g = _rows(dtype, n, rows=4, seed=3), _rows(dtype, n, rows=4, seed=4)
    a, c, b = (_rows(dtype, 1, rows=4, seed=s).reshape(4, 1) for s in (5, 6, 7))
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-14, "atol": 1e-14}
    out = rowwise.affine(x, a, c, torch.empty_like(x))
    torch.testing.assert_close(out, x * a + c, **tol)
    out = rowwise.affine(x, a, c, torch.empty_like(x), g, b)
    torch.testing.assert_close(out, x * a + c + g * b, **tol)
    expected = x * a + c + g * b
    rowwise.affine(x, a, c, g, g, b)  # into g, which it reads
    torch.testing.assert_close(g, expected, **tol)


def test_usable_only_where_the_loops_apply(monkeypatch):
    needs_library()
    x = torch.zeros(4, 6)
    assert rowwise.usable(x, torch.zeros(4, 6, dtype=torch.float32))
    assert not rowwise.usable(x.t())                          # not contiguous
    assert not rowwise.usable(x.half())                       # no loop for the type
    assert not rowwise.usable(x, x.double())                  # mixed types
    monkeypatch.setattr(rowwise, "use_native", False)
    assert not rowwise.usable(x)
    monkeypatch.setattr(rowwise, "use_native", True)
    torch.set_num_threads(2)                                  # torch's ops run in parallel
    assert not rowwise.usable(x)


def test_native_zero_leaves_both_libraries_unloaded():
    """DOMAINPAR_NATIVE=0 at import: no library loads, torch's ops run, and
    `domainpar info`'s line says why for each library."""
    code = ("import torch; from domainpar.comm import native; from domainpar.ops import rowwise; "
            "print(rowwise._LIB is None, rowwise.usable(torch.zeros(2)), native.libraries())")
    env = {**os.environ, "DOMAINPAR_NATIVE": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.startswith("True False")
    assert out.count("not found: disabled by DOMAINPAR_NATIVE=0") == 2


def test_a_missing_library_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "NATIVE_DIR", tmp_path)
    lib, why = native.load.__wrapped__("libdomainpar_rowwise.so")  # uncached
    assert lib is None and "missing: run `make kernels`" in why


def test_compare_native_zero_switches_the_row_loops():
    """`--compare DOMAINPAR_NATIVE=0` turns the loops off around B's samples only."""
    needs_library()
    x = torch.zeros(4, 6)
    with settings.applied({"DOMAINPAR_NATIVE": "0"}):
        assert not rowwise.usable(x)
    assert rowwise.usable(x)
