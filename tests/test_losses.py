"""Losses as global reductions, linear maps over an unsharded dim, and softmax
along sharded and unsharded dims, against one process (the oracle), on 1-, 2-
and 3-D grids with even, uneven and zero-size blocks; targets laid out
differently from the input (repartitioned) or replicated; refusals raised on
every rank."""
import pytest
import torch
import torch.nn.functional as F

import domainpar as dp
from domainpar.testing import assert_matches_single_process, shard_like
from tensor_cases import CASES, COMM, DTYPES, global_tensor, layout

pytestmark = pytest.mark.mpi

SHAPE = (2, 3, 7, 5)        # (N, C, H, W): the class / channel dim 1 is never sharded
SHARD_DIMS = (2, 3, 0)      # H, W, then the batch dim
C = SHAPE[1]


def moved(shard, candidates):
    """Another layout on the same grid: the grid axes rotated among the sharded
    dims (or, for one sharded dim, another dim of ``candidates``), balanced
    blocks. A tensor laid out so is repartitioned onto the input's blocks."""
    dims = sorted(shard, key=shard.get)
    if len(dims) == 1:
        other = next(d for d in candidates if d != dims[0])
        return {other: shard[dims[0]]}
    return {d: shard[dims[(i + 1) % len(dims)]] for i, d in enumerate(dims)}


def case_layout(grid_ndim, kind):
    return layout(SHAPE, SHARD_DIMS, grid_ndim, kind)


def class_targets(seed=1, ignore=None):
    """Class indices (N, H, W); every fourth position set to ``ignore``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, C, (SHAPE[0],) + SHAPE[2:], generator=g)
    if ignore is not None:
        t.view(-1)[::4] = ignore
    return t


def target_shard(shard):
    """The input's shard map carried to a target without the class dim, then moved."""
    t = {(d if d < 1 else d - 1): a for d, a in shard.items()}
    return moved(t, (1, 2, 0))


# Several losses go through one oracle call (fewer collectives, a faster suite):
# scalar results ('mean', 'sum') stacked into one vector, per-position results
# ('none') summed with distinct coefficients, so that no term can hide another.
def scalars(*values):
    return torch.stack(list(values))


def combined(*maps):
    out = maps[0]
    for i, m in enumerate(maps[1:]):
        out = out + (0.5 + 0.37 * i) * m
    return out


# -- elementwise losses ---------------------------------------------------------------------------
ELEMENTWISE = [
    lambda a, b, r: F.mse_loss(a, b, reduction=r),
    lambda a, b, r: F.l1_loss(a, b, reduction=r),
    lambda a, b, r: F.smooth_l1_loss(a, b, reduction=r, beta=0.5),
    lambda a, b, r: F.huber_loss(a, b, reduction=r, delta=0.7),
    lambda a, b, r: torch.nn.MSELoss(reduction=r)(a, b),
]


def reduced(losses, *args):
    return scalars(*(f(*args, r) for f in losses for r in ("mean", "sum")))


def per_position(losses, *args):
    return combined(*(f(*args, "none") for f in losses))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_elementwise_losses(grid_ndim, kind, dtype):
    grid, shard, sizes = case_layout(grid_ndim, kind)
    x = global_tensor(SHAPE, dtype, seed=0)
    y = global_tensor(SHAPE, dtype, seed=1)
    # Target laid out differently (repartitioned), then replicated (sliced).
    for t_shard in (moved(shard, SHARD_DIMS), None):
        for fn in (reduced, per_position):
            assert_matches_single_process(lambda a, b, fn=fn: fn(ELEMENTWISE, a, b), (x, y),
                                          grid, [shard, t_shard], sizes=[sizes, None])


WEIGHTED = [lambda a, b, c, r, f=f: f(a, b, reduction=r, weight=c)
            for f in (F.mse_loss, F.l1_loss, F.huber_loss)]


@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_weighted_elementwise_losses(grid_ndim, kind):
    """mse/l1 divide by the global sum of the weights, huber by the element count."""
    grid, shard, sizes = case_layout(grid_ndim, kind)
    x, y = global_tensor(SHAPE, seed=0), global_tensor(SHAPE, seed=1)
    w = global_tensor(SHAPE, seed=2).abs() + 0.1
    for w_shard in (moved(shard, SHARD_DIMS), None):
        for fn in (reduced, per_position):
            assert_matches_single_process(lambda a, b, c, fn=fn: fn(WEIGHTED, a, b, c),
                                          (x, y, w), grid, [shard, shard, w_shard],
                                          sizes=[sizes, sizes, None])


# -- cross entropy --------------------------------------------------------------------------------
CE_VARIANTS = [
    # (weight?, ignore_index or None, label_smoothing)
    (False, None, 0.0), (True, None, 0.0), (False, -100, 0.0), (True, -100, 0.0),
    (True, 2, 0.0), (True, -100, 0.1), (False, None, 0.2),
]


