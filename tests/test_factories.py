"""Sharded factories (issue 18, item 5): inside ``dp.sharded_factories()`` (and
every ``DomainParallel`` forward) a buffer made by ``torch.zeros`` and the like
takes a layout when a DomainTensor is written into it, and is the plain tensor
otherwise.

Against one process in float64 (1e-10): output and gradients of writes with
global indices (slices that cross block boundaries, negative starts, steps,
ints, None, Ellipsis, regions that only some ranks hold, several writes), of
FNO-style spectral layers (2-D and 3-D, both signs of the frequencies), on 1-,
2- and 3-D grids with even, uneven and zero-size blocks. Refusals, raised on
every rank alike, where no layout follows from the write.
"""
import pytest
import torch
from torch import nn

import domainpar as dp
from domainpar.testing import assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import KINDS, global_tensor, layout
from test_tensor_faults import Twice  # a custom autograd.Function

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

SHAPE = (2, 3, 12, 10)        # B, C, H, W
SHAPE3 = (2, 3, 8, 6, 6)      # B, C, X, Y, Z
GRIDS = [(SHAPE, 1, (2,)), (SHAPE, 1, (3,)), (SHAPE, 2, (2, 3)), (SHAPE3, 3, (2, 3, 4))]
GRID_IDS = ["4d-grid1-H", "4d-grid1-W", "4d-grid2", "5d-grid3"]


def _in_factories(fn):
    """The sharded run of ``fn`` inside ``dp.sharded_factories()``."""
    def run(*args):
        with dp.sharded_factories():
            return fn(*args)
    return run


# -- writes with global indices ------------------------------------------------------------------
def _low_modes(v):
    out = torch.zeros(v.shape, dtype=v.dtype)
    out[:, :, :5, :4] = v[:, :, :5, :4] * 2
    return out


def _negative_with_ellipsis(v):
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    out[..., -5:, :4] = v[..., -5:, :4]
    out[..., :3, -2:] = v[..., 1:4, :2] * 3  # a second write, the value shifted
    return out


def _shifted_and_strided(v):
    out = torch.full(v.shape, 0.0, dtype=v.dtype)
    out[:, 1:, 3:11, 2:9] = v[:, :2, 1:9, :7]
    out[:, :1, 1::2, ::3] = v[:, 2:, ::2, :4] - 1
    return out


def _ints_and_none(v):
    out = torch.ones(v.shape[1:], dtype=v.dtype)
    out[:, 4:8] = v[1, :, 2:6]            # an int drops the value's batch dim
    out[None, 0, 1:3] = v[:1, 2, 3:5]      # None adds a unit dim to the region
    return out


def _owned_by_some(v):
    """Regions at the far end of the sharded dims: the first ranks write nothing."""
    out = torch.full(v.shape, 2.5, dtype=v.dtype)
    out[:, :, 10:, 8:] = v[:, :, 10:, 8:]
    out[:, :, :1] = v[:, :, -1:]
    return out


def _low_modes_3d(v):
    out = torch.zeros(v.shape, dtype=v.dtype)
    out[..., :3, -3:, :2] = v[..., -3:, 1:4, :2]
    out[:, :, -2:, :, 4:] = v[:, :, :2, :, 3:5] * 2
    return out


WRITES_4D = [_low_modes, _negative_with_ellipsis, _shifted_and_strided, _ints_and_none,
             _owned_by_some]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,grid_ndim,dims", GRIDS, ids=GRID_IDS)
def test_writes_into_factory_buffers_match_one_process(shape, grid_ndim, dims, kind):
    grid, shard, sizes = layout(shape, dims, grid_ndim, kind)
    writes = WRITES_4D if len(shape) == 4 else [_low_modes_3d]
    for write in writes:
        errors = assert_matches_single_process(write, global_tensor(shape, seed=3), grid, shard,
                                               sizes=sizes, rtol=1e-10, atol=1e-12,
                                               wrap=_in_factories)
        assert max(errors.values()) < 1e-10, (write.__name__, errors)


@pytest.mark.parametrize("kind", KINDS)
def test_buffer_is_laid_out_like_the_tensor_it_was_sliced_from(kind):
    """The buffer's sharded dims are those the value cuts; their blocks are those
    of the last DomainTensor the calls used with that size over that axis (so the
    write sends nothing), else balanced; each rank holds only its block."""
    grid, shard, sizes = layout(SHAPE, (2, 3), 2, kind)
    x = shard_like(global_tensor(SHAPE, seed=1), grid, shard, sizes)
    with dp.sharded_factories():
        out = torch.zeros(2, 4, 12, 7, dtype=torch.float64)
        out[:, :3, 2:9, :5] = x[:, :, 2:9, :5]
    assert type(out) is dp.DomainTensor and out.decomposition.shard == x.decomposition.shard
    assert out.decomposition.block_sizes(2) == x.decomposition.block_sizes(2)
    assert out.decomposition.block_sizes(3) == dp.Decomposition(
        (2, 4, 12, 7), x.decomposition.grid, {3: shard[3]}).block_sizes(3)  # no 7-long dim seen
    assert tuple(out.to_local().shape) == out.decomposition.local_shape()
    want = torch.zeros(2, 4, 12, 7, dtype=torch.float64)
    want[:, :3, 2:9, :5] = global_tensor(SHAPE, seed=1)[:, :, 2:9, :5]
    assert torch.equal(out.full_tensor(), want)


