"""Distributed FFTs (domainpar.ops.fft) against one process (the oracle): output and
input gradient of every torch.fft transform (fft, ifft, rfft, irfft, hfft, ihfft in
their 1-D, 2-D and n-D forms), over a seeded sample of dims, n / s (padding,
trimming, -1), norm modes, real and complex inputs, float64 and float32, x even,
uneven and zero-size blocks on 1- and 2-D grids (the transform dims sharded, a
batch x domain grid, or only other dims sharded). Also: the documented output
layouts and round trips, a dot-product adjoint test, and the refusals. fftshift /
ifftshift (rolls) along sharded and unsharded dims, by the same oracle."""
import random

import pytest
import torch

import domainpar as dp
from domainpar.testing import adjoint_test, assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import DTYPES, KINDS, SIZE, global_tensor, layout

pytestmark = pytest.mark.mpi

NAMES = ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
FORMS = ("", "2", "n")
NORMS = (None, "backward", "ortho", "forward")
COMPLEX = {torch.float64: torch.complex128, torch.float32: torch.complex64}


def spectrum(shape, dtype, seed=0, complex_=True):
    """A random input: complex of ``dtype``'s precision, or real."""
    x = global_tensor(shape, dtype, seed)
    return torch.complex(x, global_tensor(shape, dtype, seed + 1)) if complex_ else x


def real_view(fn):
    """``fn`` with a real output (the oracle's loss is sum(out * w) with a real w)."""
    def run(*xs):
        y = fn(*xs)
        return torch.view_as_real(y.resolve_conj()) if y.is_complex() else y
    return run