def ce_all(weight, reductions):
    """A function of (scores, targets, targets with -100s, targets with 2s) running
    every CE_VARIANT with each reduction, plus nn.CrossEntropyLoss and nll_loss."""
    def fn(a, t, t100, t2):
        out = []
        for use_w, ignore, smoothing in CE_VARIANTS:
            target = {None: t, -100: t100, 2: t2}[ignore]
            kw = {"weight": weight if use_w else None, "label_smoothing": smoothing}
            if ignore is not None:
                kw["ignore_index"] = ignore
            out += [F.cross_entropy(a, target, reduction=r, **kw) for r in reductions]
        out += [F.nll_loss(F.log_softmax(a, dim=1), t100, weight=weight, reduction=r)
                for r in reductions]
        if reductions == ("none",):
            return combined(*out)
        return scalars(*out, torch.nn.CrossEntropyLoss(weight=weight)(a, t100))
    return fn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_cross_entropy(grid_ndim, kind, dtype):
    grid, shard, sizes = case_layout(grid_ndim, kind)
    x = global_tensor(SHAPE, dtype, seed=0) * 2
    weight = torch.tensor([0.3, 1.0, 2.5], dtype=dtype)
    targets = (class_targets(), class_targets(ignore=-100), class_targets(ignore=2))
    # Targets laid out differently from the scores (repartitioned), one replicated.
    t_shard = target_shard(shard)
    for reductions in (("mean", "sum"), ("none",)):
        assert_matches_single_process(ce_all(weight, reductions), (x,) + targets, grid,
                                      [shard, t_shard, None, t_shard],
                                      sizes=[sizes, None, None, None])


@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_cross_entropy_probability_targets(grid_ndim, kind):
    grid, shard, sizes = case_layout(grid_ndim, kind)
    x = global_tensor(SHAPE, seed=0)
    p = torch.softmax(global_tensor(SHAPE, seed=3), dim=1)
    weight = torch.tensor([0.3, 1.0, 2.5], dtype=torch.float64)
    losses = [lambda a, b, r, kw=kw: F.cross_entropy(a, b, reduction=r, **kw)
              for kw in ({}, {"weight": weight}, {"label_smoothing": 0.1})]
    for fn in (reduced, per_position):
        assert_matches_single_process(lambda a, b, fn=fn: fn(losses, a, b), (x, p), grid,
                                      [shard, moved(shard, SHARD_DIMS)], sizes=[sizes, None])


def test_cross_entropy_mean_denominator_is_global():
    """All the non-ignored targets on some ranks only: 'mean' divides by their
    global weight sum, on every rank."""
    grid, shard, sizes = case_layout(1, "uneven")
    x = global_tensor(SHAPE, seed=0)
    t = class_targets()
    t[:, 3:] = -100
    weight = torch.tensor([0.3, 1.0, 2.5], dtype=torch.float64)
    assert_matches_single_process(lambda a, b: F.cross_entropy(a, b, weight=weight), (x, t),
                                  grid, [shard, target_shard(shard)], sizes=[sizes, None])


