"""Slices of a spectrum in transit and transforms of zero-padded spectra and zero
buffers (ops/fft.py,
"Slices of a spectrum"; tensor/deferred.py), against one process (the oracle):
outputs, input and parameter gradients, float64 and float32, even, uneven,
zero-size and periodic layouts on 1-, 2- and 3-D grids. Also: what travels (a
slice moves only the cells it keeps, an unpadded spectrum only its own cells),
that a transform whose result is used whole still answers, and that writes
which the copies could not follow are refused on every rank."""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import domainpar as dp
import domainpar.autograd as dag
from domainpar.tensor.deferred import Deferred
from domainpar.testing import assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import COMM, DTYPES, KINDS, SIZE, global_tensor, layout

pytestmark = pytest.mark.mpi

LAYOUTS = [(k, g) for k in KINDS + ("periodic",) for g in (1, 2, 3)]


def real_view(fn):
    """``fn`` with a real output (the oracle's loss is sum(out * w) with a real w)."""
    def run(*xs):
        y = fn(*xs)
        return torch.view_as_real(y.resolve_conj()) if y.is_complex() else y
    return run


def corners(x, m1=3, m2=3):
    """The FNO's low modes: both ends of the first frequency dim, the start of the last."""
    x_ft = torch.fft.rfft2(x)
    return torch.cat([x_ft[..., :m1, :m2], x_ft[..., -m1:, :m2]], dim=-2)


SLICINGS = {
    "fno corners": corners,
    "steps and channels": lambda x: torch.fft.rfft2(x)[:, 1:3, 1::2, 1:6:2],
    "ellipsis, one dim": lambda x: torch.fft.rfft2(x, norm="ortho")[..., 2:4],
    "3-D, s": lambda x: torch.fft.rfftn(x[:, :, None].expand(-1, -1, 3, -1, -1), s=(3, 10, 9),
                                        dim=(2, 3, 4))[..., :2, -2:, :3],
    "c2c": lambda x: torch.fft.fftn(x.to(torch.complex128 if x.dtype == torch.float64
                                         else torch.complex64), dim=(2, 3))[:, :, 1:, :2],
    "fftshift, centre band": lambda x: torch.fft.fftshift(torch.fft.rfft2(x), dim=-2)[..., 3:7, :4],
    "ifftshift twice, then whole": lambda x: torch.fft.ifftshift(torch.fft.ifftshift(
        torch.fft.rfftn(x, dim=(1, 2, 3)), dim=(1, 2)), dim=2)[:, 1:3, :, 1:3] * 1,
    "whole and sliced": lambda x: (lambda s: s.abs().mean() + s[..., :2, :2])(torch.fft.rfft2(x)),
    "sliced, then whole": lambda x: (lambda s: s[..., -2:, :3].sum() * s)(torch.fft.rfft2(x)),
}


