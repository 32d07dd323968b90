"""Bands of a spectrum by partial DFTs (ops/fftband.py) and transforms of
replicated bands, which come out sharded (ops/fft.py, "Replicated in, sharded
out"), against one process (the oracle): outputs, input and parameter
gradients, float64 and float32, even, uneven, zero-size and periodic layouts on
1-, 2- and 3-D grids, with transform lengths that pad and trim, every norm and
both directions. Also: that the band path is the one taken (one allreduce for
the two slices of an FNO, no transpose), that the inverse sends nothing
forward, and the band's pieces against torch."""
import pytest
import torch
import torch.nn.functional as F

import domainpar as dp
from domainpar.autograd import primitives
from domainpar.comm import collectives
from domainpar.ops import fftband
from domainpar.testing import assert_matches_single_process, models, raises_on_every_rank, shard_like
from tensor_cases import COMM, DTYPES, KINDS, SIZE, global_tensor, layout
from test_fft_slices import everywhere, real_view

pytestmark = pytest.mark.mpi

LAYOUTS = [(k, g) for k in KINDS + ("periodic",) for g in (1, 2, 3)]
SHAPE = (2, 3, 48, 9)  # H = 48: a band of 6 modes pays on up to 4 ranks (2 k P <= n)


def corners(x, m=3, norm=None):
    """The FNO's low modes: both ends of H, the start of W's half spectrum."""
    x_ft = torch.fft.rfft2(x, norm=norm)
    return torch.cat([x_ft[..., :m, :m], x_ft[..., -m:, :m]], dim=-2)


