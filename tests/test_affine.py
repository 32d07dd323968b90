"""The local pieces of the sharded group norm (ops/affine.py)."""
import torch

from domainpar.ops import affine


def test_row_dots_sum_without_accumulated_error():
    """A group's sum of g * x runs over every cell of the block: 2^21 float32
    terms per row here, g all ones (the gradient of ``y.sum()``) and x a constant
    0.1. torch's product with a cascaded sum keeps the error to a few roundings
    (1.5e-7); one long float32 accumulator does not (with torch 2.13, a BLAS dot
    per row 6e-4, the batched bmm 1.7e-2)."""
    g = torch.ones(1, 2, 1, 1 << 21)
    x = torch.full((1, 2, 1, 1 << 21), 0.1)
    got = affine._row_dots(g, x)
    exact = (g.double() * x.double()).sum(-1, keepdim=True)
    assert got.shape == (1, 2, 1, 1) and got.dtype == torch.float32
    assert ((got.double() - exact).abs() / exact).max() < 1e-6


def test_row_dots_any_rows():
    """Any leading shape; float64 to its own precision."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(3, 2, 5, 7, dtype=torch.float64, generator=gen)
    x = torch.randn(3, 2, 5, 7, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(affine._row_dots(g, x), (g * x).sum(-1, keepdim=True),
                               rtol=1e-12, atol=1e-12)
