"""The per-op plan cache (``domainpar.tensor.layout.planned``, DOMAINPAR_PLAN_CACHE):
a repeated call derives nothing (it hits), and results with the cache on equal
those with it off and those of one process, for calls whose layouts differ
only in what a plan's key must hold: block sizes (even, uneven, zero-size)
of operands of one global shape, grids, broadcast shapes, reduction dims and
keepdim. The MPI tests run on 1-4 ranks and 1-, 2- and 3-D grids."""
import sys

import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.bench import settings
from domainpar.ops import conv as conv_ops
from domainpar.ops import norm as norm_ops
from domainpar.tensor import layout as plans
from domainpar.testing import assert_matches_single_process, check_on_every_rank, shard_like
from tensor_cases import CASES, global_tensor, layout, sizes_for

SHAPE = (2, 3, 7, 6)      # N, C, H, W
SHARD_DIMS = (2, 3, 1)    # H on grid axis 0, W on axis 1, C on axis 2 (3-D grids)
FIELD = global_tensor((SHAPE[2], 1), seed=8)  # a plain (H, 1) tensor broadcast against x


@pytest.fixture(autouse=True)
def _restore_switch():
    """Each test leaves the plan cache switched as it found it."""
    was = plans.ENABLED
    yield
    plans.set_plan_cache(was)


def _other_sizes(grid, shard, kind):
    """Block sizes other than ``kind``'s for the sharded dims (None: balanced)."""
    other = "uneven" if kind != "uneven" else "zero"
    sizes = {d: sizes_for(SHAPE[d], grid.dims[a], other, seed=5) for d, a in shard.items()}
    return {d: s for d, s in sizes.items() if s is not None} or None


def _matches_cache_on_and_off(model, x, grid, shard, sizes, kind):
    """Collective. ``model`` on ``x`` cut at two boundaries (``sizes`` and another
    kind's), with the cache on, off and on again: one process's output and
    gradients each time."""
    for on in (True, False, True):
        plans.set_plan_cache(on)
        for cut in (sizes, _other_sizes(grid, shard, kind)):
            assert_matches_single_process(model, (x,), grid, shard, sizes=cut)


def mixed(a, b):
    """Elementwise ops whose output layout is a's, then b's (the operand of more
    dims leads, the first of equal ones), reductions over several dims with and
    without keepdim, a broadcast plain tensor and an in-place write."""
    field = FIELD.to(a.dtype)
    y = a + b * 2 - torch.tanh(a * b)          # a's layout, b repartitioned
    z = b - a + field                          # b's layout, a repartitioned
    y = y + y.mean(dim=2, keepdim=True) + y.sum(dim=(2, 3), keepdim=True)
    z = z * z.mean(dim=3, keepdim=True) - z.amax(dim=1, keepdim=True)
    y.add_(z)                                  # in place on a's layout
    s = y.sum(dim=2) + z.sum(dim=2)            # keepdim=False: 3-D results
    return y * 0.5 + z.mean() + s.sum(dim=-1, keepdim=True).unsqueeze(-1)


@pytest.mark.mpi
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_cache_on_and_off_match_one_process(grid_ndim, kind):
    """Operands of one global shape cut at other boundaries: a plan made for one
    pair of layouts never serves the other (the keys hold the block sizes)."""
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, grid_ndim, kind)
    a, b = global_tensor(SHAPE, seed=1), global_tensor(SHAPE, seed=2)
    for on in (True, False):
        plans.set_plan_cache(on)
        assert_matches_single_process(mixed, (a, b), grid, [shard, shard],
                                      sizes=[sizes, _other_sizes(grid, shard, kind)])
        assert_matches_single_process(mixed, (a, b), grid, [shard, shard],
                                      sizes=[_other_sizes(grid, shard, kind), sizes])


def _run(fn, a, b, grid, shard, sizes_a, sizes_b):
    """``fn``'s output block and the inputs' gradient blocks, on this rank."""
    x, y = (dp.DomainTensor(t[dec.local_slices()].clone().requires_grad_(), dec)
            for t, dec in ((a, dp.Decomposition(SHAPE, grid, shard, sizes_a)),
                           (b, dp.Decomposition(SHAPE, grid, shard, sizes_b))))
    out = fn(x, y)
    out.sum().backward()
    return [out.to_local().detach(), x.grad.to_local(), y.grad.to_local()]


