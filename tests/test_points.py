"""dp.points against one process in float64: the routed exchange (dot-product
adjoint tests), the RCB partition (balance, regions, capacities, round trip),
knn and radius search (indices, distances, gradients; uniform and clustered
clouds, exact duplicates, ranks with no points), and the index ops on a
sharded point dim (index_select, gather, x[idx], index_add, scatter_add,
scatter_reduce, cdist), on 1..4 ranks and 1-, 2- and 3-D grids."""
import pytest
import torch

import domainpar as dp
from domainpar.points import route as rt
from domainpar.tensor.domain_tensor import DomainTensor
from domainpar.tensor.layout import derive
from domainpar.testing import adjoint_test, assert_matches_single_process, raises_on_every_rank
from test_points_cases import (
    F64,
    LAYOUT_IDS,
    LAYOUTS,
    cloud,
    grids,
    knn_oracle,
    layout,
    radius_oracle,
    safe_sqrt,
    sharded,
)

pytestmark = pytest.mark.mpi
KINDS = ("uniform", "clustered")


def _close(a, b, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.allclose(a, b, rtol=1e-10, atol=1e-12, equal_nan=True), (what, (a - b).abs().max())


# -- the routed exchange ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", LAYOUTS, ids=LAYOUT_IDS)
def test_push_pull_and_fetch_are_adjoint(case):
    x = sharded(torch.randn(23, 4, dtype=F64), case)
    dec = x.decomposition
    comm = dec.grid.axis_comm(dec.shard[0])
    g = torch.Generator().manual_seed(comm.Get_rank())
    n = x.to_local().shape[0]
    dest = torch.randint(0, comm.Get_size(), (n,), generator=g)
    route = rt.Route(comm, dest, torch.arange(n))
    adjoint_test(lambda v: rt.push(v.to_local(), route), x, y_space=comm)
    back = rt.push(x.to_local(), route).detach()
    adjoint_test(lambda v: rt.pull(v, route), back, x_space=comm, y_space=comm)
    index = torch.randint(0, 23, (7, 3), generator=g)  # repeats: adjoint adds them up
    offs = dec.block_offsets(0)
    adjoint_test(lambda v: rt.fetch(v.to_local(), comm, offs, index), x, y_space=comm)


# -- partition -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", LAYOUTS, ids=LAYOUT_IDS)
def test_partition_balances_and_round_trips(case, kind):
    pts = cloud(41, kind)
    x = sharded(pts, case)
    part = dp.points.partition(x)
    sizes = part.sizes
    assert sum(sizes) == 41 and max(sizes) - min(sizes) <= 1, sizes
    local = part.points.to_local()
    me = part.dst.grid.coords[part.dst.shard[0]]
    box = part.regions[me]
    assert bool(((local >= box[0]) & (local <= box[1])).all())
    order = part.global_index.full_tensor()
    assert sorted(order.tolist()) == list(range(41))
    assert torch.equal(part.points.full_tensor(), pts[order])
    feats = sharded(torch.randn(41, 2, 3, dtype=F64), case, requires_grad=True)
    moved = part.apply(feats)
    assert torch.equal(moved.full_tensor(), feats.full_tensor()[order])
    assert torch.equal(part.inverse(moved).full_tensor(), feats.full_tensor())
    adjoint_test(part.apply, feats.detach())
    adjoint_test(part.inverse, moved.detach())
    other = part.assign(sharded(cloud(29, kind, seed=9), case))  # queries into the regions
    mine = other.points.to_local()
    covered = ((mine >= part.regions[:, 0].min(0).values) &
               (mine <= part.regions[:, 1].max(0).values)).all(1)  # the regions tile this box
    inside = ((mine >= box[0]) & (mine <= box[1])).all(1)
    assert sum(other.sizes) == 29 and bool(inside[covered].all())


@pytest.mark.parametrize("case", LAYOUTS[:2], ids=LAYOUT_IDS[:2])
def test_partition_capacity_and_empty_ranks(case):
    grid, _, _ = layout(case, 30)
    p = grid.size
    cap = [0.0] + [3.0] * (p - 1) if p > 1 else [1.0]
    part = dp.points.partition(sharded(cloud(30, "clustered"), case), capacity=cap)
    if p > 1:
        assert part.sizes[0] == 0 and sum(part.sizes) == 30
        assert max(part.sizes[1:]) - min(part.sizes[1:]) <= 1
    few = dp.points.partition(sharded(cloud(2, "uniform"), case))  # fewer points than ranks
    assert max(few.sizes) == (2 if p == 1 else 1) and sum(few.sizes) == 2
    raises_on_every_rank(dp.LayoutError, ["capacity"],
                         lambda: dp.points.partition(sharded(cloud(8, "uniform"), case),
                                                     capacity=[1.0] * (p + 1)))
    bad = cloud(8, "uniform")
    bad[3, 1] = float("nan")
    raises_on_every_rank(dp.LayoutError, ["NaN"],
                         lambda: dp.points.partition(sharded(bad, case)))


# -- neighbour search ------------------------------------------------------------------------------
def _searched(case, kind, partitioned):
    refs, queries = cloud(37, kind, seed=1), cloud(19, kind, seed=2)
    ref = sharded(refs, case, requires_grad=True)
    q = sharded(queries, case, requires_grad=True, seed=5)
    if partitioned:  # queries laid out by the references' regions (small halos)
        part = dp.points.partition(ref)
        ref_in, refs = part.points, part.points.full_tensor().detach()
        q = part.assign(q).points
        queries = q.full_tensor().detach()
    else:
        ref_in = ref
    return q, ref_in, queries, refs


@pytest.mark.parametrize("partitioned", [True, False], ids=["rcb", "as-given"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", LAYOUTS, ids=LAYOUT_IDS)
def test_knn_matches_one_process(case, kind, partitioned):
    q, ref, queries, refs = _searched(case, kind, partitioned)
    for k in (1, 4, 37):
        idx, dist = dp.points.knn(q, ref, k)
        want_idx, want_dist = knn_oracle(queries, refs, k)
        assert torch.equal(idx.full_tensor(), want_idx), k
        _close(dist.full_tensor(), want_dist, f"knn distances k={k}")
    _check_grads(q, ref, queries, refs, lambda a, b: dp.points.knn(a, b, 4)[1],
                 lambda a, b: _knn_dist(a, b, 4))


def _knn_dist(a, b, k):
    idx, _ = knn_oracle(a.detach(), b.detach(), k)
    diff = a[:, None, :] - b[idx]
    return safe_sqrt(diff[..., 0] ** 2 + diff[..., 1] ** 2 + diff[..., 2] ** 2)


def _check_grads(q, ref, queries, refs, sharded_fn, oracle_fn):
    w = torch.randn(queries.shape[0], 4, generator=torch.Generator().manual_seed(3), dtype=F64)
    ref_leaf = ref if ref.to_local().is_leaf else None
    out = sharded_fn(q, ref)
    wl = w[out.decomposition.local_slices()]
    local = out.to_local()
    loss = torch.where(torch.isfinite(local), local, torch.zeros_like(local)) * wl
    leaves = [q.to_local()] + ([ref.to_local()] if ref_leaf is not None else [])
    grads = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)  # a rank may hold none
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    qa = queries.clone().requires_grad_(True)
    ra = refs.clone().requires_grad_(True)
    want = oracle_fn(qa, ra)
    want = torch.where(torch.isfinite(want), want, torch.zeros_like(want))
    gq, gr = torch.autograd.grad((want * w).sum(), [qa, ra])
    _close(DomainTensor(grads[0], q.decomposition).full_tensor(), gq, "query gradient")
    if ref_leaf is not None:
        _close(DomainTensor(grads[1], ref.decomposition).full_tensor(), gr, "ref gradient")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", LAYOUTS, ids=LAYOUT_IDS)
def test_radius_search_and_neighbour_gather(case, kind):
    q, ref, queries, refs = _searched(case, kind, partitioned=True)
    feats_full = torch.randn(37, 5, dtype=F64, generator=torch.Generator().manual_seed(4))
    for radius, m in ((0.0, 2), (0.02, 4), (0.3, 6), (5.0, 40)):
        idx, dist = dp.points.radius_search(q, ref, radius, m)
        want_idx, want_dist = radius_oracle(queries, refs, radius, m)
        assert torch.equal(idx.full_tensor(), want_idx), radius
        _close(dist.full_tensor(), want_dist, f"radius distances r={radius}")
    rdec = ref.decomposition
    fdec = derive(rdec, (37, 5), rdec.shard, {0: rdec.block_sizes(0)})
    feats = DomainTensor(feats_full[fdec.local_slices()].clone().requires_grad_(True), fdec)
    idx, _ = dp.points.radius_search(q, ref, 0.3, 4)
    got = dp.points.gather(feats, idx)
    want_idx = idx.full_tensor()
    fa = feats_full.clone().requires_grad_(True)
    want = fa[want_idx.clamp(min=0)] * (want_idx >= 0)[..., None]
    _close(got.full_tensor(), want.detach(), "gathered features")
    w = torch.randn(want.shape, dtype=F64, generator=torch.Generator().manual_seed(6))
    (got.to_local() * w[got.decomposition.local_slices()]).sum().backward()
    (gf,) = torch.autograd.grad((want * w).sum(), [fa])
    _close(DomainTensor(feats.to_local().grad, feats.decomposition).full_tensor(), gf,
           "gathered features' gradient")


def test_search_errors_on_every_rank():
    _, grid, shard = grids()[0]
    ref = dp.scatter(cloud(10, "uniform"), grid, shard=shard)
    q = dp.scatter(cloud(5, "uniform", 1), grid, shard=shard)
    raises_on_every_rank(ValueError, ["k must be"], lambda: dp.points.knn(q, ref, 11))
    raises_on_every_rank(ValueError, ["max_neighbors"],
                         lambda: dp.points.radius_search(q, ref, 0.1, 0))
    raises_on_every_rank(dp.UnsupportedOpError, ["DomainTensor of points"],
                         lambda: dp.points.knn(q.full_tensor(), ref, 2))


# -- index ops on a sharded point dim -------------------------------------------------------------
def _idx(n, shape, seed):
    return torch.randint(0, n, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", LAYOUTS, ids=LAYOUT_IDS)
def test_gathers_match_one_process(case):
    grid, shard, sizes = layout(case, 17)
    x = torch.randn(17, 3, 2, dtype=F64)
    ix = _idx(17, (11,), 1)
    ix2 = _idx(17, (9, 4), 2) - 8  # negatives wrap in x[idx]
    g = _idx(17, (10, 3, 2), 3)
    run = lambda fn, *ins, sh=None: assert_matches_single_process(  # noqa: E731
        fn, (x,) + ins, grid, [shard] * (1 + len(ins)) if sh is None else sh,
        sizes=[sizes] + [None] * len(ins))
    run(lambda a, i: a.index_select(0, i), ix)
    run(lambda a, i: torch.index_select(a, 0, i), ix, sh=[shard, None])  # plain index
    run(lambda a, i: a[i], ix2)
    run(lambda a, i: a.movedim(0, 1)[:, i], ix2)  # the point dim second
    run(lambda a, i: torch.gather(a, 0, i), g)
    run(lambda a, i: a.gather(0, i[:, :2, :1]), g)  # smaller than input off the dim


@pytest.mark.parametrize("case", LAYOUTS, ids=LAYOUT_IDS)
def test_scatters_match_one_process(case):
    grid, shard, sizes = layout(case, 13)
    x = torch.randn(13, 3, dtype=F64)
    src = torch.randn(20, 3, dtype=F64)
    i1 = _idx(13, (20,), 4)
    ie = _idx(13, (20, 3), 5)
    src[5] = src[2]  # ties for amax
    ie[5] = ie[2]
    run = lambda fn, *ins: assert_matches_single_process(  # noqa: E731
        fn, (x,) + ins, grid, [shard] * (1 + len(ins)), sizes=[sizes] + [None] * len(ins))
    run(lambda a, i, s: a.index_add(0, i, s, alpha=0.5), i1, src)
    run(lambda a, i, s: torch.scatter_add(a, 0, i, s), ie, src)
    for reduce in ("sum", "mean", "amax", "amin", "prod"):
        for include_self in (True, False):
            run(lambda a, i, s, r=reduce, inc=include_self: a.scatter_reduce(
                0, i, s, r, include_self=inc), ie, src)
    run(lambda a, i, s: (a * 1).index_add_(0, i, s), i1, src)
    run(lambda a, i, s: (a * 1).scatter_add_(0, i, s), ie, src)
    c = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(7)).requires_grad_()
    assert_matches_single_process(lambda a: torch.cdist(a, c), (x,), grid, shard, sizes=sizes)


def test_index_op_refusals_on_every_rank():
    _, grid, shard = grids()[0]
    x = dp.scatter(torch.randn(9, 2, dtype=F64), grid, shard=shard)
    i = dp.scatter(torch.tensor([0, 9, 1]), grid, shard=shard)
    raises_on_every_rank(dp.LayoutError, ["index out of range"], lambda: x.index_select(0, i))
    raises_on_every_rank(dp.UnsupportedOpError, ["torch.cdist", "knn"],
                         lambda: torch.cdist(x.full_tensor(), x))
    c = torch.randn(2, 4, 2, dtype=F64)  # batch dim 2 would broadcast x's missing one
    raises_on_every_rank(dp.UnsupportedOpError, ["torch.cdist", "broadcast"],
                         lambda: torch.cdist(x, c))
    m = dp.scatter(torch.ones(9, dtype=torch.bool), grid, shard=shard)
    raises_on_every_rank(dp.UnsupportedOpError, ["Tensor.__getitem__"], lambda: x[m])
