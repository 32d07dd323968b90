"""Pooling (max, avg, adaptive, lp; 1-, 2- and 3-D) on sharded inputs against one
process (the oracle): output and input gradient, float64 and float32, over a
seeded sample of the options x layouts (even, uneven, zero-size blocks,
periodic grid) x 1-, 2- and 3-D grids; return_indices equal to torch's global
indices; every spelling (F.*, the boolean-dispatch inner functions, torch.*,
nn modules) reaches the rule; refusals raised on every rank."""
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import domainpar as dp
from domainpar.testing import assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import DTYPES, GRID_NDIMS, global_tensor, layout

pytestmark = pytest.mark.mpi

KINDS = ("even", "uneven", "zero", "periodic")


def case_layout(shape, shard_dims, grid_ndim, kind, seed=0):
    """tensor_cases.layout, with 'periodic' as a kind (uneven blocks on a periodic
    grid: pooling's padding must not wrap around)."""
    periodic = kind == "periodic"
    return layout(shape, shard_dims, grid_ndim, "uneven" if periodic else kind, seed=seed,
                  periodic=periodic)


def spatial_first(shape, nsp):
    """Shard the spatial dims first, then the batch dim."""
    return tuple(range(len(shape) - nsp, len(shape))) + (0,)


def valid(fn, shape, *args, **kwargs) -> bool:
    try:
        fn(torch.empty(shape, device="meta"), *args, **kwargs)
        return True
    except RuntimeError:
        return False


def opt(rng, nsp, lo, hi):
    """An int or a per-dim tuple (both spellings torch takes)."""
    values = tuple(rng.randint(lo, hi) for _ in range(nsp))
    return values[0] if nsp == 1 or rng.random() < 0.3 else values