@pytest.mark.mpi
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_second_call_hits_and_gives_the_same_bits(grid_ndim, kind):
    """A repeated step makes no plan (misses stay, hits grow) and its blocks are
    bitwise those of the first step and of a step with the cache off."""
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, grid_ndim, kind)
    _check_hits(mixed, grid, shard, sizes, _other_sizes(grid, shard, kind), seeds=(3, 4))


def _check_hits(fn, grid, shard, sizes, other, seeds):
    """Collective. Two steps of ``fn`` with the cache on, one with it off: the
    second makes no plan and finds every one, and all three give the same bits."""
    a, b = global_tensor(SHAPE, seed=seeds[0]), global_tensor(SHAPE, seed=seeds[1])
    plans.set_plan_cache(True)
    plans.clear_plan_cache()
    first = _run(fn, a, b, grid, shard, sizes, other)
    made = plans.plan_cache_stats()
    second = _run(fn, a, b, grid, shard, sizes, other)
    again = plans.plan_cache_stats()
    plans.set_plan_cache(False)
    off = _run(fn, a, b, grid, shard, sizes, other)
    check_on_every_rank(made["misses"] > 0 and made["size"] > 0, "the first step makes plans")
    check_on_every_rank(again["misses"] == made["misses"], f"a repeated step makes no plan: "
                        f"{made} then {again}")
    check_on_every_rank(again["hits"] - made["hits"] >= made["misses"],
                        f"a repeated step finds every plan: {made} then {again}")
    check_on_every_rank(plans.plan_cache_stats() == {**again, "enabled": 0},
                        "with the cache off nothing counts")
    same = all(torch.equal(p, q) and torch.equal(p, r) for p, q, r in zip(first, second, off))
    check_on_every_rank(same, "cache on (made, then hit) and off give the same blocks")


@pytest.mark.mpi
def test_grids_of_one_shape_do_not_share_plans():
    """One global shape and shard map on two grids of the same processes (1-D and
    2-D): the derived layouts differ by grid, and each op's results are one
    process's."""
    a, b = global_tensor(SHAPE, seed=5), global_tensor(SHAPE, seed=6)
    plans.set_plan_cache(True)
    for grid_ndim in (1, 2, 1):  # the 1-D grid again: it finds its own plans
        grid, shard, sizes = layout(SHAPE, SHARD_DIMS, grid_ndim, "uneven")
        assert_matches_single_process(mixed, (a, b), grid, [shard, shard],
                                      sizes=[sizes, _other_sizes(grid, shard, "uneven")])


def test_derive_shares_equal_requests_only():
    """Local. Equal requests share one Decomposition with the cache on; shape,
    grid, shard map and sizes each give another one; off, each call makes its own."""
    g1, g2 = (dp.ProcessGrid(d, comm=MPI.COMM_SELF) for d in ((1,), (1, 1)))
    like = dp.Decomposition((4, 5), g1, {0: 0}, check=False)
    plans.set_plan_cache(True)
    one = plans.derive(like, (4, 5), {0: 0}, {0: [4]})
    assert plans.derive(like, (4, 5), {0: 0}, {0: (4,)}) is one
    others = [plans.derive(like, (4, 6), {0: 0}), plans.derive(like, (4, 5), {0: 0}, grid=g2),
              plans.derive(like, (4, 5), {1: 0}), plans.derive(like, (4, 5), {})]
    assert all(o is not one and o != one for o in others)
    assert [o.global_shape for o in others] == [(4, 6), (4, 5), (4, 5), (4, 5)]
    assert others[1].grid is g2 and others[2].shard == {1: 0} and others[3].shard == {}
    plans.set_plan_cache(False)
    fresh = plans.derive(like, (4, 5), {0: 0}, {0: [4]})
    assert fresh is not one and fresh == one


