"""Writing DomainTensors into preallocated buffers (issue 18, item 5): the idiom of
hand-written spectral layers (FNO's SpectralConv, AFNO),

    out = x_ft.new_zeros(B, C_out, H, W // 2 + 1, dtype=torch.cdouble)
    out[..., :m1, :m2] = einsum(x_ft[..., :m1, :m2], w)

``x.new_zeros``/``new_ones``/``new_full``/``new_empty`` with as many dims as ``x``
give a DomainTensor laid out like ``x`` (sharded dims of unchanged size keep their
blocks; a dim resized to 1 is whole; another resize is balanced anew on the same
axis), so the write stays sharded. A plain buffer (``torch.zeros``) is refused on
every rank, naming the one-line fix. Against one process in float64 (complex128
weights), output and gradients (input and weights) to 1e-10, on 1-D and 2-D grids
with even, uneven and zero-size blocks.
"""
import pytest
import torch
from torch import nn

import domainpar as dp
from domainpar.testing import assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import global_tensor, layout

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

SHAPE = (2, 3, 12, 10)  # B, C, H, W
KINDS = ("even", "uneven", "zero")


class SpectralConv2d(nn.Module):
    """FNO's spectral convolution as most hand-written layers write it: the low
    modes (both signs along H, the first m2 along the real-to-complex dim W) times
    complex weights, written into a zero buffer made from the spectrum."""

    def __init__(self, c_in, c_out, m1, m2, plain_buffer=False):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        scale = 1 / (c_in * c_out)
        self.m1, self.m2, self.c_out, self.plain_buffer = m1, m2, c_out, plain_buffer
        self.w1 = nn.Parameter(scale * torch.randn(c_in, c_out, m1, m2, dtype=torch.cdouble,
                                                   generator=g))
        self.w2 = nn.Parameter(scale * torch.randn(c_in, c_out, m1, m2, dtype=torch.cdouble,
                                                   generator=g))

    def forward(self, x):
        b, _, h, w = x.shape
        x_ft = torch.fft.rfft2(x)
        shape = (b, self.c_out, h, w // 2 + 1)
        if self.plain_buffer:
            out = torch.zeros(shape, dtype=torch.cdouble)
        else:
            out = x_ft.new_zeros(shape, dtype=torch.cdouble)
        m1, m2 = self.m1, self.m2
        out[:, :, :m1, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m1, :m2], self.w1)
        out[:, :, -m1:, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m1:, :m2], self.w2)
        return torch.fft.irfft2(out, s=(h, w))


class FNOBlock(nn.Module):
    """A spectral convolution plus a pointwise skip, as in an FNO layer."""

    def __init__(self):
        super().__init__()
        self.spectral = SpectralConv2d(3, 4, 3, 4)
        self.skip = nn.Conv2d(3, 4, 1, dtype=torch.float64)

    def forward(self, x):
        return torch.nn.functional.gelu(self.spectral(x) + self.skip(x))


# -- the spectral layer against one process -------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grid_ndim,shard_dims", [(1, (2,)), (1, (3,)), (2, (2, 3)),
                                                  (2, (3, 2))], ids=str)
def test_spectral_conv_with_new_zeros_matches_one_process(grid_ndim, shard_dims, kind):
    """Output, input gradient and the complex weights' gradients, float64 to 1e-10."""
    grid, shard, sizes = layout(SHAPE, shard_dims, grid_ndim, kind)
    torch.manual_seed(0)
    errors = assert_matches_single_process(FNOBlock(), global_tensor(SHAPE, seed=3), grid,
                                           shard, sizes=sizes, rtol=1e-10, atol=1e-12)
    assert max(errors.values()) < 1e-10, errors


def test_plain_buffer_is_refused_on_every_rank_with_the_fix():
    grid, shard, sizes = layout(SHAPE, (2,), 1, "uneven")
    x = shard_like(global_tensor(SHAPE, seed=3), grid, shard, sizes)
    layer = SpectralConv2d(3, 4, 3, 4, plain_buffer=True)
    message = raises_on_every_rank(
        dp.UnsupportedOpError,
        r"into a plain tensor is not supported: a plain tensor cannot become sharded in "
        r"place, and filling it whole would gather the whole tensor on every rank",
        lambda: layer(x))
    assert "out = x_ft.new_zeros(shape, dtype=...)" in message


def test_plain_target_indexed_by_a_domain_tensor_is_refused():
    grid, shard, sizes = layout((4, 6), (1,), 1, "even")
    mask = shard_like(global_tensor((4, 6), seed=1) > 0, grid, shard, sizes)
    plain = torch.zeros(4, 6)

    def write():
        plain[mask] = 1.0
    raises_on_every_rank(dp.UnsupportedOpError, "indexed by a DomainTensor", write)