# -- models: a channel MLP then a loss ------------------------------------------------------------
class ChannelMLP(torch.nn.Module):
    """Channels mixed pointwise in space (Linear over the last dim after movedim)."""

    def __init__(self, c_in=C, hidden=5, c_out=C, loss="mse"):
        super().__init__()
        self.fc1 = torch.nn.Linear(c_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, c_out)
        self.loss = loss
        self.register_buffer("class_weight", torch.tensor([0.5, 1.5, 1.0][:c_out]))

    def forward(self, x, target):
        y = self.fc2(torch.tanh(self.fc1(x.movedim(1, -1)))).movedim(-1, 1)
        if self.loss == "mse":
            return F.mse_loss(y, target)
        return F.cross_entropy(y, target, weight=self.class_weight.to(y.dtype), ignore_index=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_channel_mlp_losses(grid_ndim, kind, dtype):
    grid, shard, sizes = case_layout(grid_ndim, kind)
    x = global_tensor(SHAPE, dtype, seed=0)
    y = global_tensor(SHAPE, dtype, seed=1)
    torch.manual_seed(0)
    mlp = ChannelMLP().to(dtype)
    assert_matches_single_process(mlp, (x, y), grid, [shard, moved(shard, SHARD_DIMS)],
                                  sizes=[sizes, None])
    torch.manual_seed(0)
    mlp = ChannelMLP(loss="ce").to(dtype)
    assert_matches_single_process(mlp, (x, class_targets()), grid, [shard, target_shard(shard)],
                                  sizes=[sizes, None])


# -- linear, matmul, softmax ----------------------------------------------------------------------
LAST = (2, 7, 5, 3)   # the last dim (3) is never sharded


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_linear_and_matmul(grid_ndim, kind, dtype):
    grid, shard, sizes = layout(LAST, (1, 2, 0), grid_ndim, kind)
    x = global_tensor(LAST, dtype, seed=0)
    w = global_tensor((4, 3), dtype, seed=1)
    b = global_tensor((4,), dtype, seed=2)
    v = global_tensor((3,), dtype, seed=3)

    def right(a, m, c, u):  # x @ W forms; the 4-wide ones summed over their last dim
        wide = combined(F.linear(a, m, c), F.linear(a, m), a @ m.T, torch.matmul(a, m.T))
        return combined(wide.sum(-1), a.matmul(u), F.linear(a, u))

    # Replicated operands (shard None) get their gradients compared too.
    assert_matches_single_process(right, (x, w, b, v), grid, [shard, None, None, None],
                                  sizes=[sizes, None, None, None])
    # W @ x contracts x's dim -2 (unsharded here: shard dims 1, 3, 0).
    xt = global_tensor((2, 7, 3, 5), dtype, seed=4)
    grid2, shard2, sizes2 = layout(xt.shape, (1, 3, 0), grid_ndim, kind)
    assert_matches_single_process(lambda m, u, a: combined((m @ a).sum(-2), torch.matmul(u, a)),
                                  (w, v, xt), grid2, [None, None, shard2],
                                  sizes=[None, None, sizes2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_softmax(grid_ndim, kind, dtype):
    """Along sharded dims 2, 3, 0 (global max and sum) and the unsharded dim 1."""
    grid, shard, sizes = case_layout(grid_ndim, kind)
    x = global_tensor(SHAPE, dtype, seed=0) * 3
    assert_matches_single_process(
        lambda a: combined(F.softmax(a, dim=2), F.log_softmax(a, 2), a.softmax(-1),
                           torch.log_softmax(a, dim=0), torch.softmax(a, 1),
                           a.log_softmax(dim=1), F.softmax(a, dim=3, dtype=dtype),
                           torch.special.log_softmax(a, 3)),
        (x,), grid, shard, sizes=sizes)


# -- refusals, on every rank ----------------------------------------------------------------------
def test_refusals_raise_on_every_rank():
    grid, shard, sizes = case_layout(1, "even")     # dim 2 sharded
    x = shard_like(global_tensor(SHAPE), grid, shard)
    y = shard_like(global_tensor(SHAPE, seed=1), grid, shard)
    t = shard_like(class_targets(), grid, {1: 0})
    channel = shard_like(global_tensor(SHAPE), grid, {1: 0})
    last = shard_like(global_tensor(SHAPE), grid, {3: 0})
    w = torch.ones(4, SHAPE[-1], dtype=torch.float64)
    cases = [
        (lambda: F.cross_entropy(channel, shard_like(class_targets(), grid, {1: 0})),
         dp.UnsupportedOpError, "class dim 1 is sharded"),
        (lambda: F.nll_loss(channel, shard_like(class_targets(), grid, {1: 0})),
         dp.UnsupportedOpError, "class dim 1 is sharded"),
        (lambda: F.mse_loss(x, y, size_average=False), dp.UnsupportedOpError, "legacy"),
        (lambda: F.cross_entropy(x, t, reduce=False), dp.UnsupportedOpError, "legacy"),
        (lambda: F.cross_entropy(x, t, weight=shard_like(torch.ones(3), grid, {0: 0})),
         dp.UnsupportedOpError, "weight"),
        (lambda: F.mse_loss(x, y, reduction="avg"), ValueError, "reduction"),
        (lambda: F.cross_entropy(x, shard_like(torch.zeros(2, 7, dtype=torch.long), grid,
                                               {1: 0})), ValueError, "target of shape"),
        (lambda: F.linear(last, w), dp.UnsupportedOpError, "contracted"),
        (lambda: torch.matmul(last, w.T), dp.UnsupportedOpError, "contracted"),
        (lambda: torch.matmul(x, torch.ones(3, 5, 4, dtype=torch.float64)),
         dp.UnsupportedOpError, "batched"),
        # The operator form keeps the message (UnsupportedOpError is no TypeError,
        # which torch would turn into NotImplemented and a generic message).
        (lambda: last @ w.T, dp.UnsupportedOpError, "contracted"),
        (lambda: F.linear(w, x), dp.UnsupportedOpError, "only the input"),
    ]
    raised = []
    for fn, exc, text in cases:
        with pytest.raises(exc, match=text):
            fn()
        raised.append(text)
    # Every rank went through every case (and no rank is left inside a collective).
    assert COMM.allgather(len(raised)) == [len(cases)] * COMM.Get_size()