# -- spectral layers, as neuraloperator and hand-written FNOs write them -------------------------
class Spectral(nn.Module):
    """A spectral convolution writing both signs of the low frequencies (along
    every transformed dim but the last, the real-to-complex one) into a
    ``torch.zeros`` buffer, then the inverse transform; plus a pointwise skip."""

    def __init__(self, ndim: int, c_in=3, c_out=4, modes=3):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.ndim, self.modes, self.c_out = ndim, modes, c_out
        shape = (c_in, c_out) + (modes,) * ndim
        self.w = nn.ParameterList([
            nn.Parameter(torch.randn(shape, dtype=torch.cdouble, generator=g) / (c_in * c_out))
            for _ in range(2 ** (ndim - 1))])
        self.skip = nn.Parameter(torch.randn(c_in, c_out, dtype=torch.float64, generator=g))
        self.letters = "xyz"[:ndim]

    def forward(self, x):
        dims = tuple(range(2, 2 + self.ndim))
        x_ft = torch.fft.rfftn(x, dim=dims)
        out = torch.zeros(x.shape[0], self.c_out, *x_ft.shape[2:], dtype=torch.cdouble)
        m, eq = self.modes, f"bi{self.letters},io{self.letters}->bo{self.letters}"
        for k, w in enumerate(self.w):  # every sign pattern of the leading dims
            region = tuple(slice(-m, None) if k >> j & 1 else slice(None, m)
                           for j in range(self.ndim - 1)) + (slice(None, m),)
            out[(slice(None), slice(None)) + region] = torch.einsum(
                eq, x_ft[(slice(None), slice(None)) + region], w)
        y = torch.fft.irfftn(out, s=x.shape[2:], dim=dims)
        skip = torch.einsum(f"bi{self.letters},io->bo{self.letters}", x, self.skip)
        return torch.nn.functional.gelu(y + skip)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,grid_ndim,dims", GRIDS, ids=GRID_IDS)
def test_spectral_layer_in_domain_parallel_matches_one_process(shape, grid_ndim, dims, kind):
    """Output, input gradient and the complex weights' gradients, float64 to 1e-10."""
    grid, shard, sizes = layout(shape, dims, grid_ndim, kind)
    errors = assert_matches_single_process(
        Spectral(len(shape) - 2), global_tensor(shape, seed=3), grid, shard, sizes=sizes,
        rtol=1e-10, atol=1e-12, wrap=lambda m: dp.DomainParallel(m, grid))
    assert max(errors.values()) < 1e-10, errors


# -- plain uses: the plain tensor one process has ------------------------------------------------
def test_plain_uses_give_plain_tensors():
    grid, shard, sizes = layout(SHAPE, (2,), 1, "uneven")
    x = shard_like(global_tensor(SHAPE, seed=1), grid, shard, sizes)
    w = torch.tensor([1.5, -2.0], dtype=torch.float64, requires_grad=True)
    with dp.sharded_factories():
        a = torch.zeros(3, 4, dtype=torch.float64)
        a[0] = 1.0                     # a plain write decides: plain
        a += 2
        b = torch.zeros(2, dtype=torch.float64)
        b[0] = w[0]                    # autograd through the plain buffer
        b[1:] = w[1:] * 3
        c = torch.full((10,), 0.5, dtype=torch.float64)
        y = x * c                      # a plain operand of a DomainTensor op
        n = torch.ones(4).sum().item()
        e = torch.empty(2, 3)
        shape, dtype, numel = e.shape, e.dtype, e.numel()  # metadata decides nothing
        e[:] = 7.0
        f = Twice.apply(torch.ones(3, dtype=torch.float64))  # a custom Function: plain use
    assert type(f) is torch.Tensor and torch.equal(f, torch.full((3,), 2.0, dtype=torch.float64))
    assert type(a) is torch.Tensor and torch.equal(a, torch.tensor([[3.0] * 4] + [[2.0] * 4] * 2,
                                                                    dtype=torch.float64))
    (b * torch.tensor([1.0, 2.0], dtype=torch.float64)).sum().backward()
    assert torch.equal(w.grad, torch.tensor([1.0, 6.0], dtype=torch.float64))
    assert type(y) is dp.DomainTensor and torch.equal(y.full_tensor(), x.full_tensor() * 0.5)
    assert n == 4.0 and shape == (2, 3) and dtype == torch.float32 and numel == 6
    assert torch.equal(e, torch.full((2, 3), 7.0))