# -- the layout of x.new_* -------------------------------------------------------------------------
def _uneven_x(grid_ndim=1, kind="uneven"):
    grid, shard, sizes = layout(SHAPE, (2, 3), grid_ndim, kind)
    return shard_like(global_tensor(SHAPE, seed=2), grid, shard, sizes)


@pytest.mark.parametrize("grid_ndim", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_new_zeros_of_the_same_shape_sizes_keeps_the_blocks(grid_ndim, kind):
    x = _uneven_x(grid_ndim, kind)
    made = [x.new_zeros(2, 5, 12, 10), x.new_zeros((2, 5, 12, 10), dtype=torch.cdouble),
            x.new_ones(size=(2, 5, 12, 10)), x.new_full((2, 5, 12, 10), 7.0),
            x.new_empty([2, 5, 12, 10])]
    for m, value in zip(made, (0, 0, 1, 7, None)):
        assert isinstance(m, dp.DomainTensor)
        assert tuple(m.shape) == (2, 5, 12, 10)
        dec = m.decomposition
        assert dec.shard == x.decomposition.shard
        assert all(dec.block_sizes(d) == x.decomposition.block_sizes(d) for d in dec.shard)
        if value is not None:
            assert torch.equal(m.full_tensor(), torch.full((2, 5, 12, 10), value, dtype=m.dtype))
    assert made[1].dtype == torch.cdouble and made[0].dtype == x.dtype


def test_new_zeros_requires_grad_gives_a_leaf_block():
    x = _uneven_x()
    m = x.new_zeros(SHAPE, requires_grad=True)
    assert isinstance(m, dp.DomainTensor) and m.requires_grad and m.is_leaf


@pytest.mark.parametrize("grid_ndim", [1, 2])
def test_new_zeros_of_a_resized_sharded_dim(grid_ndim):
    """A sharded dim resized to 1 is whole (a broadcast dim); another resize is
    balanced anew over the same grid axis; no dim left cut gives a plain tensor."""
    x = _uneven_x(grid_ndim)
    grid = x.decomposition.grid
    m = x.new_zeros(2, 3, 7, 10)
    assert isinstance(m, dp.DomainTensor) and m.decomposition.shard == x.decomposition.shard
    kept = {d: x.decomposition.block_sizes(d) for d in x.decomposition.shard if d != 2}
    assert m.decomposition == dp.Decomposition((2, 3, 7, 10), grid, x.decomposition.shard,
                                               kept)  # H balanced anew, W kept
    one = x.new_zeros(2, 3, 1, 10)
    if grid_ndim == 2:
        assert isinstance(one, dp.DomainTensor) and one.decomposition.shard == {3: 1}
        assert one.decomposition.block_sizes(3) == x.decomposition.block_sizes(3)
    else:
        assert type(one) is torch.Tensor and one.shape == (2, 3, 1, 10)
    assert type(x.new_ones(1, 3, 1, 1)) is torch.Tensor
    # x * buffer broadcasts without moving x's blocks
    y = x * x.new_full((1, 3, 1, 1), 2.0)
    assert y.decomposition == x.decomposition
    assert torch.equal(y.full_tensor(), 2 * x.full_tensor())


def test_new_factories_of_other_ranks_stay_plain():
    x = _uneven_x()
    for m in (x.new_zeros(3), x.new_ones((2, 2)), x.new_full((2, 3, 4, 5, 6), 1.0),
              x.new_tensor([1.0, 2.0]), x.new_empty(5)):
        assert type(m) is torch.Tensor and m.dtype == x.dtype


# -- setitem: a value laid out otherwise than the target's region ------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_write_of_a_value_laid_out_otherwise_is_repartitioned(kind):
    """out (from new_zeros, sharded on H) takes a slice of a tensor sharded on W
    (or on H with other blocks): the value is repartitioned onto the region;
    output and gradient match one process."""
    grid, shard, sizes = layout(SHAPE, (2,), 1, kind)
    grid_w, shard_w, sizes_w = layout(SHAPE, (3,), 1, "uneven" if kind == "even" else "even")
    g = global_tensor(SHAPE, seed=4)
    x = shard_like(g, grid, shard, sizes)
    v = shard_like(g * 3, grid_w, shard_w, sizes_w, requires_grad=True)
    ref_v = (g * 3).clone().requires_grad_()

    def write(base, value):
        out = base.new_zeros(SHAPE)
        out[:, 1:, 2:9, ::2] = value[:, :2, 3:10, 1::2] * 2
        out[0, :, -1] = value[1, :, 0]
        return out

    out, ref = write(x, v), write(g, ref_v)
    assert out.decomposition.shard == x.decomposition.shard
    wgt = global_tensor(SHAPE, seed=9)
    (out * wgt).sum().backward()
    (ref * wgt).sum().backward()
    assert torch.allclose(out.full_tensor(), ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(v.grad.full_tensor(), ref_v.grad, rtol=1e-12, atol=1e-12)

