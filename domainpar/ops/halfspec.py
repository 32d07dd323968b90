"""A block's real-to-complex transform along one dim (torch.fft.rfft), with a
backward that stays on the half spectrum.

torch's own backward of ``rfft`` (measured on torch 2.13.0, CPU) zero-fills the
whole two-sided complex spectrum and runs a complex-to-complex transform over
it: on the FNO2d's 1x8x512x512 block that is 7.9 ms, four times a 115 ms
training step, plus a 16 MiB fill each time. The adjoint of the one-sided DFT
needs only the half spectrum. For ``y = rfft(x, n)`` (``K = n // 2 + 1`` bins)
and the gradient ``g`` of ``y``, the gradient of ``x`` is

    Re sum_k g_k exp(2 pi i k t / n),  k = 0 .. K-1,

which is ``n * irfft(h, n)`` with ``h = g`` on bin 0 (and on bin n/2 for even
``n``) and ``g / 2`` on the bins between, whose mirror images ``irfft`` counts
twice; ``irfft`` takes the real parts of bins 0 and n/2, as the sum does. The
normalisation is the dual of the forward's: unscaled for ``norm="backward"``,
``1/sqrt(n)`` for ``"ortho"``, ``1/n`` for ``"forward"``. Padding (``n`` past the
block's length) is undone by cutting the gradient, trimming by zeros.

Local, as torch's rfft on the block (``ops.fft`` calls it for its real-to-complex
phase, which always holds one dim). The backward is differentiable, so second
derivatives work as through torch's own.

A slice of the bins (an FNO keeps the first ``m``) would zero-fill the whole
half spectrum in its backward, for ``RealToHalf``'s: ``HalfBins`` takes the bins
from the spectrum computed already and runs ``half_adjoint`` on them alone
(``irfft`` pads them to the half spectrum line by line). rfft of 1x8x512x512
and its first 8 bins, forward and backward, one process (machine B of
docs/benchmarks.md, ``docs/results/2026-11-26/halfbins-ab.txt``): 5.7-6.1 -> 4.9 ms.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

_DUAL = {None: "forward", "backward": "forward", "ortho": "ortho", "forward": "backward"}


class RealToHalf(torch.autograd.Function):
    """Local. ``torch.fft.rfft(x, n, dim, norm)``; backward by ``half_adjoint``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, dim: int, norm: str | None) -> torch.Tensor:
        ctx.options = (x.shape[dim], n, dim, norm)
        return torch.fft.rfft(x, n=n, dim=dim, norm=norm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return half_adjoint(grad, *ctx.options), None, None, None


class HalfBins(torch.autograd.Function):
    """Local. Bins ``lo .. hi`` along ``dim`` of ``spectrum``, the ``RealToHalf`` of
    ``x`` under ``options`` = ``(length, n, dim, norm)``, computed already and
    passed detached; backward: ``half_adjoint`` of those bins alone (module
    docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, spectrum: torch.Tensor, lo: int, hi: int,
                options: tuple) -> torch.Tensor:
        ctx.lo, ctx.options = lo, options
        return spectrum.narrow(options[2], lo, hi - lo).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dim = ctx.options[2]
        if ctx.lo:  # the bins below, zeros
            shape = list(grad.shape)
            shape[dim] = ctx.lo
            grad = torch.cat([grad.new_zeros(shape), grad], dim)
        return half_adjoint(grad, *ctx.options), None, None, None, None


def half_adjoint(grad: torch.Tensor, length: int, n: int, dim: int,
                 norm: str | None) -> torch.Tensor:
    """Local. The gradient of a real block of ``length`` along ``dim`` from the
    gradient ``grad`` of its ``rfft(n=n, norm=norm)`` (module docstring)."""
    scale = torch.ones(grad.shape[dim], dtype=grad.real.dtype, device=grad.device)
    scale[1:(n + 1) // 2] = 0.5  # the bins that have a mirror image
    out = torch.fft.irfft(grad * scale.view((-1,) + (1,) * (grad.ndim - 1 - dim)), n=n,
                          dim=dim, norm=_DUAL[norm])
    if length < n:
        return out.narrow(dim, 0, length)
    if length > n:
        pad = list(out.shape)
        pad[dim] = length - n
        return torch.cat([out, out.new_zeros(pad)], dim)
    return out


def rfftn(x: torch.Tensor, s: Sequence[int], dim: Sequence[int],
          norm: str | None = None) -> torch.Tensor:
    """Local. ``torch.fft.rfftn(x, s, dim, norm)``: along one dim by ``RealToHalf``,
    along several by torch's."""
    if len(dim) == 1 and not x.is_complex():
        return RealToHalf.apply(x, int(s[0]), int(dim[0]) % x.ndim, norm)
    return torch.fft.rfftn(x, s=s, dim=dim, norm=norm)
