"""Complex DomainTensors against one process (the oracle): data movement (scatter,
full_tensor, from_local, redistribute, halo exchange), pointwise ops and
layout-changing views, reductions, einsum (domainpar.ops.einsum) with complex
parameters, matmul over unsharded dims, and the FNO's spectral truncation
(rfft2 -> low modes -> einsum -> zeros back to the full spectrum -> irfft2):
outputs, input gradients and parameter gradients of real losses, complex64 and
complex128, even, uneven and zero-size blocks, 1- and 2-D grids."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import domainpar as dp
from domainpar.testing import assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import KINDS, global_tensor, layout, sizes_for

pytestmark = pytest.mark.mpi

CDTYPES = (torch.complex128, torch.complex64)
REAL = {torch.complex128: torch.float64, torch.complex64: torch.float32}


def cplx(shape, dtype=torch.complex128, seed=0):
    real = REAL[dtype]
    return torch.complex(global_tensor(shape, real, seed), global_tensor(shape, real, seed + 1))


def real_view(fn):
    """``fn`` with a real output: the oracle's loss is sum(out * w) with a real w."""
    def run(*xs):
        y = fn(*xs)
        return torch.view_as_real(y.resolve_conj()) if y.is_complex() else y
    return run


def layouts():
    """(kind, grid_ndim, dtype) covering every kind on 1- and 2-D grids, both dtypes."""
    return [(k, g, CDTYPES[(i + g) % 2]) for i, k in enumerate(KINDS) for g in (1, 2)]


# -- data movement -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", CDTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_scatter_gather_from_local_redistribute(kind, dtype):
    shape = (3, 7, 6)
    x = cplx(shape, dtype)
    grid, shard, sizes = layout(shape, (1, 2), 2, kind)
    a = shard_like(x, grid, shard, sizes)
    assert torch.equal(a.full_tensor(), x)
    s = dp.scatter(x, grid, shard)
    assert s.dtype == dtype and torch.equal(s.full_tensor(), x)
    b = dp.DomainTensor.from_local(a.to_local(), grid, shard)
    assert b.decomposition == a.decomposition and torch.equal(b.full_tensor(), x)
    c = a.redistribute({2: 0, 0: 1})
    assert torch.equal(c.full_tensor(), x)
    assert torch.equal(c.conj().full_tensor(), x.conj())  # a lazy conjugate travels too


@pytest.mark.parametrize("kind,grid_ndim,dtype", layouts()[1::2])
def test_halo_exchange(kind, grid_ndim, dtype):
    """Circular padding along sharded dims: a halo fill (and its accumulate in backward)."""
    shape = (2, 3, 9, 8)
    grid, shard, sizes = layout(shape, (2, 3), grid_ndim, kind, periodic=True)
    assert_matches_single_process(real_view(lambda t: F.pad(t, (1, 2, 2, 1), mode="circular")),
                                  cplx(shape, dtype), grid, shard, sizes=sizes)


# -- pointwise, views, reductions ----------------------------------------------------------------
POINTWISE = {  # each sums several ops, so that one oracle run checks them all
    "elementwise": lambda x: (x * x.conj() + 2 * x - x / (x.abs() + 1) + torch.exp(x) * torch.sgn(x)
                              + x.real.sin() * x + 1j * torch.angle(x)),
    "parts": lambda x: x.real * x.imag + torch.real(x) - torch.imag(x.conj()) + x.abs() ** 2,
    "views": lambda x: torch.view_as_real(torch.view_as_complex(torch.view_as_real(x) * 2) * x),
    "reductions": lambda x: (x.sum() * 1j + x.mean() + x.sum(dim=(0, 2)).sum()
                             + x.mean(dim=(2, 3), keepdim=True).sum()),
}


@pytest.mark.parametrize("name", POINTWISE)
@pytest.mark.parametrize("kind,grid_ndim,dtype", layouts()[::2])
def test_pointwise_and_reductions(name, kind, grid_ndim, dtype):
    shape = (2, 3, 7, 6)
    grid, shard, sizes = layout(shape, (2, 0), grid_ndim, kind)
    assert_matches_single_process(real_view(POINTWISE[name]), cplx(shape, dtype), grid, shard,
                                  sizes=sizes)


def test_view_as_complex_of_a_real_tensor_and_its_refusal():
    shape = (5, 6, 2)
    grid, shard, sizes = layout(shape, (0,), 1, "uneven")
    assert_matches_single_process(lambda t: torch.view_as_real(torch.view_as_complex(t) ** 2),
                                  global_tensor(shape), grid, shard, sizes=sizes)
    grid, shard, _ = layout(shape, (2,), 1, "even")
    x = shard_like(global_tensor(shape), grid, shard)
    if grid.size > 1:
        raises_on_every_rank(dp.UnsupportedOpError, ["view_as_complex", "last dim"],
                             lambda: torch.view_as_complex(x))