@pytest.mark.parametrize("i", range(len(SLICINGS) * 2))
def test_slices_of_a_spectrum_match_one_process(i):
    name = list(SLICINGS)[i % len(SLICINGS)]
    kind, grid_ndim = LAYOUTS[i % len(LAYOUTS)]
    dtype = DTYPES[i // len(SLICINGS)]
    shape = (2, 4, 10, 9)
    grid, shard, sizes = layout(shape, (2, 3, 1), grid_ndim, kind)
    assert_matches_single_process(real_view(SLICINGS[name]), global_tensor(shape, dtype, seed=i),
                                  grid, shard, sizes=sizes)


def everywhere(ok) -> bool:
    """Collective. Whether ``ok`` holds on every rank (all ranks then assert alike)."""
    return bool(COMM.allreduce(int(bool(ok)), op=MPI.MIN))


def moved(monkeypatch):
    """The number of cells each later repartition carries into this rank (a list)."""
    cells = []
    real = dag.repartition

    def counting(block, src, dst):
        out = real(block, src, dst)
        if out is not block:
            cells.append(out.numel())
        return out
    monkeypatch.setattr(dag, "repartition", counting)
    return cells


@pytest.mark.parametrize("kind", KINDS)
def test_a_slice_moves_only_what_it_keeps(kind, monkeypatch):
    """rfft2 of a field cut on H: the W transform runs at once, H's transform waits
    for the slice, and the transpose before it carries only the kept columns."""
    shape = (1, 2, 16, 40)
    grid, shard, sizes = layout(shape, (2,), 1, kind)
    x = shard_like(global_tensor(shape), grid, shard, sizes)
    cells = moved(monkeypatch)
    x_ft = torch.fft.rfft2(x)
    assert everywhere(isinstance(x_ft, Deferred) and x_ft._block is None)
    low = torch.cat([x_ft[..., :3, :4], x_ft[..., -3:, :4]], dim=-2)
    assert everywhere(x_ft._block is None)  # the whole spectrum was never made
    kept = 2 * 16 * 4  # channels x H x the 4 kept columns, over all ranks
    # one transpose, shared by both slices
    assert everywhere(SIZE == 1 or (len(cells) == 1 and cells[0] <= kept)), cells
    torch.testing.assert_close(low.full_tensor(), corners(global_tensor(shape), 3, 4))
    whole = x_ft * 1  # the whole spectrum, on demand
    assert everywhere(x_ft._block is not None)
    assert everywhere(SIZE == 1 or (len(cells) == 2 and cells[1] >= cells[0])), cells
    torch.testing.assert_close(whole.full_tensor(), torch.fft.rfft2(global_tensor(shape)))


def test_attributes_of_a_spectrum_in_transit():
    """Metadata needs no block; autograd state does (and computes it on every rank)."""
    shape = (1, 2, 12, 10)
    grid, shard, sizes = layout(shape, (2,), 1, "uneven")
    x = shard_like(global_tensor(shape), grid, shard, sizes).requires_grad_()
    x_ft = torch.fft.rfft2(x)
    assert x_ft.shape == (1, 2, 12, 6) and x_ft.dtype == torch.complex128
    if x.decomposition.grid.comm.Get_rank() == 0:  # one rank alone: repr sends nothing
        assert "computed at its first use" in repr(x_ft)
    assert x_ft._block is None
    assert x_ft.requires_grad and x_ft._block is not None
    assert "local=\ntensor(" in repr(x_ft)
    assert torch.fft.rfft2(x).to_local().shape == x_ft.to_local().shape  # collective now


@pytest.mark.parametrize("kind", KINDS)
def test_writes_the_slices_cannot_follow_are_refused(kind):
    """A slice taken before the transposes is a copy where one process has a view:
    a write into it or into the spectrum is refused on every rank. A spectrum made
    whole before it is sliced is indexed as any tensor, writes included."""
    shape = (1, 2, 12, 10)
    grid, shard, sizes = layout(shape, (2,), 1, kind)
    x = shard_like(global_tensor(shape), grid, shard, sizes)
    x_ft = torch.fft.rfft2(x)
    low = x_ft[..., :3, :4]  # 4 columns: one for each of up to 4 ranks to take
    raises_on_every_rank(dp.UnsupportedOpError, "a slice of a spectrum", lambda: low.mul_(2))
    raises_on_every_rank(dp.UnsupportedOpError, "a slice of a spectrum", lambda: x_ft.zero_())
    y_ft = torch.fft.rfft2(x)
    y_ft.mul_(2)  # whole now, then written
    y_low = y_ft[..., :3, :3]
    y_low.zero_()  # a view, as in one process
    expected = 2 * torch.fft.rfft2(global_tensor(shape))
    expected[..., :3, :3] = 0
    torch.testing.assert_close(y_ft.full_tensor(), expected)


def zero_buffer(a, twice):
    """neuraloperator's inverse: the modes written into a zero buffer, shifted along
    H, transformed back (a second write makes the zeros unknown again)."""
    with dp.sharded_factories():
        out = torch.zeros(a.shape[:-1] + (48,), dtype=a.dtype)
        out[..., :6] = a
        if twice:
            out[..., 1:3, 30:33] = a[..., 1:3, :3]
        return torch.fft.irfft2(torch.fft.fftshift(out, dim=-2), s=(10, 94))


PADDED = {  # (2, 3, 10, 6) inputs; a pad to 8x the input or more is deferred
    "fno": lambda a: torch.fft.irfft2(F.pad(a, (0, 42)), s=(10, 94)),
    "two dims": lambda a: torch.fft.irfftn(F.pad(a, (0, 18, 0, 10)), s=(20, 46), dim=(2, 3)),
    "c2c, s shorter": lambda a: torch.fft.ifftn(F.pad(a, (0, 42)), s=(10, 7), dim=(2, 3)),
    "a batch dim padded too": lambda a: torch.fft.irfft2(F.pad(a, (0, 42, 0, 0, 0, 0, 0, 1)),
                                                          s=(10, 94)),
    "too small to defer": lambda a: torch.fft.irfft2(F.pad(a, (0, 6)), s=(10, 22)),
    "written after the pad": lambda a: (lambda b: (lambda p: (b.mul_(3), torch.fft.irfft2(
        p, s=(10, 94)))[1])(F.pad(b, (0, 42))))(a * 1),
    "padded written": lambda a: (lambda p: (p.add_(1), torch.fft.irfft2(p, s=(10, 94)))[1])(
        F.pad(a * 1, (0, 42))),
    "a zero buffer, written once, shifted": lambda a: zero_buffer(a, twice=False),
    "a zero buffer, written twice": lambda a: zero_buffer(a, twice=True),
    "padded used first": lambda a: (lambda p: p.abs().sum() + torch.fft.irfft2(p, s=(10, 94)))(
        F.pad(a, (0, 42))),
}


@pytest.mark.parametrize("i", range(len(PADDED) * 2))
def test_transforms_of_zero_padded_spectra_match_one_process(i):
    """A zero pad at the high end of transform dims is the transform's own padding:
    it transforms the unpadded tensor, unless either was written since the pad."""
    name = list(PADDED)[i % len(PADDED)]
    kind, grid_ndim = LAYOUTS[(3 * i) % len(LAYOUTS)]
    dtype = (torch.complex128, torch.complex64)[i // len(PADDED)]
    real = global_tensor((2, 3, 10, 6), DTYPES[i // len(PADDED)], seed=i)
    a = torch.complex(real, real.flip(-1))
    grid, shard, sizes = layout(a.shape, (2, 3, 0), grid_ndim, kind)
    assert_matches_single_process(real_view(PADDED[name]), a.to(dtype), grid, shard, sizes=sizes)


def test_an_unpadded_spectrum_moves_only_its_cells(monkeypatch):
    """irfft2 of a spectrum zero-padded along its sharded half dim: the pad is never
    made, and the transpose carries the 4 columns the pad widened, not the 40."""
    shape = (1, 2, 16, 4)
    grid, shard, sizes = layout(shape, (3,), 1, "even")
    a = shard_like(torch.complex(global_tensor(shape), global_tensor(shape, seed=1)), grid, shard,
                   sizes)
    padded = F.pad(a, (0, 36))
    cells = moved(monkeypatch)
    out = torch.fft.irfft2(padded, s=(16, 78))
    assert everywhere(isinstance(padded, Deferred) and padded._block is None)
    assert everywhere(SIZE == 1 or (len(cells) == 1 and cells[0] <= 2 * 16 * 4)), cells
    torch.testing.assert_close(out.full_tensor(), torch.fft.irfft2(padded.full_tensor(),
                                                                   s=(16, 78)))


@pytest.mark.parametrize("kind", KINDS)
def test_grad_mode_is_the_transforms_own(kind):
    """What a spectrum in transit computes later records the graph that its transform's
    call records in one process, whatever the grad mode at the later use."""
    shape = (1, 2, 12, 10)
    grid, shard, sizes = layout(shape, (2,), 1, kind)
    g = global_tensor(shape).requires_grad_()
    x = shard_like(g.detach(), grid, shard, sizes).requires_grad_()
    x_ft, y_ft, g_ft = torch.fft.rfft2(x), torch.fft.rfft2(x), torch.fft.rfft2(g)
    with torch.no_grad():
        inside = x_ft[..., :3, :4]   # taken here, cached: later slices need the graph
        y_ft * 1                     # the whole block, computed here
        z_ft, gz_ft = torch.fft.rfft2(x), torch.fft.rfft2(g)
        g_inside = g_ft[..., :3, :4]
    assert everywhere(inside.requires_grad == g_inside.requires_grad)  # a view: True
    assert everywhere(not z_ft[..., :3, :4].requires_grad and not gz_ft.requires_grad)
    loss = x_ft[..., :3, :4].abs().sum() + y_ft.abs().sum()
    loss.backward()
    (g_ft[..., :3, :4].abs().sum() + g_ft.abs().sum()).backward()
    torch.testing.assert_close(x.grad.full_tensor(), g.grad)


@pytest.mark.parametrize("kind", KINDS)
def test_a_shifted_spectrum_moves_only_what_it_keeps(kind, monkeypatch):
    """neuraloperator's order: rfft2, fftshift along H, then the centre band of H and
    the first columns of W. The shift waits with the transform; the transpose carries
    the kept columns only, and the shift rolls what they hold."""
    shape = (1, 2, 16, 40)
    grid, shard, sizes = layout(shape, (2,), 1, kind)
    x = shard_like(global_tensor(shape), grid, shard, sizes)
    cells = moved(monkeypatch)
    x_ft = torch.fft.fftshift(torch.fft.rfft2(x), dim=-2)
    band = x_ft[..., 6:10, :4]
    assert everywhere(isinstance(x_ft, Deferred) and x_ft._block is None)
    assert everywhere(SIZE == 1 or (len(cells) == 1 and cells[0] <= 2 * 16 * 4)), cells
    want = torch.fft.fftshift(torch.fft.rfft2(global_tensor(shape)), dim=-2)[..., 6:10, :4]
    torch.testing.assert_close(band.full_tensor(), want)


def test_a_zero_buffer_moves_only_what_was_written(monkeypatch):
    """irfft2 of a factory's zero buffer written in its first 4 columns (and shifted
    along H) carries those 4 columns, not the 40."""
    shape = (1, 2, 16, 4)
    grid, shard, sizes = layout(shape, (3,), 1, "even")
    a = shard_like(torch.complex(global_tensor(shape), global_tensor(shape, seed=1)), grid, shard,
                   sizes)
    with dp.sharded_factories():
        buf = torch.zeros(1, 2, 16, 40, dtype=a.dtype)
        buf[..., :4] = a  # (moves a onto the buffer's blocks)
        cells = moved(monkeypatch)
        out = torch.fft.irfft2(torch.fft.fftshift(buf, dim=-2), s=(16, 78))
    assert everywhere(SIZE == 1 or (len(cells) == 1 and cells[0] <= 2 * 16 * 4)), cells
    want = torch.zeros(1, 2, 16, 40, dtype=a.dtype)
    want[..., :4] = a.full_tensor()
    torch.testing.assert_close(out.full_tensor(),
                               torch.fft.irfft2(torch.fft.fftshift(want, dim=-2), s=(16, 78)))