def test_buffers_shaped_after_plain_tensors_are_plain_blocks():
    """``*_like``/``new_*`` of a plain tensor (a rank's own block) are not deferred,
    and a factory buffer given to DomainTensor as a block is its plain tensor:
    a model that builds a mask on its block (kernels/coupling/tests/
    fault_models.py's Boundary) runs inside the mode."""
    grid, shard, sizes = layout(SHAPE, (2,), 1, "uneven")
    x = shard_like(global_tensor(SHAPE, seed=1), grid, shard, sizes)
    with dp.sharded_factories():
        like, new = torch.zeros_like(x.to_local()), x.to_local().new_ones(3)
        edge = torch.zeros(x.to_local().shape, dtype=x.dtype)
        edge[:, :, :1] = 1.0                          # a plain write: plain
        y = x + dp.DomainTensor(edge, x.decomposition) * x
    assert type(like) is torch.Tensor and type(new) is torch.Tensor
    assert type(y) is dp.DomainTensor and type(y.to_local()) is torch.Tensor
    want = x.to_local() * (1 + (torch.arange(x.to_local().shape[2]) < 1).to(x.dtype)[:, None])
    assert torch.equal(y.to_local(), want)


def test_metadata_reads_leave_the_buffer_to_the_write():
    grid, shard, sizes = layout(SHAPE, (2,), 1, "zero")
    x = shard_like(global_tensor(SHAPE, seed=1), grid, shard, sizes)
    with dp.sharded_factories():
        out = torch.zeros(SHAPE, dtype=torch.float64)
        assert out.shape == SHAPE and out.size(2) == 12 and out.dim() == 4 and len(out) == 2
        out[:, :, 1:] = x[:, :, :-1]
    assert type(out) is dp.DomainTensor
    want = torch.zeros(SHAPE, dtype=torch.float64)
    want[:, :, 1:] = global_tensor(SHAPE, seed=1)[:, :, :-1]
    assert torch.equal(out.full_tensor(), want)


def test_factories_outside_the_mode_and_of_domain_tensors_are_untouched():
    grid, shard, sizes = layout(SHAPE, (2,), 1, "even")
    x = shard_like(global_tensor(SHAPE, seed=1), grid, shard, sizes)
    assert type(torch.zeros(3)) is torch.Tensor
    with dp.sharded_factories():
        like = torch.zeros_like(x)
        new = x.new_ones(SHAPE)
        plain = torch.zeros(2, out=torch.empty(2))
    assert type(like) is dp.DomainTensor and like.decomposition == x.decomposition
    assert type(new) is dp.DomainTensor and type(plain) is torch.Tensor


# -- refusals, on every rank alike ---------------------------------------------------------------
def _x(kind="uneven"):
    grid, shard, sizes = layout(SHAPE, (2,), 1, kind)
    return shard_like(global_tensor(SHAPE, seed=1), grid, shard, sizes)


def test_a_domain_tensor_written_into_a_buffer_used_plain_is_refused():
    x = _x()

    def write():
        with dp.sharded_factories():
            out = torch.zeros(SHAPE, dtype=torch.float64)
            out.fill_(1.0)             # a plain use: out is now the plain tensor
            out[:, :, :4] = x[:, :, :4]
    message = raises_on_every_rank(dp.UnsupportedOpError, "into a plain tensor is not supported",
                                   write)
    assert "new_zeros" in message


def test_a_value_cut_only_along_broadcast_dims_is_refused():
    grid, _, _ = layout((1, 6), (0,), 1, "even")
    v = shard_like(global_tensor((1, 6), seed=2), grid, {0: 0})  # dim 0 (size 1) cut

    def write():
        with dp.sharded_factories():
            out = torch.zeros(4, 6, dtype=torch.float64)
            out[:] = v
    message = raises_on_every_rank(dp.UnsupportedOpError, "cannot take a layout from this write",
                                   write)
    assert "broadcasts" in message and "new_zeros" in message


def test_an_index_tensor_in_the_write_is_refused():
    x = _x()

    def write():
        with dp.sharded_factories():
            out = torch.zeros(SHAPE, dtype=torch.float64)
            out[:, torch.tensor([0, 2])] = x[:, :2]
    raises_on_every_rank(dp.UnsupportedOpError, "the index holds a Tensor", write)


def test_domain_parallel_without_sharded_factories_refuses_as_before():
    x = _x("even")
    grid = x.decomposition.grid
    net = dp.DomainParallel(Spectral(2), grid, sharded_factories=False)
    raises_on_every_rank(dp.UnsupportedOpError, "into a plain tensor is not supported",
                         lambda: net(x))


def test_a_leaf_requiring_grad_refuses_the_write_as_one_process_does():
    x = _x("zero")

    def write():
        with dp.sharded_factories():
            out = torch.zeros(SHAPE, dtype=torch.float64, requires_grad=True)
            out[:, :, :3] = x[:, :, :3]
    raises_on_every_rank(RuntimeError, "^a leaf Variable that requires grad", write)
    with torch.no_grad(), dp.sharded_factories():  # allowed without grad, as in one process
        out = torch.zeros(SHAPE, dtype=torch.float64, requires_grad=True)
        out[:, :, :3] = x[:, :, :3]
    assert type(out) is dp.DomainTensor and out.requires_grad and out.is_leaf