# -- einsum ---------------------------------------------------------------------------------------
class Mix(nn.Module):
    """torch.einsum(equation, x, w) with a complex parameter w (the FNO's channel mix)."""

    def __init__(self, equation, wshape, dtype):
        super().__init__()
        self.equation = equation
        self.w = nn.Parameter(cplx(wshape, dtype, seed=7))

    def forward(self, x):
        return torch.view_as_real(torch.einsum(self.equation, x, self.w))


EINSUM_PARAM = [  # (equation, x shape, w shape, x's sharded dims in grid-axis order)
    ("bixy,ioxy->boxy", (2, 3, 5, 6), (3, 4, 5, 6), (3, 0)),   # FNO, y sharded (batch x y)
    ("bixy,ioxy->boxy", (2, 3, 5, 6), (3, 4, 5, 6), (2, 3)),   # FNO, x (and y) sharded
    ("bixy,ioxy->bo", (2, 3, 5, 6), (3, 4, 5, 6), (2, 0)),     # contracted sharded label
    ("...xy,ioxy->...o", (2, 3, 5, 6), (3, 4, 5, 6), (3, 2)),  # ellipsis, all spatial summed
    ("bixy,io", (2, 3, 5, 6), (3, 4), (2, 3)),                 # implicit output
    ("bixy,xy->bixy", (2, 3, 5, 6), (5, 6), (2, 3)),           # a mask-like field
]


@pytest.mark.parametrize("i", range(2 * len(EINSUM_PARAM)))
def test_einsum_with_a_complex_parameter(i):
    """Each equation on two of the layouts, in turn (every layout three times)."""
    equation, xshape, wshape, sharded = EINSUM_PARAM[i % len(EINSUM_PARAM)]
    kind, grid_ndim, dtype = layouts()[i % len(layouts())]
    grid, shard, sizes = layout(xshape, sharded, grid_ndim, kind)
    assert_matches_single_process(Mix(equation, wshape, dtype), cplx(xshape, dtype), grid, shard,
                                  sizes=sizes)


EINSUM_PAIRS = [  # (equation, a shape, b shape, a's shard, b's shard) on a 2-D grid
    ("ij,jk->ik", (6, 5), (5, 4), {0: 0}, {}),                # b replicated DomainTensor
    ("ij,jk->ik", (6, 5), (5, 4), {1: 0}, {0: 0}),            # contracted, sizes may differ
    ("ij,jk->ik", (6, 5), (5, 4), {0: 0}, {1: 1}),            # outer blocks on two axes
    ("ij,jk->ijk", (6, 5), (5, 4), {1: 1, 0: 0}, {0: 1}),     # shared label kept
    ("ij,kj->", (6, 5), (4, 5), {1: 1}, {1: 1, 0: 0}),        # everything summed
    ("bij,bjk->bik", (4, 6, 5), (4, 5, 3), {0: 0, 1: 1}, {0: 0}),
]


@pytest.mark.parametrize("i", range(2 * len(EINSUM_PAIRS)))
def test_einsum_of_two_domain_tensors(i):
    """Each case on two of the kinds, in turn."""
    equation, ashape, bshape, ashard, bshard = EINSUM_PAIRS[i % len(EINSUM_PAIRS)]
    kind = KINDS[i % len(KINDS)]
    grid, _, _ = layout(ashape, (0, 1), 2, kind)
    # a's blocks uneven or empty, b's balanced: a shared label's blocks differ
    a_sizes = {d: sizes_for(ashape[d], grid.dims[axis], kind, seed=d)
               for d, axis in ashard.items()}
    a_sizes = {d: s for d, s in a_sizes.items() if s is not None}
    inputs = (cplx(ashape, seed=1), cplx(bshape, seed=3))
    assert_matches_single_process(real_view(lambda a, b: torch.einsum(equation, a, b)), inputs,
                                  grid, [ashard, bshard], sizes=[a_sizes or None, None])


def test_einsum_real_and_refusals():
    grid, shard, sizes = layout((4, 6, 5), (1, 2), 2, "uneven")
    w = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert_matches_single_process(lambda x: torch.einsum("bij,jk->bik", x, w),
                                  global_tensor((4, 6, 5)), grid, shard, sizes=sizes)
    if grid.size == 1:
        return
    g1 = dp.ProcessGrid((grid.size,))
    # 'i' of a and 'j' of b over one axis: b, whose label is contracted, is gathered
    assert_matches_single_process(real_view(lambda a, b: torch.einsum("ij,jk->ik", a, b)),
                                  (cplx((6, 6)), cplx((6, 4), seed=3)), g1, [{0: 0}, {0: 0}])
    a = shard_like(cplx((6, 6)), g1, {0: 0})
    raises_on_every_rank(dp.UnsupportedOpError, ["torch.einsum", "diagonal"],
                         lambda: torch.einsum("ii->i", a))