def test_switch_and_compare_setting():
    """Local. ``bench ... --compare DOMAINPAR_PLAN_CACHE=0`` switches the cache off
    inside its samples only; off, calls neither make nor find plans."""
    plans.set_plan_cache(True)
    grid = dp.ProcessGrid((1,), comm=MPI.COMM_SELF)
    x = dp.DomainTensor(torch.ones(2, 3), dp.Decomposition((2, 3), grid, {1: 0}, check=False))
    x + 1
    with settings.applied({"DOMAINPAR_PLAN_CACHE": "0"}):
        assert not plans.ENABLED
        before = plans.plan_cache_stats()
        assert torch.equal((x + 1).to_local(), torch.full((2, 3), 2.0))
        assert plans.plan_cache_stats() == before
    assert plans.ENABLED
    hits = plans.plan_cache_stats()["hits"]
    x + 1
    assert plans.plan_cache_stats()["hits"] > hits


# -- convs and norms -----------------------------------------------------------------------------
CONV_SHARD_DIMS = (2, 3, 0)  # H, W and (3-D grids) N: a conv needs whole channels


class ConvNorm(torch.nn.Module):
    """Convs and norms whose plans differ only in what the key must hold: stride 1
    and 2, padding (ints, 'same' with an even kernel), dilation, groups, a
    transposed conv with output_padding, GroupNorm with 1 and 3 groups."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)  # the same parameters on every rank
        c = SHAPE[1]
        self.plain = torch.nn.Conv2d(c, c, 3, padding=1, dtype=torch.float64)
        self.strided = torch.nn.Conv2d(c, c, 3, stride=2, padding=1, dtype=torch.float64)
        self.dilated = torch.nn.Conv2d(c, c, 3, padding=2, dilation=2, dtype=torch.float64)
        self.grouped = torch.nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False,
                                       dtype=torch.float64)
        self.same = torch.nn.Conv2d(c, c, (3, 2), padding="same", dtype=torch.float64)
        self.up = torch.nn.ConvTranspose2d(c, c, 3, stride=2, padding=1, output_padding=(0, 1),
                                           dtype=torch.float64)
        self.one_group = torch.nn.GroupNorm(1, c, dtype=torch.float64)
        self.per_channel = torch.nn.GroupNorm(c, c, affine=False, dtype=torch.float64)

    def forward(self, x):
        y = self.one_group(self.plain(x))
        z = self.strided(x)                     # another layout: blocks of ceil(offset / 2)
        y = y + self.dilated(y) + self.per_channel(self.grouped(y)) + self.same(x)
        return y + self.up(torch.tanh(z))       # back to x's shape, repartitioned


@pytest.mark.mpi
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_convs_and_norms_cache_on_and_off_match_one_process(grid_ndim, kind):
    """One model on inputs of one global shape cut at other boundaries, with the
    cache on and off: each gives one process's output and gradients."""
    grid, shard, sizes = layout(SHAPE, CONV_SHARD_DIMS, grid_ndim, kind)
    x = global_tensor(SHAPE, seed=9)
    model = ConvNorm()
    _matches_cache_on_and_off(model, x, grid, shard, sizes, kind)


@pytest.mark.mpi
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_repeated_conv_norm_step_hits(grid_ndim, kind, monkeypatch):
    """A repeated step of convs and norms on two layouts derives no conv or group
    norm plan again (their makers are not called) and gives the same bits as
    the first step and as a step with the cache off."""
    grid, shard, sizes = layout(SHAPE, CONV_SHARD_DIMS, grid_ndim, kind)
    model = ConvNorm()
    made = {"conv": 0, "group": 0}
    for name, attr in (("conv", "_conv_plan"), ("group", "_group_plan")):
        module = conv_ops if name == "conv" else norm_ops
        real = getattr(module, attr)
        monkeypatch.setattr(module, attr, _counting(real, made, name))
    plans.set_plan_cache(True)
    plans.clear_plan_cache()
    _run(lambda x, y: model(x) * model(y), global_tensor(SHAPE, seed=12),
         global_tensor(SHAPE, seed=13), grid, shard, sizes, _other_sizes(grid, shard, kind))
    first = dict(made)
    _check_hits(lambda x, y: model(x) * model(y), grid, shard, sizes,
                _other_sizes(grid, shard, kind), seeds=(12, 13))
    check_on_every_rank(first["conv"] > 0 and first["group"] > 0, f"plans made: {first}")
    # _check_hits empties the cache: its first step makes them again, its second
    # none, its uncached step one per call. On one rank both cuts are the same
    # layout, so the first steps plan one layout and the uncached step both.
    calls = 2 if grid.comm.Get_size() == 1 else 1
    check_on_every_rank(made == {k: (2 + calls) * v for k, v in first.items()},
                        f"only the uncached step makes plans again: {first} then {made}")