def draw(rng, i):
    """One transform call: every (name, form) in turn, the rest drawn. Shapes (2, 4,
    spatial...) with spatial sizes and lengths of at least 6, so that a dim that must
    take a grid axis always exists (up to 4 ranks)."""
    name, form = NAMES[i % 6], FORMS[(i // 6) % 3]
    nsp = 3 if rng.random() < 0.3 else 2
    shape = (2, 4) + tuple(rng.randint(6, 11 if nsp == 2 else 8) for _ in range(nsp))
    ndim = len(shape)
    if form == "":
        dims = (rng.choice((2, 3, -1)),)
    elif form == "2":
        dims = rng.choice(((-2, -1), (2, 3), (3, 2), (ndim - 1, 1)))
    else:
        dims = rng.choice((None, (2, 3, 4)[:nsp], (-1, 2), (1, 2, 3)))
    ndims = ndim if dims is None else len(dims)
    lengths = None
    if rng.random() < 0.6:
        lengths = tuple(rng.choice((-1, rng.randint(6, 12))) if form else rng.randint(6, 12)
                        for _ in range(ndims))
    options = {"norm": rng.choice(NORMS)}
    if form == "":
        options["dim"] = dims[0]
        if lengths:
            options["n"] = lengths[0]
    else:
        if dims is not None:
            options["dim"] = dims
        elif lengths:
            lengths = lengths[:rng.randint(1, ndims)]  # dim=None with s: the last len(s) dims
        if lengths:
            options["s"] = lengths
    if form == "2" and "dim" not in options and rng.random() < 0.5:
        options["dim"] = (-2, -1)
    transform_dims = sorted({d % ndim for d in (dims if dims is not None else range(ndim))})
    spatial = tuple(range(2, ndim))
    mode = rng.choice(("transform", "batch", "other"))
    if mode == "transform":  # the transform dims first (a 3-D field: two of them)
        shard = tuple(d for d in transform_dims if d >= 2) + spatial
    elif mode == "batch":  # batch x domain
        shard = (0,) + tuple(d for d in transform_dims if d >= 2) + spatial
    else:
        shard = tuple(d for d in spatial if d not in transform_dims) + spatial
    real_in = name in ("rfft", "ihfft") or rng.random() < 0.2
    return {"name": name + form, "shape": shape, "options": options,
            "shard": tuple(dict.fromkeys(shard)), "real": real_in,
            # each (name, form) recurs every 18 draws, on another grid, kind and dtype
            "grid_ndim": 1 + (i + i // 18) % 2, "kind": KINDS[(i // 2 + i // 18) % 3],
            "dtype": DTYPES[(i // 3 + i // 18) % 2]}


RNG = random.Random(5)
CASES = [draw(RNG, i) for i in range(54)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['name']}-{c['kind']}-{c['grid_ndim']}d")
def test_transform_matches_one_process(case):
    fn = getattr(torch.fft, case["name"])
    grid, shard, sizes = layout(case["shape"], case["shard"], case["grid_ndim"], case["kind"])
    x = spectrum(case["shape"], case["dtype"], complex_=not case["real"])
    assert_matches_single_process(real_view(lambda t: fn(t, **case["options"])), x, grid, shard,
                                  sizes=sizes)


def test_every_transform_is_sampled():
    assert {c["name"] for c in CASES} == {n + f for n in NAMES for f in FORMS}
    assert {str(c["options"].get("norm")) for c in CASES} == {str(n) for n in NORMS}


def _layout_of(y):
    dec = y.decomposition
    return {d: (a, dec.block_sizes(d)) for d, a in dec.shard.items()}


def _balanced(n, p):
    return tuple(n // p + (1 if c < n % p else 0) for c in range(p))


@pytest.mark.parametrize("kind", KINDS)
def test_rfft2_round_trip_restores_the_layout(kind):
    """x sharded on H: rfft2 comes out sharded on W's frequencies, irfft2(s=) comes back
    sharded on H (balanced) and equals x."""
    shape = (2, 4, 11, 9)
    grid, shard, sizes = layout(shape, (2,), 1, kind)
    x = shard_like(global_tensor(shape), grid, shard, sizes)
    y = torch.fft.rfft2(x, norm="ortho")
    p = grid.dims[0]
    assert tuple(y.shape) == (2, 4, 11, 5)
    # (on one rank, H sharded over an axis of one rank is whole, and stays put)
    assert _layout_of(y) == ({3: (0, _balanced(5, p))} if p > 1 else {2: (0, (11,))})
    z = torch.fft.irfft2(y, s=(11, 9), norm="ortho")
    assert _layout_of(z) == {2: (0, _balanced(11, p))}
    torch.testing.assert_close(z.full_tensor(), global_tensor(shape), rtol=1e-12, atol=1e-12)


def test_fftn_of_a_field_sharded_on_two_dims_round_trips():
    """A 3-D field sharded on X (grid axis 0) and Y (axis 1): fftn comes out sharded on
    Z (axis 0) and X (axis 1); ifftn brings back X and Y."""
    shape = (2, 8, 7, 6)
    grid, shard, sizes = layout(shape, (1, 2), 2, "uneven")
    x = shard_like(spectrum(shape, torch.float64), grid, shard, sizes)
    y = torch.fft.fftn(x, dim=(1, 2, 3))
    p0, p1 = grid.dims
    want = {1: (0, x.decomposition.block_sizes(1))} if p0 == 1 else {3: (0, _balanced(6, p0))}
    want.update({2: (1, x.decomposition.block_sizes(2))} if p1 == 1 else {1: (1, _balanced(8, p1))})
    assert _layout_of(y) == want
    torch.testing.assert_close(y.full_tensor(), torch.fft.fftn(spectrum(shape, torch.float64),
                                                               dim=(1, 2, 3)))
    z = torch.fft.ifftn(y, dim=(1, 2, 3))
    assert set(_layout_of(z)) == {1, 2} and z.decomposition.shard == {1: 0, 2: 1}
    torch.testing.assert_close(z.full_tensor(), spectrum(shape, torch.float64))


def test_a_sharded_last_dim_moves_onto_another_dim():
    """rfft2 with W sharded: W's axis goes to H (the other transform dim), then to
    W's frequencies, so the spectrum is sharded on a frequency dim (channel mixing
    stays local); irfft2 brings it to H. fft along W alone (no other transform
    dim) puts it on the largest other dim (H, 7), and ifft leaves it there."""
    shape = (2, 6, 7, 10)
    grid, shard, sizes = layout(shape, (3,), 1, "uneven")
    p = grid.dims[0]
    x = shard_like(global_tensor(shape), grid, shard, sizes)
    y = torch.fft.rfft2(x)
    assert _layout_of(y) == ({3: (0, _balanced(6, p))} if p > 1 else _layout_of(x) | {3: (0, (6,))})
    torch.testing.assert_close(y.full_tensor(), torch.fft.rfft2(global_tensor(shape)))
    z = torch.fft.irfft2(y, s=(7, 10))
    assert z.decomposition.shard == ({2: 0} if p > 1 else {3: 0})
    torch.testing.assert_close(z.full_tensor(), global_tensor(shape))
    f = torch.fft.fft(x, dim=3)
    assert f.decomposition.shard == ({2: 0} if p > 1 else {3: 0})
    g = torch.fft.ifft(f, dim=3)
    assert g.decomposition.shard == f.decomposition.shard
    torch.testing.assert_close(g.full_tensor().real, global_tensor(shape))


@pytest.mark.parametrize("dtype", (torch.complex128, torch.float64))
def test_adjoint(dtype):
    """<F x, y> == <x, F* y> with F* from backward (real part of the complex inner
    product): fft2 of a complex field, rfft2 of a real one, on a batch x domain grid."""
    shape = (4, 3, 9, 8)
    grid, shard, sizes = layout(shape, (0, 2), 2, "uneven")
    x = shard_like(spectrum(shape, torch.float64, complex_=dtype.is_complex), grid, shard, sizes)
    fn = torch.fft.fft2 if dtype.is_complex else torch.fft.rfft2
    adjoint_test(lambda t: fn(t, s=(10, 7), norm="ortho"), x)
    adjoint_test(lambda t: torch.fft.irfftn(t, dim=(1, 2, 3)), x)


def test_a_sharded_one_dimensional_signal_is_refused():
    x = shard_like(spectrum((12,), torch.float64), dp.ProcessGrid((SIZE,)), {0: 0})
    if SIZE == 1:
        torch.testing.assert_close(torch.fft.fft(x).full_tensor(),
                                   torch.fft.fft(spectrum((12,), torch.float64)))
    else:
        raises_on_every_rank(dp.UnsupportedOpError, ["torch.fft.fft", "dim 0", "grid axis 0",
                                                     "Add a batch or channel dim"],
                             lambda: torch.fft.fft(x))


def test_out_is_refused():
    grid, shard, _ = layout((4, 6), (0,), 1, "even")
    x = shard_like(spectrum((4, 6), torch.float64), grid, shard)
    raises_on_every_rank(dp.UnsupportedOpError, ["torch.fft.fft", "out="],
                         lambda: torch.fft.fft(x, out=torch.empty(4, 6, dtype=torch.complex128)))


# -- fftshift / ifftshift -------------------------------------------------------------------------
SHIFT_SHAPE = (2, 5, 9, 8)   # odd and even lengths: fftshift and ifftshift differ on odd ones
SHIFT_SHARD = (2, 3, 1)      # the first grid-ndim of these dims are cut


def shifts(t):
    """Every form at once: dim None (all), a sharded dim, an unsharded one, a tuple, a
    repeated dim, and round trips (which must give back their input)."""
    fs, ifs = torch.fft.fftshift, torch.fft.ifftshift
    parts = [fs(t), ifs(t), fs(t, dim=-1), ifs(t, 2), fs(t, dim=(1, 3)), ifs(t, dim=[3, 0]),
             fs(t, (2, 2)), ifs(fs(t, dim=(2, 3)), dim=(2, 3)) * t.sin(), fs(ifs(t)) - t]
    return torch.cat([p * (i + 1) for i, p in enumerate(parts)], dim=0)


SHIFT_CASES = [(g, k, d) for g in (1, 2, 3) for k in KINDS for d in DTYPES]


@pytest.mark.parametrize("grid_ndim,kind,dtype", SHIFT_CASES,
                         ids=[f"grid{g}-{k}-{str(d)[6:]}" for g, k, d in SHIFT_CASES])
def test_fftshift_matches_one_process(grid_ndim, kind, dtype):
    """Output and input gradient, even / uneven / zero-size blocks (uneven on a
    periodic grid), 1-, 2- and 3-D grids."""
    grid, shard, sizes = layout(SHIFT_SHAPE, SHIFT_SHARD, grid_ndim, kind,
                                periodic=kind == "uneven")
    assert_matches_single_process(shifts, global_tensor(SHIFT_SHAPE, dtype), grid, shard,
                                  sizes=sizes)


@pytest.mark.parametrize("kind", KINDS)
def test_fftshift_of_a_complex_spectrum(kind):
    """The FNO's use: rfft2, fftshift along H (sharded), ifftshift back, irfft2."""
    grid, shard, sizes = layout(SHIFT_SHAPE, SHIFT_SHARD, 1, kind)

    def spectral(t):
        y = torch.fft.fftshift(torch.fft.rfft2(t), dim=-2)
        return torch.fft.irfft2(torch.fft.ifftshift(y * 2, dim=-2), s=SHIFT_SHAPE[2:])
    assert_matches_single_process(spectral, global_tensor(SHIFT_SHAPE), grid, shard, sizes=sizes)
    x = shard_like(spectrum(SHIFT_SHAPE, torch.float64), grid, shard, sizes)
    assert_matches_single_process(real_view(lambda t: torch.fft.ifftshift(t, dim=(1, 2))),
                                  spectrum(SHIFT_SHAPE, torch.float32), grid, shard, sizes=sizes)
    assert torch.fft.fftshift(x).decomposition == x.decomposition
    adjoint_test(lambda t: torch.fft.fftshift(t, dim=(2, 3)), x)


def test_fftshift_of_a_zero_size_dim():
    shape = (2, 0, 9, 4)
    grid, shard, sizes = layout(shape, (2, 1), 2, "uneven")
    assert_matches_single_process(lambda t: torch.fft.fftshift(t) + torch.fft.ifftshift(t, 1),
                                  global_tensor(shape), grid, shard, sizes=sizes)


def test_fftshift_checks_dims_as_torch_does():
    grid, shard, _ = layout((4, 6), (0,), 1, "even")
    x = shard_like(global_tensor((4, 6)), grid, shard)
    with pytest.raises(IndexError):
        torch.fft.fftshift(x, dim=2)