# -- matmul ----------------------------------------------------------------------------------------
class ComplexLinear(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.w = nn.Parameter(cplx((6, 4), dtype, seed=3))
        self.b = nn.Parameter(cplx((4,), dtype, seed=5))

    def forward(self, x):
        return torch.view_as_real(torch.matmul(x, self.w) + F.linear(x, self.w.T, self.b))


@pytest.mark.parametrize("kind,grid_ndim,dtype", layouts()[1::2])
def test_matmul_over_an_unsharded_dim(kind, grid_ndim, dtype):
    shape = (3, 7, 5, 6)
    grid, shard, sizes = layout(shape, (1, 0), grid_ndim, kind)
    assert_matches_single_process(ComplexLinear(dtype), cplx(shape, dtype), grid, shard,
                                  sizes=sizes)


# -- the FNO's spectral truncation ---------------------------------------------------------------
class SpectralConv(nn.Module):
    """The FNO's spectral layer: rfft2, keep m1 x m2 low modes at both ends of the
    first frequency dim, mix channels with complex weights, zeros back to the full
    spectrum, irfft2. ``how`` builds the full spectrum from the two corners:
    "zeros_like" (cat with a zero slice, then pad along the last frequency dim) or
    "pad" (pad the first corner along the local dim, then cat); or "separable"
    transforms one dim at a time and keeps only the low modes of the last before
    transforming the first (docs/models.md: the same layer, less data moved)."""

    def __init__(self, channels, m1, m2, how, dtype):
        super().__init__()
        self.m1, self.m2, self.how = m1, m2, how
        self.w1 = nn.Parameter(cplx((channels, channels, m1, m2), dtype, seed=11) / channels)
        self.w2 = nn.Parameter(cplx((channels, channels, m1, m2), dtype, seed=13) / channels)

    def forward(self, x):
        m1, m2 = self.m1, self.m2
        h, w = x.shape[-2:]
        if self.how == "separable":
            x_ft = torch.fft.fft(torch.fft.rfft(x)[..., :m2], dim=-2)
            top = torch.einsum("bixy,ioxy->boxy", x_ft[..., :m1, :], self.w1)
            bottom = torch.einsum("bixy,ioxy->boxy", x_ft[..., -m1:, :], self.w2)
            corners = torch.cat([F.pad(top, (0, 0, 0, h - 2 * m1)), bottom], dim=-2)
            return torch.fft.irfft(torch.fft.ifft(corners, dim=-2), n=w)
        x_ft = torch.fft.rfft2(x)
        top = torch.einsum("bixy,ioxy->boxy", x_ft[..., :m1, :m2], self.w1)
        bottom = torch.einsum("bixy,ioxy->boxy", x_ft[..., -m1:, :m2], self.w2)
        if self.how == "zeros_like":
            middle = torch.zeros_like(x_ft)[..., m1:h - m1, :m2]
            corners = torch.cat([top, middle, bottom], dim=-2)
        else:
            corners = torch.cat([F.pad(top, (0, 0, 0, h - 2 * m1)), bottom], dim=-2)
        out_ft = F.pad(corners, (0, x_ft.shape[-1] - m2))
        return torch.fft.irfft2(out_ft, s=(h, w))


FNO_LAYOUTS = [  # (x's sharded dims in grid-axis order, grid_ndim)
    ((2,), 1), ((3,), 1), ((0, 2), 2), ((2, 3), 2)]


@pytest.mark.parametrize("i", range(3 * len(FNO_LAYOUTS)))
def test_fno_spectral_truncation(i):
    """Every layout with every kind; the two ways to rebuild the spectrum alternate."""
    sharded, grid_ndim = FNO_LAYOUTS[i % len(FNO_LAYOUTS)]
    kind = KINDS[i // len(FNO_LAYOUTS)]
    how = ("zeros_like", "pad", "separable")[(i + i // len(FNO_LAYOUTS)) % 3]
    dtype = CDTYPES[(i // 2) % 2]
    shape = (2, 4, 12, 10)
    grid, shard, sizes = layout(shape, sharded, grid_ndim, kind)
    x = global_tensor(shape, REAL[dtype], seed=4)
    assert_matches_single_process(SpectralConv(4, 3, 4, how, dtype), x, grid, shard, sizes=sizes)


@pytest.mark.parametrize("dtype", CDTYPES)
def test_separable_low_modes_are_the_same_layer(dtype):
    """In one process, the separable form equals rfft2 -> corners -> irfft2: output
    and gradients, to the dtype's rounding."""
    x = global_tensor((2, 4, 12, 10), REAL[dtype], seed=4)
    outs, grads = [], []
    for how in ("pad", "separable"):
        layer = SpectralConv(4, 3, 4, how, dtype)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(global_tensor(y.shape, REAL[dtype], seed=9))
        outs.append(y.detach())
        grads.append([xi.grad, layer.w1.grad, layer.w2.grad])
    tol = 1e-12 if dtype == torch.complex128 else 1e-5
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
