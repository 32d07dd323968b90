"""Normalization layers (BatchNorm1d/2d/3d, InstanceNorm1d/2d/3d, GroupNorm,
LayerNorm and their functional forms) against one process: output, input
gradient and weight/bias gradients in float64 and float32, train and eval,
sharded on spatial, batch and channel dims over 1-, 2- and 3-D grids with
even, uneven, zero-size and periodic layouts (a seeded sample of the matrix);
running statistics after several steps equal one process and are bitwise
identical on every rank; a large mean offset; refusals on every rank."""
import copy
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

import domainpar as dp
from domainpar.ops import rowwise
from domainpar.testing import assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import COMM, global_tensor, layout

pytestmark = pytest.mark.mpi

C = 4
SHAPES = {1: (5, C, 9), 2: (3, C, 7, 6), 3: (2, C, 5, 4, 3)}   # (N, C, spatial...)
SPATIAL_FIRST = {1: (2, 0, 1), 2: (2, 3, 0), 3: (2, 3, 4)}     # then batch (or more spatial)
BATCH_FIRST = {1: (0, 2, 1), 2: (0, 2, 3), 3: (0, 3, 2)}
CHANNEL_FIRST = {1: (1, 2, 0), 2: (1, 2, 0), 3: (1, 3, 2)}
INPUT_SEED = 3  # not the oracle's seed 0: a loss weight equal to the input hides gradients


def _stats(m, seed=5):
    """Random running statistics, the same on every rank (an explicit generator:
    the ranks' global generators start from different random seeds)."""
    g = torch.Generator().manual_seed(seed)
    m.running_mean.normal_(generator=g)
    m.running_var.uniform_(0.5, 2.0, generator=g)
    return m


