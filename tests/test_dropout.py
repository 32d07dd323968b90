"""Dropout on sharded DomainTensors: scaling (kept values x / (1 - p), dropped
ones zero, the dropped fraction near p), eval and p = 0 identity, gradient equal
to the scaled mask, rank-local masks from each rank's generator (the same
pattern on equal blocks under one seed, independent ones after seed_per_block),
feature dropout dropping whole channels on every block of a sample, in-place
forms, and torch's argument errors on every rank."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from domainpar.ops.dropout import seed_per_block
from domainpar.testing import shard_like
from tensor_cases import COMM, global_tensor, layout

pytestmark = pytest.mark.mpi

SHAPE = (4, 4, 32, 32)
LAYOUTS = [(1, "even", (2, 3, 0)), (2, "uneven", (2, 3, 0)), (3, "zero", (0, 2, 3)),
           (2, "zero", (1, 3)), (3, "uneven", (3, 2, 1))]
ALPHA = 1.7580993408473766  # torch's SELU constant, as ATen's alpha dropout uses


def positive(shape, dtype=torch.float64, seed=1):
    """Values away from zero, so that a zero in the output means dropped."""
    return global_tensor(shape, dtype, seed).abs() + 0.5


def sharded(x, grid_ndim, kind, order, requires_grad=False):
    grid, shard, sizes = layout(x.shape, order, grid_ndim, kind)
    return shard_like(x, grid, shard, sizes, requires_grad)


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=("f64", "f32"))
@pytest.mark.parametrize("grid_ndim,kind,order", LAYOUTS)
def test_dropout_scaling_fraction_and_gradient(grid_ndim, kind, order, dtype):
    p = 0.3
    x = positive(SHAPE, dtype)
    xd = sharded(x, grid_ndim, kind, order, requires_grad=True)
    seed_per_block(11, xd)
    y = F.dropout(xd, p)
    local, xl = y._local, xd._local.detach()
    kept = local != 0
    torch.testing.assert_close(local[kept], xl[kept] / (1 - p), rtol=4 * torch.finfo(dtype).eps,
                               atol=0)
    # dropped fraction over the whole tensor, each block once: within 8 sigma of p
    dec = xd._dec
    sub = dec.grid.sub(dec.shard.values())
    n = sub.allreduce(local.numel())
    dropped = sub.allreduce(int((~kept).sum()))
    assert abs(dropped / n - p) < 8 * math.sqrt(p * (1 - p) / n), (dropped, n)
    # gradient: the mask, scaled
    y.sum().backward()
    torch.testing.assert_close(xd.grad._local, kept.to(dtype) / (1 - p))


def test_eval_and_zero_p_are_identity():
    x = positive((2, 3, 8, 6))
    xd = sharded(x, 2, "uneven", (2, 3))
    for out in (F.dropout(xd, 0.5, training=False), F.dropout(xd, 0.0),
                F.alpha_dropout(xd, 0.5), F.feature_alpha_dropout(xd, 0.4),
                F.dropout2d(xd, 0.5, training=False), F.dropout2d(xd, 0.0),
                nn.Dropout(0.5).eval()(xd), nn.AlphaDropout(0.2).eval()(xd),
                nn.Dropout2d(0.5).eval()(xd), nn.FeatureAlphaDropout(0.3).eval()(xd)):
        assert torch.equal(out._local, xd._local)
        assert out._dec == xd._dec


def test_p_one_gives_zeros():
    xd = sharded(positive((2, 3, 8, 6)), 2, "even", (2, 3))
    for out in (F.dropout(xd, 1.0), F.dropout2d(xd, 1.0)):
        assert not out._local.any()


@pytest.mark.parametrize("fn", [F.dropout, lambda t, p: F.alpha_dropout(t, p, True)],
                         ids=("dropout", "alpha_dropout"))
def test_masks_are_rank_local_from_each_generator(fn):
    """Each block is torch's own dropout of that block with this rank's generator;
    under one seed on every rank, equal blocks draw the same pattern."""
    x = positive((4, 2, 12, 10))
    xd = sharded(x, 2, "even", (2, 3))
    torch.manual_seed(7)
    y = fn(xd, 0.4)
    torch.manual_seed(7)
    want = fn(xd._local, 0.4)
    assert torch.equal(y._local, want)
    # blocks of one shape draw one pattern under one seed
    pattern = (y._local == 0).numpy()
    stories = COMM.allgather((pattern.shape, pattern.tobytes()))
    same_shape = [b for s, b in stories if s == pattern.shape]
    assert all(b == same_shape[0] for b in same_shape)


def test_seed_per_block_gives_independent_masks_and_equal_replicas():
    """Distinct blocks draw distinct masks; replicas (a grid axis that shards
    nothing) draw the same one."""
    x = positive((2, 2, 16, 16))
    grid, shard, sizes = layout(x.shape, (2,), 2, "even")   # axis 1 replicates
    xd = shard_like(x, grid, shard, sizes)
    seed_per_block(3, xd)
    mask = (F.dropout(xd, 0.5)._local == 0).numpy().tobytes()
    block = grid.coords[0]
    stories = COMM.allgather((block, mask))
    for b, m in stories:
        for b2, m2 in stories:
            assert (m == m2) == (b == b2), "replicas must agree, distinct blocks must differ"


# -- feature dropout ------------------------------------------------------------------------------
FEATURE = [  # (func, global shape, channel dim, shard order)
    (F.dropout1d, (6, 5, 40), 1, (2, 0, 1)),
    (F.dropout1d, (5, 40), 0, (1, 0)),                 # unbatched (C, L)
    (F.dropout2d, (6, 5, 10, 12), 1, (2, 3, 0)),
    (F.dropout2d, (6, 5, 10, 12), 1, (3, 1, 2)),
    (F.dropout3d, (3, 5, 6, 5, 4), 1, (2, 3, 4)),
    (F.dropout3d, (5, 6, 5, 4), 0, (1, 3, 0)),        # unbatched (C, D, H, W)
    (F.feature_alpha_dropout, (6, 5, 10, 12), 1, (2, 3, 0)),
    (F.feature_alpha_dropout, (6, 5, 10, 12), 1, (3, 2, 1)),
]


def _channels(t: torch.Tensor, ch: int) -> torch.Tensor:
    """(instances, values): one row per (sample, channel)."""
    return t.reshape(math.prod(t.shape[:ch + 1]), -1)


@pytest.mark.parametrize("grid_ndim,kind", [(1, "uneven"), (2, "zero"), (3, "even")])
@pytest.mark.parametrize("func,shape,ch,order", FEATURE,
                         ids=[f"{f.__name__}-{len(s)}d-shard{o}" for f, s, _, o in FEATURE])
def test_feature_dropout_drops_whole_channels(func, shape, ch, order, grid_ndim, kind):
    p = 0.4
    x = positive(shape)
    xd = sharded(x, grid_ndim, kind, order, requires_grad=True)
    seed_per_block(5 + grid_ndim, xd)   # blocks disagree unless the mask is shared
    y = func(xd, p, training=True)
    y.sum().backward()
    out, grad = _channels(y.full_tensor().detach(), ch), _channels(xd.grad.full_tensor(), ch)
    xs = _channels(x, ch)
    if func is F.feature_alpha_dropout:
        a = 1.0 / math.sqrt((ALPHA * ALPHA * p + 1) * (1 - p))
        kept_value, dropped_value, scale = a * xs + ALPHA * a * p, ALPHA * a * (p - 1), a
    else:
        kept_value, dropped_value, scale = xs / (1 - p), torch.zeros_like(xs), 1 / (1 - p)
    kept = torch.isclose(out, kept_value, rtol=1e-12, atol=1e-12).all(1)
    dropped = torch.isclose(out, dropped_value + 0 * xs, rtol=1e-12, atol=1e-12).all(1)
    assert (kept ^ dropped).all(), "a channel is neither wholly kept nor wholly dropped"
    torch.testing.assert_close(grad, kept[:, None].to(grad.dtype).expand_as(grad) * scale)


def test_feature_dropout_fraction():
    """Over 1024 (sample, channel) pairs the dropped fraction is p within 6 sigma."""
    p, shape = 0.25, (32, 32, 4, 6)
    xd = sharded(positive(shape), 2, "uneven", (2, 3))
    seed_per_block(17, xd)
    out = F.dropout2d(xd, p).full_tensor()
    dropped = float((_channels(out, 1) == 0).all(1).double().mean())
    assert abs(dropped - p) < 6 * math.sqrt(p * (1 - p) / (32 * 32)), dropped


def test_in_place_forms():
    x = positive((4, 3, 12, 8))
    for func in (F.dropout, F.dropout2d, F.feature_alpha_dropout):
        xd = sharded(x, 2, "uneven", (2, 3))
        before = xd._local.clone()
        seed_per_block(2, xd)
        out = func(xd, 0.5, True, True)
        assert out is xd
        seed_per_block(2, xd)
        want = func(sharded(x, 2, "uneven", (2, 3)), 0.5, True)
        assert torch.equal(xd._local, want._local)
        assert not torch.equal(xd._local, before)


def test_torch_errors_on_every_rank():
    xd = sharded(positive((2, 3, 8, 6)), 1, "even", (2,))
    for fn, exc in [(lambda: F.dropout(xd, 1.5), ValueError),
                    (lambda: F.dropout2d(xd, -0.1), ValueError),
                    (lambda: F.dropout1d(xd, 0.5), RuntimeError)]:
        with pytest.raises(exc):
            fn()
    COMM.Barrier()