def draw_layout(rng, i):
    """Layouts cycle (every kind on every grid dimensionality), dtypes alternate."""
    return {"grid_ndim": GRID_NDIMS[i % 3], "kind": KINDS[(i // 3) % 4],
            "dtype": DTYPES[(i // 12) % 2]}


def draw_max(rng, i):
    nsp = 1 + i % 3
    while True:
        shape = (2, 2) + tuple(rng.randint(4, 9 if nsp < 3 else 7) for _ in range(nsp))
        if rng.random() < 0.15:
            shape = shape[1:]  # unbatched
        k = opt(rng, nsp, 1, 4)
        spec = {"nsp": nsp, "shape": shape, "kernel_size": k,
                "stride": None if rng.random() < 0.3 else opt(rng, nsp, 1, 3),
                "padding": opt(rng, nsp, 0, 2), "dilation": opt(rng, nsp, 1, 2),
                "ceil_mode": rng.random() < 0.5, "return_indices": rng.random() < 0.5,
                "spelling": rng.choice(("F", "module", "with_indices", "torch"))}
        kw = {a: spec[a] for a in ("kernel_size", "stride", "padding", "dilation", "ceil_mode")}
        if valid(getattr(F, f"max_pool{nsp}d"), shape, **kw):
            return {**spec, **draw_layout(rng, i)}


def draw_avg(rng, i):
    nsp = 1 + i % 3
    while True:
        shape = (2, 2) + tuple(rng.randint(4, 9 if nsp < 3 else 7) for _ in range(nsp))
        if rng.random() < 0.15:
            shape = shape[1:]
        spec = {"nsp": nsp, "shape": shape, "kernel_size": opt(rng, nsp, 1, 4),
                "stride": None if rng.random() < 0.3 else opt(rng, nsp, 1, 3),
                "padding": opt(rng, nsp, 0, 2), "ceil_mode": rng.random() < 0.5,
                "count_include_pad": rng.random() < 0.5,
                "divisor_override": None if nsp == 1 or rng.random() < 0.6 else rng.randint(1, 5),
                "spelling": rng.choice(("F", "module"))}
        kw = {a: spec[a] for a in ("kernel_size", "stride", "padding", "ceil_mode",
                                   "count_include_pad", "divisor_override")}
        if nsp == 1:
            kw.pop("divisor_override")
        if valid(getattr(F, f"avg_pool{nsp}d"), shape, **kw):
            return {**spec, **draw_layout(rng, i)}


_RNG = random.Random(4)
MAX_CASES = [draw_max(_RNG, i) for i in range(36)]
AVG_CASES = [draw_avg(_RNG, i) for i in range(36)]


def short(spec):
    return "-".join(str(v).replace(" ", "") for k, v in spec.items() if k != "shape")


def max_call(spec):
    """The max pool of ``spec`` in its spelling; returns (output, indices or None)."""
    nsp, ri = spec["nsp"], spec["return_indices"]
    kw = {a: spec[a] for a in ("kernel_size", "stride", "padding", "dilation", "ceil_mode")}
    spelling = spec["spelling"]

    def call(t):
        if spelling == "module":
            out = getattr(nn, f"MaxPool{nsp}d")(**kw, return_indices=ri)(t)
        elif spelling == "with_indices":
            out = getattr(F, f"max_pool{nsp}d_with_indices")(t, **kw)
        elif spelling == "torch":
            stride = [] if kw["stride"] is None else kw["stride"]
            out = getattr(torch, f"max_pool{nsp}d")(t, kw["kernel_size"], stride,
                                                    kw["padding"], kw["dilation"],
                                                    kw["ceil_mode"])
        else:
            out = getattr(F, f"max_pool{nsp}d")(t, **kw, return_indices=ri)
        return out if isinstance(out, tuple) else (out, None)
    return call


def check(fn, x, grid, shard, sizes):
    """The oracle on ``fn`` (output, indices or None), then the indices: the
    sharded run's, gathered, equal the single process's exactly."""
    seen = []

    def values(t):
        out, idx = fn(t)
        if idx is not None:
            seen.append(idx)
        return out
    assert_matches_single_process(values, x, grid, shard, sizes=sizes)
    if seen:
        ref, got = seen  # the oracle runs the single process first
        assert isinstance(got, dp.DomainTensor) and got._dec.shard == shard
        assert got.dtype == torch.long
        assert torch.equal(got.full_tensor(), ref)


@pytest.mark.parametrize("spec", MAX_CASES, ids=short)
def test_max_pool(spec):
    shape = spec["shape"]
    grid, shard, sizes = case_layout(shape, spatial_first(shape, spec["nsp"]),
                                     spec["grid_ndim"], spec["kind"])
    check(max_call(spec), global_tensor(shape, spec["dtype"], seed=1), grid, shard, sizes)


@pytest.mark.parametrize("spec", AVG_CASES, ids=short)
def test_avg_pool(spec):
    nsp, shape = spec["nsp"], spec["shape"]
    grid, shard, sizes = case_layout(shape, spatial_first(shape, nsp), spec["grid_ndim"],
                                     spec["kind"])
    kw = {a: spec[a] for a in ("kernel_size", "stride", "padding", "ceil_mode",
                               "count_include_pad", "divisor_override")}
    if nsp == 1:
        kw.pop("divisor_override")
    if spec["spelling"] == "module":
        fn = getattr(nn, f"AvgPool{nsp}d")(**kw)
    else:
        def fn(t):
            return getattr(F, f"avg_pool{nsp}d")(t, **kw)
    assert_matches_single_process(fn, global_tensor(shape, spec["dtype"], seed=2), grid, shard,
                                  sizes=sizes)


def test_sample_covers_every_option():
    """The sampled matrix holds every option value, layout and dtype (so a
    reseeded sample cannot silently drop one)."""
    def values(cases, key, f=lambda v: v):
        return {f(c[key]) for c in cases}
    for cases in (MAX_CASES, AVG_CASES):
        assert values(cases, "nsp") == {1, 2, 3}
        assert values(cases, "kind") == set(KINDS)
        assert values(cases, "grid_ndim") == set(GRID_NDIMS)
        assert values(cases, "dtype") == set(DTYPES)
        assert values(cases, "ceil_mode") == {True, False}
        assert None in values(cases, "stride")
        assert values(cases, "padding", lambda p: max(p) if isinstance(p, tuple) else p) >= {0, 1}
        assert any(len(c["shape"]) == c["nsp"] + 1 for c in cases)  # unbatched
    assert values(MAX_CASES, "dilation", lambda d: max(d) if isinstance(d, tuple) else d) \
        == {1, 2}
    assert values(MAX_CASES, "spelling") == {"F", "module", "with_indices", "torch"}
    assert values(MAX_CASES, "return_indices") == {True, False}
    assert values(AVG_CASES, "count_include_pad") == {True, False}
    assert len(values(AVG_CASES, "divisor_override")) > 2


# -- modules on 3-D grids, lp_pool, channel sharding ---------------------------------------------
MODULES = [
    lambda: nn.MaxPool3d(3, stride=2, padding=1, ceil_mode=True),
    lambda: nn.MaxPool3d((2, 3, 2), stride=(1, 2, 2), dilation=(2, 1, 1), return_indices=True),
    lambda: nn.AvgPool3d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    lambda: nn.AvgPool3d((2, 3, 3), stride=(2, 1, 3), padding=(1, 1, 0), divisor_override=5),
    lambda: nn.AdaptiveAvgPool3d((4, 3, 2)),
    lambda: nn.AdaptiveMaxPool3d((2, 1, 1)),
    lambda: nn.LPPool2d(2, (3, 2), stride=2),
    lambda: nn.LPPool3d(float("inf"), 2, ceil_mode=True),
    lambda: nn.LPPool1d(-float("inf"), 3, stride=2, ceil_mode=True),
]


@pytest.mark.parametrize("make,kind", [(m, KINDS[(i + j) % 4]) for i, m in enumerate(MODULES)
                                       for j in (0, 2)],
                         ids=lambda v: repr(v()) if callable(v) else v)
def test_modules_on_3d_grid(make, kind):
    module = make()
    nsp = 1 if "1d" in type(module).__name__ else 2 if "2d" in type(module).__name__ else 3
    shape = (2, 2) + (8, 6, 4)[:nsp]
    grid, shard, sizes = case_layout(shape, spatial_first(shape, nsp), 3, kind)

    def fn(t):
        out = module(t)
        return out if isinstance(out, tuple) else (out, None)
    check(fn, global_tensor(shape, seed=3), grid, shard, sizes)


@pytest.mark.parametrize("grid_ndim", GRID_NDIMS)
def test_channel_dim_sharded(grid_ndim):
    """Pooling is per (batch, channel) plane: the channel dim may be sharded too."""
    shape = (2, 5, 9, 8)
    grid, shard, sizes = case_layout(shape, (1, 2, 3), grid_ndim, "zero")

    def fn(t):
        out, idx = F.max_pool2d(t, 3, 2, 1, ceil_mode=True, return_indices=True)
        return out + F.avg_pool2d(t, 2, 2, 1, True, False)[..., :4, :4].sum() \
            + F.adaptive_avg_pool2d(t, 1).sum(), idx
    check(fn, global_tensor(shape, seed=4), grid, shard, sizes)


# -- adaptive pooling -----------------------------------------------------------------------------
# (spatial shape, output size, dims to shard in order): along every sharded dim the
# output size is 1 or divides the size; unsharded dims may pool unevenly.
ADAPTIVE = [
    ((12,), 3, (2, 0)),
    ((12,), 1, (2, 0)),
    ((8, 6), (4, 3), (2, 3, 0)),
    ((8, 6), 1, (2, 3, 0)),
    ((8, 7), (2, 3), (2, 0)),
    ((8, 6), (1, None), (2, 3, 0)),
    ((8, 6, 5), (4, 1, 2), (2, 3, 0)),
    ((6, 6, 6), 1, (2, 3, 4)),
    ((4, 6, 4), (4, 2, 2), (4, 3, 2)),
]
ADAPTIVE_CASES = [(kind_, case, g, k)
                  for i, case in enumerate(ADAPTIVE) for kind_ in ("avg", "max")
                  for g, k in [(GRID_NDIMS[(i + j) % 3], KINDS[(i + 2 * j) % 4]) for j in (0, 1)]]


def reduces_a_sharded_dim(spatial, out, shard):
    nsp = len(spatial)
    out = out if isinstance(out, tuple) else (out,) * nsp
    return any(out[d - 2] == 1 and spatial[d - 2] > 1 for d in shard if d >= 2)


@pytest.mark.parametrize("pool,case,grid_ndim,kind", ADAPTIVE_CASES,
                         ids=lambda v: str(v).replace(" ", ""))
def test_adaptive(pool, case, grid_ndim, kind):
    spatial, out, shard_dims = case
    nsp = len(spatial)
    shape = (2, 2) + spatial
    grid, shard, sizes = case_layout(shape, shard_dims, grid_ndim, kind)
    dtype = DTYPES[(grid_ndim + len(kind)) % 2]
    if pool == "avg":
        def fn(t):
            return getattr(F, f"adaptive_avg_pool{nsp}d")(t, out), None
    else:
        indices = not reduces_a_sharded_dim(spatial, out, shard)

        def fn(t):
            r = getattr(F, f"adaptive_max_pool{nsp}d")(t, out, return_indices=indices)
            return r if indices else (r, None)
    check(fn, global_tensor(shape, dtype, seed=5), grid, shard, sizes)


@pytest.mark.parametrize("grid_ndim", (2, 3))
def test_adaptive_global_pool_is_replicated(grid_ndim):
    """Output size 1 along every sharded dim: a global reduction, no gather onto
    one rank; the result is replicated (a plain tensor, as for the reductions),
    or a DomainTensor when the batch dim stays sharded (3-D grid)."""
    shape = (2, 3, 6, 5)
    grid, shard, sizes = case_layout(shape, (2, 3, 0), grid_ndim, "uneven")
    x = shard_like(global_tensor(shape, seed=6), grid, shard, sizes)
    out = F.adaptive_avg_pool2d(x, 1)
    if 0 in shard:
        assert isinstance(out, dp.DomainTensor) and set(out._dec.shard) == {0}
    else:
        assert not isinstance(out, dp.DomainTensor) and out.shape == (2, 3, 1, 1)
    ref = F.adaptive_avg_pool2d(global_tensor(shape, seed=6), 1)
    full = out.full_tensor() if isinstance(out, dp.DomainTensor) else out
    torch.testing.assert_close(full, ref, rtol=1e-12, atol=1e-12)


# -- every spelling reaches the rule --------------------------------------------------------------
def test_spellings_reach_the_rule():
    """The inner callables of torch's boolean_dispatch wrappers and the torch.*
    builtins all run the domain-parallel rule (a missing one would raise, or
    gather, and differ in layout)."""
    shape = (2, 2, 9, 7)
    grid, shard, sizes = case_layout(shape, (2, 3), 2, "uneven")
    g = global_tensor(shape, seed=7)
    x = shard_like(g, grid, shard, sizes)
    nn_ = torch._C._nn
    ref, ref_idx = F.max_pool2d(g, 3, 2, 1, return_indices=True)
    for call in (lambda t: F.max_pool2d(t, 3, 2, 1),
                 lambda t: F._max_pool2d(t, 3, 2, 1),
                 lambda t: F.max_pool2d_with_indices(t, 3, 2, 1)[0],
                 lambda t: torch.max_pool2d(t, 3, 2, 1),
                 lambda t: nn_.max_pool2d_with_indices(t, 3, 2, 1)[0]):
        out = call(x)
        assert isinstance(out, dp.DomainTensor) and out._dec.shard == shard
        torch.testing.assert_close(out.full_tensor(), ref)
    for call in (lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True)[1],
                 lambda t: nn_.max_pool2d_with_indices(t, 3, 2, 1)[1]):
        assert torch.equal(call(x).full_tensor(), ref_idx)
    ref, ref_idx = F.adaptive_max_pool2d(g, (3, 7), return_indices=True)
    for call in (lambda t: F.adaptive_max_pool2d(t, (3, 7)),
                 lambda t: F._adaptive_max_pool2d(t, (3, 7)),
                 lambda t: F.adaptive_max_pool2d_with_indices(t, (3, 7))[0],
                 lambda t: nn_.adaptive_max_pool2d(t, (3, 7))[0]):
        torch.testing.assert_close(call(x).full_tensor(), ref)
    assert torch.equal(F.adaptive_max_pool2d(x, (3, 7), True)[1].full_tensor(), ref_idx)
    ref = F.adaptive_avg_pool2d(g, (3, 7))
    for call in (lambda t: F.adaptive_avg_pool2d(t, (3, None)),
                 lambda t: nn_.adaptive_avg_pool2d(t, (3, 7))):
        torch.testing.assert_close(call(x).full_tensor(), ref)


# -- refusals -------------------------------------------------------------------------------------
def test_refusals():
    shape = (2, 2, 7, 6)
    grid, shard, sizes = case_layout(shape, (2, 3), 2, "even")
    x = shard_like(global_tensor(shape, seed=8), grid, shard, sizes)
    # 3 does not divide 7 (dim 2 sharded): refused, naming the dim and the sizes
    raises_on_every_rank(dp.UnsupportedOpError, ["dim 2", "size 7", "output size 3"],
                         lambda: F.adaptive_avg_pool2d(x, (3, 3)))
    raises_on_every_rank(dp.UnsupportedOpError, ["dim 3", "size 6", "output size 4"],
                         lambda: F.adaptive_max_pool2d(x, (2, 4)))
    # output size 1 along a sharded dim is a reduction without indices
    raises_on_every_rank(dp.UnsupportedOpError, ["return_indices", "[2]"],
                         lambda: F.adaptive_max_pool2d(x, (1, 3), return_indices=True))
    raises_on_every_rank(dp.UnsupportedOpError, "return_indices",
                         lambda: nn.AdaptiveMaxPool2d(1, return_indices=True)(x))
    # torch's own errors for bad arguments, before any message (every rank alike)
    with pytest.raises(RuntimeError, match="pad should be at most half"):
        F.max_pool2d(x, 2, padding=2)
    with pytest.raises(TypeError):
        F.avg_pool2d(x, 2, bogus=1)