def _affine(m, seed=6):
    """Non-trivial weight and bias, so that their use is tested, not just their presence."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5 + 1.0)
    return m


def bn(nsp, **kw):
    return _affine([nn.BatchNorm1d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d][nsp](C, **kw))


def inorm(nsp, **kw):
    return _affine([None, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d][nsp](C, **kw))


def evaluated(m):
    return _stats(m).eval()


# (name, nsp, factory, shard orders): nsp 0 is an (N, C) input
CONFIGS = [
    ("BatchNorm1d (N, C)", 0, lambda: bn(0), ((0, 1), (1, 0))),
    ("BatchNorm1d", 1, lambda: bn(1), (SPATIAL_FIRST[1], CHANNEL_FIRST[1])),
    ("BatchNorm2d", 2, lambda: bn(2), (SPATIAL_FIRST[2], BATCH_FIRST[2], CHANNEL_FIRST[2])),
    ("BatchNorm2d no affine, no stats", 2,
     lambda: bn(2, affine=False, track_running_stats=False), (SPATIAL_FIRST[2],)),
    ("BatchNorm2d cumulative, eps", 2, lambda: bn(2, momentum=None, eps=1e-3),
     (BATCH_FIRST[2],)),
    ("BatchNorm3d", 3, lambda: bn(3), (SPATIAL_FIRST[3], BATCH_FIRST[3])),
    ("BatchNorm2d eval", 2, lambda: evaluated(bn(2)), (CHANNEL_FIRST[2], SPATIAL_FIRST[2])),
    ("BatchNorm2d eval, no stats", 2,
     lambda: bn(2, track_running_stats=False).eval(), (SPATIAL_FIRST[2],)),
    ("InstanceNorm1d", 1, lambda: inorm(1), (SPATIAL_FIRST[1], BATCH_FIRST[1])),
    ("InstanceNorm2d affine, stats", 2,
     lambda: inorm(2, affine=True, track_running_stats=True),
     (SPATIAL_FIRST[2], CHANNEL_FIRST[2], BATCH_FIRST[2])),
    ("InstanceNorm2d eval", 2,
     lambda: evaluated(inorm(2, affine=True, track_running_stats=True)), (SPATIAL_FIRST[2],)),
    ("InstanceNorm3d affine", 3, lambda: inorm(3, affine=True), (SPATIAL_FIRST[3],)),
    ("GroupNorm(2)", 2, lambda: _affine(nn.GroupNorm(2, C)), (SPATIAL_FIRST[2], BATCH_FIRST[2])),
    ("GroupNorm(1) 1-D", 1, lambda: _affine(nn.GroupNorm(1, C)), (SPATIAL_FIRST[1],)),
    ("GroupNorm(4) no affine 3-D", 3, lambda: nn.GroupNorm(4, C, affine=False),
     (SPATIAL_FIRST[3],)),
    ("LayerNorm(W)", 2, lambda: _affine(nn.LayerNorm(6)), ((3, 0, 2), (0, 2, 3))),
    ("LayerNorm(H, W)", 2, lambda: _affine(nn.LayerNorm((7, 6))), (SPATIAL_FIRST[2],)),
    ("LayerNorm(C, H, W) no bias", 2, lambda: _affine(nn.LayerNorm((C, 7, 6), bias=False)),
     ((1, 3, 0),)),
    ("LayerNorm 3-D no affine", 3,
     lambda: nn.LayerNorm((5, 4, 3), elementwise_affine=False), (SPATIAL_FIRST[3],)),
]

LAYOUTS = [(g, k) for g in (1, 2, 3) for k in ("even", "uneven", "zero", "periodic")]
PER_CONFIG = 3


def _matrix():
    """Every config on PER_CONFIG layouts (grid ndim x kind x shard order) drawn by a
    seeded generator, the same cases on every rank; float64 and float32 take turns,
    so that every config runs in both."""
    rng = random.Random(20240604)
    cases = []
    for i, (name, nsp, make, orders) in enumerate(CONFIGS):
        picks = rng.sample([(g, k, o) for g, k in LAYOUTS for o in orders], PER_CONFIG)
        for j, (grid_ndim, kind, order) in enumerate(picks):
            dtype = (torch.float64, torch.float32)[(i + j) % 2]
            cases.append(pytest.param(
                nsp, make, order, grid_ndim, kind, dtype,
                id=f"{name}-{str(dtype)[6:]}-{grid_ndim}d-{kind}-shard{order}"))
    return cases


def shape_of(nsp):
    return (6, C) if nsp == 0 else SHAPES[nsp]


@pytest.mark.parametrize("nsp,make,order,grid_ndim,kind,dtype", _matrix())
def test_module_matches_one_process(nsp, make, order, grid_ndim, kind, dtype):
    shape = shape_of(nsp)
    grid, shard, sizes = layout(shape, order, grid_ndim, kind)
    model = make().to(dtype)
    assert_matches_single_process(model, global_tensor(shape, dtype, INPUT_SEED), grid, shard,
                                  sizes=sizes)


def test_fused_group_norm_makes_one_block_sized_tensor_each_way():
    """The fused group norm's forward writes the moments' squared deviations into
    the buffer that becomes its output, and its backward the products g * x into
    the one that becomes the input gradient: one block-sized tensor each way (a
    fresh block under glibc's default malloc is faulted in page by page)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    if COMM.Get_size() == 1:
        pytest.skip("the fused path needs the statistics cut over 2 or more ranks")
    shape = (1, C, 4 * COMM.Get_size(), 6, 5)
    grid, shard, sizes = layout(shape, SPATIAL_FIRST[3], 1, "even")
    x = shard_like(global_tensor(shape, seed=INPUT_SEED), grid, shard, sizes).requires_grad_()
    block = x.to_local().numel()
    made = {"forward": set(), "backward": set()}
    phase = ["forward"]

    class Storages(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() == block:
                made[phase[0]].add(out.untyped_storage().data_ptr())
            return out

    norm = _affine(nn.GroupNorm(2, C)).double()
    grad = torch.ones_like(x.to_local())
    with Storages():
        y = norm(x)
        phase[0] = "backward"
        y.to_local().backward(grad)
    given = {t.untyped_storage().data_ptr() for t in (x.to_local(), grad)}  # and views
    assert len(made["forward"] - given) == 1   # the output
    assert len(made["backward"] - given) == 1  # the input gradient


ROW_PASSES = pytest.mark.parametrize("native", [True, False], ids=["C loops", "torch ops"])


def _row_passes(monkeypatch, native):
    """Run the group norm's row passes in C (``ops.rowwise``, where they apply:
    one torch thread, as run_mpi.py and the Makefile set) or with torch's ops;
    returns a count of the C affine calls (the fused path's forward makes one)."""
    monkeypatch.setattr(rowwise, "use_native", native)
    calls = [0]
    affine = rowwise.affine

    def counted(*args, **kwargs):
        calls[0] += 1
        return affine(*args, **kwargs)
    monkeypatch.setattr(rowwise, "affine", counted)
    return calls


@ROW_PASSES
@pytest.mark.parametrize("grid_ndim,kind", [(1, "uneven"), (2, "zero"), (3, "periodic")])
def test_group_norm_row_passes_match_one_process(native, grid_ndim, kind, monkeypatch):
    """The fused group norm with its row passes in C and with torch's ops, float64
    and float32, against one process; the C loops really run where asked."""
    calls = _row_passes(monkeypatch, native)
    shape = SHAPES[3]
    grid, shard, sizes = layout(shape, SPATIAL_FIRST[3], grid_ndim, kind)
    for dtype in (torch.float64, torch.float32):
        assert_matches_single_process(_affine(nn.GroupNorm(2, C)).to(dtype),
                                      global_tensor(shape, dtype, INPUT_SEED), grid, shard,
                                      sizes=sizes)
    cut = COMM.Get_size() > 1 and torch.get_num_threads() == 1 and rowwise._LIB is not None
    assert (calls[0] > 0) == (native and cut)


NO_GRAD_CONFIGS = [("GroupNorm(2)", lambda: _affine(nn.GroupNorm(2, C))),
                   ("InstanceNorm3d affine", lambda: inorm(3, affine=True)),
                   ("LayerNorm 3-D", lambda: _affine(nn.LayerNorm((5, 4, 3))))]


@ROW_PASSES
@pytest.mark.parametrize("name,make", NO_GRAD_CONFIGS, ids=[n for n, _ in NO_GRAD_CONFIGS])
@pytest.mark.parametrize("grid_ndim,kind", [(1, "even"), (2, "uneven"), (3, "zero")])
def test_no_grad_forward_matches_one_process(native, name, make, grid_ndim, kind, monkeypatch):
    """Under no_grad the moments of every norm over trailing dims come from the C
    loops (or torch's ops): float64 to 1e-10 of one process; float32 within
    twice one process's float32 error against float64 (or 1e-6 of the output)."""
    _row_passes(monkeypatch, native)
    shape = SHAPES[3]
    grid, shard, sizes = layout(shape, SPATIAL_FIRST[3], grid_ndim, kind)
    model = make()
    xd = global_tensor(shape, torch.float64, INPUT_SEED)
    with torch.no_grad():
        truth = model.double()(xd)
        ours = model(shard_like(xd, grid, shard, sizes)).full_tensor()
        torch.testing.assert_close(ours, truth, rtol=1e-10, atol=1e-10)
        model32, x32 = copy.deepcopy(model).float(), xd.float()
        err_torch = float((model32(x32).double() - truth).abs().max())
        err_ours = float((model32(shard_like(x32, grid, shard, sizes)).full_tensor().double()
                          - truth).abs().max())
    assert err_ours <= max(2 * err_torch, 1e-6 * float(truth.abs().max())), (err_ours, err_torch)


@pytest.mark.parametrize("grid_ndim,kind", [(1, "uneven"), (2, "zero"), (3, "even")])
def test_under_domain_parallel(grid_ndim, kind):
    """Weight and bias gradients deferred and bucketed by DomainParallel."""
    shape = SHAPES[2]
    grid, shard, sizes = layout(shape, SPATIAL_FIRST[2], grid_ndim, kind)
    model = nn.Sequential(bn(2), _affine(nn.GroupNorm(2, C)), _affine(nn.LayerNorm((7, 6))),
                          inorm(2, affine=True)).double()
    assert_matches_single_process(model, global_tensor(shape, seed=INPUT_SEED), grid, shard,
                                  sizes=sizes, wrap=lambda m: dp.DomainParallel(m, grid))


def test_group_norm_channels_sharded_on_group_boundaries():
    """Channels sharded into whole groups of 2 (8 channels, 4 groups): on a 1-D grid
    in blocks of 2 and a larger last one; on a 2-D grid (channels x W) with every
    channel on the first coordinate and empty channel blocks elsewhere."""
    size = COMM.Get_size()
    shape = (2, 8, 5, 6)
    one_d = dp.ProcessGrid((size,))
    dims = MPI.Compute_dims(size, 2)
    two_d = dp.ProcessGrid(dims)
    cases = [(one_d, {1: 0}, {1: [2] * (size - 1) + [8 - 2 * (size - 1)]}),
             (two_d, {1: 0, 3: 1}, {1: [8] + [0] * (dims[0] - 1)})]
    for grid, shard, sizes in cases:
        for dtype in (torch.float64, torch.float32):
            assert_matches_single_process(_affine(nn.GroupNorm(4, 8)).to(dtype),
                                          global_tensor(shape, dtype, INPUT_SEED), grid, shard,
                                          sizes=sizes)


def test_functional_forms():
    """The functional forms with plain (requires-grad) parameters, keyword and
    positional arguments, and instance_norm on running stats."""
    shape = SHAPES[2]

    class Fns(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(9)
            self.w = nn.Parameter(torch.randn(C, generator=g, dtype=torch.float64))
            self.b = nn.Parameter(torch.randn(C, generator=g, dtype=torch.float64))
            self.lw = nn.Parameter(torch.randn(6, generator=g, dtype=torch.float64))
            self.rm = torch.randn(C, generator=g, dtype=torch.float64)
            self.rv = torch.rand(C, generator=g, dtype=torch.float64) + 0.5

        def forward(self, x):
            a = F.batch_norm(x, None, None, self.w, self.b, True, 0.1, 1e-4)
            b = F.group_norm(x, 2, weight=self.w, eps=1e-3)
            c = F.layer_norm(x, [6], self.lw, None)
            d = F.instance_norm(x, self.rm, self.rv, self.w, self.b, use_input_stats=False)
            e = F.instance_norm(x, weight=self.w)
            return a + 0.5 * b + 0.25 * c + 0.125 * d + 0.0625 * e

    for grid_ndim, kind in [(1, "zero"), (2, "uneven"), (3, "periodic")]:
        grid, shard, sizes = layout(shape, SPATIAL_FIRST[2], grid_ndim, kind)
        assert_matches_single_process(Fns(), global_tensor(shape, seed=INPUT_SEED), grid, shard,
                                      sizes=sizes)


# -- running statistics ------------------------------------------------------------------------
def _identical_on_every_rank(t: torch.Tensor) -> bool:
    blobs = COMM.allgather(t.detach().numpy().tobytes())
    return all(b == blobs[0] for b in blobs)


RUNNING = [
    ("BatchNorm2d", lambda: bn(2), SPATIAL_FIRST[2]),
    ("BatchNorm2d cumulative", lambda: bn(2, momentum=None), BATCH_FIRST[2]),
    ("BatchNorm2d channels", lambda: bn(2, momentum=0.3), CHANNEL_FIRST[2]),
    ("BatchNorm3d", lambda: bn(3), BATCH_FIRST[3]),
    ("InstanceNorm2d", lambda: inorm(2, track_running_stats=True), BATCH_FIRST[2]),
    ("InstanceNorm2d channels", lambda: inorm(2, affine=True, track_running_stats=True,
                                             momentum=0.2), CHANNEL_FIRST[2]),
]


def _running_cases():
    """Each config on two of three layouts, float64 and float32 taking turns."""
    cases = []
    for i, (name, make, order) in enumerate(RUNNING):
        layouts = [(1, "uneven"), (2, "zero"), (3, "even")]
        for j, (grid_ndim, kind) in enumerate([layouts[i % 3], layouts[(i + 1) % 3]]):
            dtype = (torch.float64, torch.float32)[(i + j) % 2]
            cases.append(pytest.param(name, make, order, grid_ndim, kind, dtype,
                                      id=f"{name}-{grid_ndim}d-{kind}-{str(dtype)[6:]}"))
    return cases


@pytest.mark.parametrize("name,make,order,grid_ndim,kind,dtype", _running_cases())
def test_running_stats_after_steps(name, make, order, grid_ndim, kind, dtype):
    """Three training steps on different inputs, then the running statistics (and
    num_batches_tracked) equal one process's and are bitwise identical on every rank;
    the next eval step uses them."""
    nsp = 3 if "3d" in name else 2
    shape = SHAPES[nsp]
    grid, shard, sizes = layout(shape, order, grid_ndim, kind)
    ref = make().to(dtype)
    mine = copy.deepcopy(ref)
    for step in range(3):
        x = global_tensor(shape, dtype, seed=10 + step) * (1 + step) + step
        ref(x)
        mine(shard_like(x, grid, shard, sizes))
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for (bname, got), (_, want) in zip(mine.named_buffers(), ref.named_buffers()):
        assert _identical_on_every_rank(got), f"{bname} differs between ranks"
        torch.testing.assert_close(got, want, **tol, msg=lambda m, bname=bname: f"{bname}: {m}")
    ref.eval()
    mine.eval()
    x = global_tensor(shape, dtype, seed=20)
    torch.testing.assert_close(mine(shard_like(x, grid, shard, sizes)).full_tensor(), ref(x),
                               **tol)


# -- numerics ----------------------------------------------------------------------------------
def _run(model, x, loss_weight, layout_=None):
    """Output, input gradient and parameter gradients (whole tensors) of ``model``
    on ``x``, sharded by ``layout_`` = (grid, shard, sizes) when given."""
    model = copy.deepcopy(model).to(x.dtype)
    xin = (shard_like(x, *layout_, requires_grad=True) if layout_
           else x.clone().requires_grad_(True))
    out = model(xin)
    (out * loss_weight.to(x.dtype)).sum().backward()
    full = [out.full_tensor() if layout_ else out, xin.grad.full_tensor() if layout_ else xin.grad]
    return [t.detach().double() for t in full + [p.grad for p in model.parameters()]]


@ROW_PASSES
@pytest.mark.parametrize("order", [BATCH_FIRST[2], SPATIAL_FIRST[2]], ids=["batch", "spatial"])
@pytest.mark.parametrize("grid_ndim,kind", [(1, "uneven"), (2, "even"), (3, "zero")])
def test_large_offset_float32(grid_ndim, kind, order, native, monkeypatch):
    """x = 1e4 + randn in float32: E[x^2] - E[x]^2 loses every digit of the variance
    (asserted below), per-block moments combined with Chan's formula do not. Output,
    input and parameter gradients are as close to the float64 truth as torch's own
    float32 kernels get, or within 1e-3 relative (float32's resolution at 1e4, the
    unit of the normalized values); the naive formula is off by O(1). The group
    norm's row passes in C and with torch's ops."""
    _row_passes(monkeypatch, native)
    shape = SHAPES[2]
    x = (1e4 + global_tensor(shape, seed=INPUT_SEED)).float()
    xd = x.double()
    naive = (x * x).mean((0, 2, 3)) - x.mean((0, 2, 3)) ** 2
    assert (naive.double() - xd.var((0, 2, 3), unbiased=False)).abs().max() > 0.5, \
        "the offset no longer defeats E[x^2] - E[x]^2"

    model = Weighted([bn(2), inorm(2, affine=True), _affine(nn.GroupNorm(2, C)),
                      _affine(nn.LayerNorm((7, 6)))])
    w = global_tensor(shape, seed=12345)
    truth = _run(model, xd, w)
    torch32 = _run(model, x, w)
    ours = _run(model, x, w, layout(shape, order, grid_ndim, kind))
    names = ["output", "input gradient"] + [n for n, _ in model.named_parameters()]
    for name, t, o, m in zip(names, truth, torch32, ours):
        scale = float(t.abs().max())
        err_torch, err_ours = (float((v - t).abs().max()) / scale for v in (o, m))
        assert err_ours <= max(2 * err_torch, 1e-3), (name, err_ours, err_torch)


class Weighted(nn.ModuleList):
    """The layers' outputs summed with distinct weights (no term can hide another)."""

    def forward(self, x):
        out = self[0](x)
        for i, layer in enumerate(self[1:]):
            out = out + (i + 2) * layer(x)
        return out


# -- refusals and torch's errors ------------------------------------------------------------------
def test_group_norm_refuses_groups_split_by_blocks():
    if COMM.Get_size() == 1:
        pytest.skip("one rank holds every channel: no block boundary can split a group")
    grid = dp.ProcessGrid((COMM.Get_size(),))
    sizes = [3] + [1] * (COMM.Get_size() - 2) + [8 - 3 - (COMM.Get_size() - 2)]
    x = shard_like(global_tensor((2, 8, 5)), grid, {1: 0}, {1: sizes})
    raises_on_every_rank(dp.UnsupportedOpError, ["group_norm", "split groups of 2"],
                         lambda: F.group_norm(x, 4))


def test_domain_tensor_parameters_refused():
    grid = dp.ProcessGrid((COMM.Get_size(),))
    x = shard_like(global_tensor((2, C, 6)), grid, {2: 0})
    w = shard_like(torch.ones(C), grid, {0: 0})
    raises_on_every_rank(dp.UnsupportedOpError, ["batch_norm", "weight"],
                         lambda: F.batch_norm(x, None, None, w, None, True))
    raises_on_every_rank(dp.UnsupportedOpError, ["layer_norm", "bias"],
                         lambda: F.layer_norm(x, (6,), None, w))


def test_torch_errors_on_every_rank():
    """torch's own argument errors, raised from the global shapes before any message."""
    grid = dp.ProcessGrid((COMM.Get_size(),))
    x = shard_like(global_tensor((2, C, 6)), grid, {2: 0})
    one = shard_like(global_tensor((1, C)), grid, {0: 0})
    for fn, exc in [(lambda: F.group_norm(x, 3), RuntimeError),
                    (lambda: F.layer_norm(x, (5,)), RuntimeError),
                    (lambda: F.batch_norm(one, None, None, training=True), ValueError),
                    (lambda: F.batch_norm(x, None, None, training=False), RuntimeError)]:
        with pytest.raises(exc):
            fn()
    COMM.Barrier()


def test_can_fail():
    """Statistics of the block alone (no communication) are caught by the oracle."""
    if COMM.Get_size() == 1:
        pytest.skip("one rank: a block's statistics are the global ones")
    grid = dp.ProcessGrid((COMM.Get_size(),))

    def block_stats(t):
        if isinstance(t, dp.DomainTensor):
            return dp.DomainTensor(F.layer_norm(t._local, t._local.shape[-1:]), t._dec)
        return F.layer_norm(t, (6,))
    with pytest.raises(AssertionError):
        assert_matches_single_process(block_stats, global_tensor((2, C, 6), seed=INPUT_SEED),
                                      grid, {2: 0})


def test_group_norm_refuses_a_second_derivative_where_statistics_are_shared():
    """The fused sharded path differentiates once: a gradient of a gradient
    raises on every rank instead of missing the allreduce's terms."""
    shape = (2, C, 7, 6)
    grid, shard, sizes = layout(shape, (2, 3), 2, "even")
    x = shard_like(global_tensor(shape, torch.float64, INPUT_SEED), grid, shard, sizes)
    x.requires_grad_(True)
    y = F.group_norm(x, 2)
    (g,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
    if any(grid.dims[a] > 1 for d, a in shard.items() if d >= 2):
        with pytest.raises(RuntimeError, match="once_differentiable"):
            g.sum().backward()
    else:  # torch's own kernel on a whole block: twice differentiable
        g.sum().backward()