def _counting(real, made, name):
    def counted(*args):
        made[name] += 1
        return real(*args)
    return counted


class _UpTo(torch.nn.Module):
    """A transposed conv given ``output_size`` (torch then passes ``output_padding``
    as a list)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(12)  # the same parameters on every rank
        self.up = torch.nn.ConvTranspose2d(SHAPE[1], 2, 3, stride=2, padding=1,
                                           dtype=torch.float64)

    def forward(self, x):
        return self.up(x, output_size=(2 * SHAPE[2], 2 * SHAPE[3] - 1))


@pytest.mark.mpi
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_a_transposed_conv_given_output_size_plans_once(grid_ndim, kind, monkeypatch):
    """nn.ConvTranspose given ``output_size`` passes ``output_padding`` as a list:
    the plan's key holds it as a tuple, so the second call on a layout derives
    nothing (it once made the plan afresh on every call); the result is one
    process's."""
    from domainpar.ops import conv_transpose as conv_transpose_ops
    grid, shard, sizes = layout(SHAPE, CONV_SHARD_DIMS, grid_ndim, kind)
    made = {"transposed": 0}
    monkeypatch.setattr(conv_transpose_ops, "_transposed_plan",
                        _counting(conv_transpose_ops._transposed_plan, made, "transposed"))
    plans.set_plan_cache(True)
    plans.clear_plan_cache()
    model = _UpTo()
    x = global_tensor(SHAPE, seed=14)
    assert_matches_single_process(model, (x,), grid, shard, sizes=sizes)
    first = made["transposed"]
    model(shard_like(x, grid, shard, sizes))
    check_on_every_rank(first >= 1 and made["transposed"] == first,
                        f"plans made: {first} on the first calls, {made['transposed']} after")


def _pools(x):
    """Max and avg pools whose windows cross block boundaries (ceil_mode reaches
    past the padding), on one output layout."""
    return (torch.nn.functional.max_pool2d(x, 3, 2, 1, ceil_mode=True) * 2
            + torch.nn.functional.avg_pool2d(x, 3, 2, 1, ceil_mode=True,
                                             count_include_pad=False))


@pytest.mark.mpi
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_pools_plan_once_and_make_indices_global_only_when_asked(grid_ndim, kind, monkeypatch):
    """A max or avg pool derives its window plans once per layout (the second call
    slides no window); a max pool whose indices nobody asked for never turns
    them into global ones (that once cost more than the pool itself). Cache on
    and off, on two cuts: one process's output and gradients."""
    from domainpar.ops import pool as pool_ops
    from domainpar.ops import window
    grid, shard, sizes = layout(SHAPE, CONV_SHARD_DIMS, grid_ndim, kind)
    made = {"sliding": 0, "global_index": 0}
    monkeypatch.setattr(window, "sliding", _counting(window.sliding, made, "sliding"))
    monkeypatch.setattr(pool_ops, "global_flat_index",
                        _counting(pool_ops.global_flat_index, made, "global_index"))
    x = global_tensor(SHAPE, seed=15)
    _matches_cache_on_and_off(_pools, x, grid, shard, sizes, kind)
    plans.clear_plan_cache()
    before = made["sliding"]
    _pools(shard_like(x, grid, shard, sizes))
    first = made["sliding"] - before
    _pools(shard_like(x, grid, shard, sizes))
    again = made["sliding"] - before - first
    check_on_every_rank(first > 0 and again == 0 and made["global_index"] == 0,
                        f"windows slid: {first} by the first call, {again} by the call "
                        f"after; global indices made {made['global_index']} times")


