"""The block's real-to-complex transform (``ops.halfspec``): torch's rfft forward,
and a backward on the half spectrum that gives torch's own gradient: every
length against ``n`` (padding, trimming, odd and even), every norm, every dim;
double backward; a slice of its bins (``HalfBins``) likewise; and the FFT rule
takes both for a DomainTensor's rfft and a slice of it."""

import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.ops.halfspec import HalfBins, RealToHalf, rfftn

SHAPES = [(3, 8, 5), (2, 7, 4), (4, 1, 6)]
NORMS = [None, "backward", "ortho", "forward"]


@pytest.mark.parametrize("shape,dim", [(s, d) for s in SHAPES for d in (0, 1, 2, -1)])
@pytest.mark.parametrize("norm", NORMS)
def test_gradient_is_torchs(shape, dim, norm):
    for n in sorted({1, 2, 5, 8, 9, shape[dim]}):
        x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        ours = rfftn(x, (n,), (dim,), norm)
        theirs = torch.fft.rfftn(x, s=(n,), dim=(dim,), norm=norm)
        assert torch.equal(ours, theirs)
        assert ours.grad_fn.name() == "RealToHalfBackward"
        g = torch.randn(theirs.shape, dtype=torch.complex128)  # imaginary DC and Nyquist too
        a, = torch.autograd.grad(ours, x, g)
        b, = torch.autograd.grad(theirs, x, g)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"n={n}")


def test_float32_is_as_close_to_float64_as_torchs():
    x = torch.randn(4, 64, 33, dtype=torch.float64)
    g = torch.randn(4, 64, 17, dtype=torch.complex128)
    exact, = torch.autograd.grad(rfftn(x.requires_grad_(), (33,), (2,)), x, g)
    x32 = x.detach().float().requires_grad_()
    ours, = torch.autograd.grad(rfftn(x32, (33,), (2,)), x32, g.to(torch.complex64))
    theirs, = torch.autograd.grad(torch.fft.rfft(x32, dim=2), x32, g.to(torch.complex64))
    err_ours, err_theirs = ((t.double() - exact).abs().max() for t in (ours, theirs))
    assert err_ours <= 4 * err_theirs + 1e-6, (err_ours, err_theirs)


@pytest.mark.parametrize("n,norm", [(6, "ortho"), (9, None), (4, "forward")])
def test_gradcheck_and_double_backward(n, norm):
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: RealToHalf.apply(t, n, 1, norm), (x,))
    assert torch.autograd.gradgradcheck(lambda t: RealToHalf.apply(t, n, 1, norm), (x,))


def test_several_dims_and_complex_input_go_to_torch():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert rfftn(x, (4, 6), (0, 1)).grad_fn.name() != "RealToHalfBackward"
    with pytest.raises(RuntimeError):  # torch's own refusal of complex input
        rfftn(x.to(torch.complex128), (6,), (1,))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("n,lo,hi", [(8, 0, 3), (9, 2, 5), (5, 0, 3), (12, 4, 7), (7, 0, 4),
                                     (6, 3, 4)])
def test_bins_take_torchs_gradient(n, lo, hi, norm):
    """Padding (n > 7), trimming, odd and even n, the Nyquist bin (n = 6, bin 3)."""
    x = torch.randn(3, 7, 2, dtype=torch.float64, requires_grad=True)
    spectrum = RealToHalf.apply(x, n, 1, norm)
    ours = HalfBins.apply(x, spectrum.detach(), lo, hi, (7, n, 1, norm))
    theirs = torch.fft.rfft(x, n=n, dim=1, norm=norm)[:, lo:hi]
    assert torch.equal(ours, theirs)
    g = torch.randn(theirs.shape, dtype=torch.complex128)
    a, = torch.autograd.grad(ours, x, g)
    b, = torch.autograd.grad(theirs, x, g)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n,lo,hi,norm", [(6, 0, 2, "ortho"), (9, 1, 4, None)])
def test_bins_gradcheck_and_double_backward(n, lo, hi, norm):
    def bins(t):
        return HalfBins.apply(t, torch.fft.rfft(t.detach(), n=n, dim=1, norm=norm), lo, hi,
                              (t.shape[1], n, 1, norm))
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(bins, (x,))
    assert torch.autograd.gradgradcheck(bins, (x,))


def graph_names(t: torch.Tensor) -> set:
    """The names of every node of ``t``'s graph."""
    names, stack, seen = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        stack.extend(f for f, _ in node.next_functions)
    return names


def test_the_fft_rule_takes_them():
    """rfft2 takes RealToHalf; a slice of the bins it kept takes HalfBins, so that
    RealToHalf's backward (on the whole half spectrum) is not in its graph."""
    grid = dp.ProcessGrid((1,), comm=MPI.COMM_SELF)
    dec = dp.Decomposition((2, 8, 6), grid, {1: 0})
    x = dp.DomainTensor(torch.randn(dec.local_shape(), requires_grad=True), dec)
    assert "RealToHalfBackward" in graph_names(torch.fft.rfft2(x).to_local())
    low = torch.fft.rfft2(x)[..., :3, 1:3]
    names = graph_names(low.to_local())
    assert "HalfBinsBackward" in names and "RealToHalfBackward" not in names, names
    torch.testing.assert_close(low.to_local(), torch.fft.rfft2(x.to_local())[..., :3, 1:3])