def spectral(x, m=3, norm=None):
    """An FNO layer's spectral path with fixed weights: the corners scaled, the
    spectrum rebuilt with zeros, transformed back to the field's shape."""
    h, w = x.shape[-2:]
    band = corners(x, m, norm)
    scale = torch.linspace(0.5, 1.5, band.numel() // band.shape[0], dtype=torch.float64)
    band = band * scale.reshape(band.shape[1:]).to(band.dtype)
    low, high = band[..., :m, :], band[..., m:, :]
    out_ft = torch.cat([F.pad(low, (0, 0, 0, h - 2 * m)), high], dim=-2)
    return torch.fft.irfft2(F.pad(out_ft, (0, w // 2 + 1 - m)), s=(h, w), norm=norm)


def complex_of(x):
    return x.to(torch.complex128 if x.dtype == torch.float64 else torch.complex64)


BANDS = {
    "fno corners": corners,
    "fno corners, ortho": lambda x: corners(x, 2, "ortho"),
    "one end, forward norm": lambda x: torch.fft.rfft2(x, norm="forward")[..., -3:, 1:3],
    "ihfft": lambda x: torch.fft.ihfft2(x)[..., 2:5, :3],
    "c2c, s pads H and trims W": lambda x: torch.fft.fftn(complex_of(x), s=(56, 7),
                                                          dim=(2, 3))[:, 1:, :3, 1:4],
    "ifft, s trims H": lambda x: torch.fft.ifftn(complex_of(x), s=(40, 9),
                                                 dim=(2, 3))[..., -2:, :3],
    "rfftn with C, C banded too": lambda x: torch.fft.rfftn(x, dim=(1, 2, 3))[:, :1, :2, :2],
    "spectral layer": spectral,
    "spectral layer, ortho": lambda x: spectral(x, 2, "ortho"),
}


@pytest.mark.parametrize("i", range(len(BANDS) * 2))
def test_bands_match_one_process(i):
    """H cut on grid axis 0; on 2- and 3-D grids N (then C) on the other axes, or
    the other axes replicate (``layout``'s shard dims (2, 0, 1) or (2,))."""
    name = list(BANDS)[i % len(BANDS)]
    kind, grid_ndim = LAYOUTS[i % len(LAYOUTS)]
    dtype = DTYPES[i // len(BANDS)]
    shard_dims = (2, 0, 1) if i % 2 else (2,)
    grid, shard, sizes = layout(SHAPE, shard_dims, grid_ndim, kind)
    assert_matches_single_process(real_view(BANDS[name]), global_tensor(SHAPE, dtype, seed=i),
                                  grid, shard, sizes=sizes)


@pytest.mark.parametrize("kind", KINDS)
def test_an_fno_trains_on_bands(kind):
    """FNO2d in DomainParallel: its weights enter replicated bands (no reduction)
    and the field's blocks (reduced): parameter gradients as one process's."""
    shape = (1, 1, 48, 16)
    grid, shard, sizes = layout(shape, (2,), 1, kind)
    torch.manual_seed(5)  # the same weights on every rank
    model = models.FNO2d(1, 1, width=4, modes=3, layers=2).double()
    assert_matches_single_process(model, global_tensor(shape, seed=3), grid, shard, sizes=sizes,
                                  wrap=lambda m: dp.DomainParallel(m, grid))


def counted(monkeypatch):
    """Calls of the band's partial DFT, of allreduces and of repartitions that send
    (forward and backward alike: counted where the Functions call them)."""
    calls = {"partial": 0, "allreduce": 0, "moved": 0}
    partial, allreduce = fftband.partial, primitives.allreduce_tensor
    repartition = collectives.repartition

    def count(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    def moving(block, src, dst, **kwargs):
        calls["moved"] += not collectives._stays_local(src, dst)
        return repartition(block, src, dst, **kwargs)
    monkeypatch.setattr(fftband, "partial", count("partial", partial))
    monkeypatch.setattr(primitives, "allreduce_tensor", count("allreduce", allreduce))
    monkeypatch.setattr(collectives, "repartition", moving)
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_an_fno_layer_sends_one_allreduce_forward(kind, monkeypatch):
    """Both corners from one allreduce; the inverse of the replicated band comes
    out cut on H as the input (balanced) with no message; backward moves the
    band's gradient once (the cut's adjoint)."""
    shape = (1, 2, 32, 20)
    grid, shard, sizes = layout(shape, (2,), 1, kind)
    x = shard_like(global_tensor(shape), grid, shard, sizes, requires_grad=True)
    calls = counted(monkeypatch)
    y = spectral(x, 2)
    bands = int(SIZE > 1)
    assert everywhere(calls == {"partial": bands, "allreduce": bands, "moved": 0}), calls
    assert y.decomposition.shard == {2: 0}
    assert y.decomposition.block_sizes(2) == dp.Decomposition(shape, grid, {2: 0}).block_sizes(2)
    y.to_local().backward(torch.ones_like(y.to_local()))
    assert everywhere(calls == {"partial": bands, "allreduce": bands, "moved": bands}), calls
    torch.testing.assert_close(y.full_tensor(), spectral(global_tensor(shape), 2))


def test_a_band_too_wide_takes_the_transposes(monkeypatch):
    """Where 2 k P > n along the cut dim, the plan's transpose answers."""
    shape = (1, 2, 4 * SIZE, 6)
    grid, shard, sizes = layout(shape, (2,), 1, "even")
    x = shard_like(global_tensor(shape), grid, shard, sizes)
    calls = counted(monkeypatch)
    low = corners(x, 2)
    assert everywhere(calls["partial"] == 0 and calls["moved"] == int(SIZE > 1)), calls
    torch.testing.assert_close(low.full_tensor(), corners(global_tensor(shape), 2))


def test_modes_and_positions():
    """The band holds a slice and its reflection; a slice of it answers when all
    its modes are there, in a run."""
    grid = dp.ProcessGrid((COMM.Get_size(),))
    dec = dp.Decomposition((1, 64, 9), grid, {1: 0})
    band = {1: (0, 1, 2, 61, 62, 63)}  # a band pays only where dim 1 is cut
    assert fftband.modes(dec, (1,), (64,), [(0, 1, 1), (0, 3, 1), (0, 9, 1)]) == \
        (band if SIZE > 1 else None)
    assert fftband.position(band[1], (60, 64, 1)) is None
    assert fftband.position(band[1], (62, 64, 1)) == slice(4, 6)
    assert fftband.holds(band, [(0, 1, 1), (62, 64, 1), (0, 9, 1)])
    assert fftband.modes(dec, (1,), (64,), [(0, 1, 1), (0, 64, 1), (0, 9, 1)]) is None  # whole
    assert fftband.modes(dec, (1,), (64,), [(0, 1, 1), (0, 8, 2), (0, 9, 1)]) is None  # a step
    whole = dp.Decomposition((1, 64, 9), grid, {})
    assert fftband.modes(whole, (1,), (64,), [(0, 1, 1), (0, 3, 1), (0, 9, 1)]) is None


@pytest.mark.parametrize("inverse,norm,n", [(False, None, 20), (True, None, 20),
                                            (False, "ortho", 24), (True, "forward", 16),
                                            (False, "forward", 16), (True, "ortho", 24)])
def test_partial_dfts_sum_to_torchs_transform(inverse, norm, n):
    """Local. Blocks of 20 entries (cut in three, one empty) with lengths that pad
    and trim: the partial DFTs sum to torch's fft / ifft at the band's modes."""
    x = torch.randn(3, 20, 2, dtype=torch.complex128, generator=torch.Generator().manual_seed(n))
    kept = (0, 1, 2, n - 2, n - 1)
    total = 0
    for lo, hi in ((0, 8), (8, 8), (8, 20)):
        dec = _FakeDec(lo)
        total = total + fftband.partial(x[:, lo:hi], dec, 1, kept, n, inverse, norm)
    ref = (torch.fft.ifft if inverse else torch.fft.fft)(x, n=n, dim=1, norm=norm)[:, list(kept)]
    torch.testing.assert_close(total, ref, rtol=1e-12, atol=1e-12)


class _FakeDec:
    """A block's offset along dim 1, all ``fftband.partial`` reads of a layout."""

    def __init__(self, start):
        self.start = start

    def offsets(self):
        return (0, self.start, 0)


def test_bands_off_take_the_transposes(monkeypatch):
    """``DOMAINPAR_FFT_BANDS=0`` (``set_bands``): the plan's transposes answer and a
    replicated input's transform stays replicated; the values do not change."""
    monkeypatch.setattr(fftband, "BANDS", True)
    shape = (1, 2, 32, 20)
    grid, shard, sizes = layout(shape, (2,), 1, "uneven")
    x = shard_like(global_tensor(shape), grid, shard, sizes)
    fftband.set_bands(False)
    calls = counted(monkeypatch)
    y = spectral(x, 2)
    # the corners' transpose and the inverse's (and, on some layouts, more)
    assert everywhere(calls["partial"] == 0 and (calls["moved"] >= 2) == (SIZE > 1)), calls
    assert y.decomposition.shard == {2: 0}  # by the inverse's transpose
    torch.testing.assert_close(y.full_tensor(), spectral(global_tensor(shape), 2))
    band = corners(shard_like(global_tensor(shape), grid, {}, None))  # replicated
    assert torch.fft.irfft2(F.pad(band, (0, 8)), s=(6, 20)).decomposition.shard == {}
    fftband.set_bands(True)
    back = torch.fft.irfft2(F.pad(band, (0, 8)), s=(6, 20))  # H (6) cut after its phase
    assert back.decomposition.shard == ({2: 0} if 1 < SIZE <= 6 else {})
    torch.testing.assert_close(back.full_tensor(), torch.fft.irfft2(
        F.pad(corners(global_tensor(shape)), (0, 8)), s=(6, 20)))


def test_ranks_agree_on_the_setting(monkeypatch):
    """A setting that differs between ranks is a MismatchError on every rank, at
    the first use of a grid, before any rank takes its own path."""
    grid = dp.ProcessGrid((SIZE,))
    monkeypatch.setattr(fftband, "BANDS", COMM.Get_rank() != 1)
    if SIZE > 1:
        raises_on_every_rank(dp.MismatchError, "DOMAINPAR_FFT_BANDS", lambda: fftband.enabled(grid))
    else:
        assert fftband.enabled(grid) is True
    monkeypatch.setattr(fftband, "BANDS", True)
    assert fftband.enabled(grid) is True  # agreed now, and not asked again
    assert fftband._AGREED[grid] is True