class _Products(torch.nn.Module):
    """Contractions of every kind the einsum rule plans (a plain weight cut to the
    block or broadcast, a sharded label summed over, two labels on one grid axis:
    an operand gathered) and a spectral conv (FFTs, a slice of a spectrum in
    transit, zero pads): each derives its plan, or asks torch's meta kernels,
    once per layout."""

    def __init__(self):
        super().__init__()
        from domainpar.testing.models import SpectralConv2d
        torch.manual_seed(16)  # the same parameters on every rank
        self.spectral = SpectralConv2d(SHAPE[1], SHAPE[1], modes=2).double()
        self.mix = torch.nn.Parameter(torch.randn(SHAPE[1], SHAPE[1], dtype=torch.float64))
        self.rows = torch.nn.Parameter(torch.randn(SHAPE[2], dtype=torch.float64))

    def forward(self, x):
        y = torch.einsum("nchw,cd->ndhw", x, self.mix)          # plain weight, broadcast
        y = y + torch.einsum("nchw,h->nchw", x, self.rows)      # plain weight, cut along h
        s = torch.einsum("nchw,nchw->nc", x, y)                 # sharded labels summed
        scores = torch.einsum("nchw,ncgw->nchg", x, y)          # h and g on one axis
        cut = x[:, 0, None, 1:, ::2].sum() + x[..., None, :, :].sum(dim=1)  # basic slicing
        return self.spectral(y) * s[..., None, None] + scores.sum(dim=-1, keepdim=True) + cut


@pytest.mark.mpi
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_contractions_and_spectra_plan_once(grid_ndim, kind, monkeypatch):
    """An einsum makes its plan (torch's meta einsum twice, the labels' layouts, the
    gathers) once per equation and operand layouts, a basic slice walks its index
    once per layout, and an FFT or a pad runs torch's meta check once per layout:
    after the cache is emptied, the first call of the model makes plans and the
    second makes no contraction or slicing plan and no meta tensor for torch's
    checks. Cache on and off, two cuts: one process's output and gradients."""
    from domainpar.ops import einsum as einsum_ops
    from domainpar.ops import index as index_ops
    grid, shard, sizes = layout(SHAPE, CONV_SHARD_DIMS, grid_ndim, kind)
    made = {"contract": 0, "slicing": 0}
    monkeypatch.setattr(einsum_ops, "_contract_plan",
                        _counting(einsum_ops._contract_plan, made, "contract"))
    monkeypatch.setattr(index_ops, "_slicing_plan",
                        _counting(index_ops._slicing_plan, made, "slicing"))
    model = _Products()
    x = global_tensor(SHAPE, seed=17)
    _matches_cache_on_and_off(model, x, grid, shard, sizes, kind)
    plans.clear_plan_cache()
    before = dict(made)
    model(shard_like(x, grid, shard, sizes))
    first, sliced = (made[k] - before[k] for k in ("contract", "slicing"))
    before = dict(made)
    # Meta tensors for torch's checks are made by torch.empty; those of
    # ``common.stand_in`` only key ``meta_call``'s cache (no kernel runs on a hit).
    empty = torch.empty

    def counting_empty(*args, **kwargs):
        if str(kwargs.get("device")) == "meta" and sys._getframe(1).f_code.co_name != "stand_in":
            made["meta"] = made.get("meta", 0) + 1
        return empty(*args, **kwargs)
    monkeypatch.setattr(torch, "empty", counting_empty)
    model(shard_like(x, grid, shard, sizes))
    monkeypatch.setattr(torch, "empty", empty)
    again, sliced_again = (made[k] - before[k] for k in ("contract", "slicing"))
    metas = made.get("meta", 0)
    check_on_every_rank(first >= 4 and again == 0 and sliced >= 2 and sliced_again == 0
                        and metas == 0,
                        f"contraction plans: {first} by the first call, {again} by the call "
                        f"after; slicing plans: {sliced}, then {sliced_again}; meta tensors "
                        f"made for torch's checks by the call after: {metas}")
