"""NaN and +-inf through reductions across ranks (issue 17, item 2).

MPI's MAX/MIN drop NaN by the order they meet it, so every reduction that
combines per-rank extrema must carry NaN itself. Here NaN (or +-inf, or ties)
sits on rank 0's block, on the last rank's, on several ranks', everywhere, or
fills whole rows, on even, uneven and empty-block layouts of 1-, 2- and 3-D
grids; values, indices (first NaN, first of tied maxima, as torch on this
version) and input gradients must equal one process's, NaN for NaN."""
import math

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import domainpar as dp
from domainpar.testing import shard_like
from tensor_cases import CASES, global_tensor, layout

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD

SHAPE = (2, 3, 8, 6)      # N, C, H, W
SHARD_DIMS = (2, 3, 1)    # H on grid axis 0, W on axis 1, C on axis 2
NAN, INF = math.nan, math.inf


def _ranks(which: str) -> list[int]:
    n = COMM.Get_size()
    return {"rank0": [0], "last": [n - 1], "several": sorted({0, n // 2, n - 1})}[which]


def _marked(t: torch.Tensor, dec, ranks, value, seed: int) -> torch.Tensor:
    """``t`` with ``value`` at a random quarter of the cells of ``ranks``' blocks."""
    inside = torch.zeros(t.shape, dtype=torch.bool)
    for r in ranks:
        inside[dec.local_slices(r)] = True
    hit = torch.rand(t.shape, generator=torch.Generator().manual_seed(seed)) < 0.25
    out = t.clone()
    out[inside & hit] = value
    return out


def scenario(name: str, dec) -> torch.Tensor:
    """The global input of one scenario (the same on every rank)."""
    t = global_tensor(SHAPE, seed=11)
    ties = torch.round(t * 1.5)          # small integers: ties within and across blocks
    if name in ("rank0", "last", "several"):
        return _marked(t, dec, _ranks(name), NAN, seed=12)
    if name == "all_nan":
        return torch.full(SHAPE, NAN, dtype=torch.float64)
    if name == "ties":
        return ties
    if name == "ties_nan":
        return _marked(ties, dec, _ranks("several"), NAN, seed=13)
    if name == "inf":   # +inf on rank 0 and the middle, -inf on the last: ties of inf
        t = _marked(t, dec, _ranks("rank0") + [COMM.Get_size() // 2], INF, seed=14)
        return _marked(t, dec, _ranks("last"), -INF, seed=15)
    if name == "rows":  # whole rows (every reduction slab) of -inf, +inf and NaN
        t = t.clone()
        t[0, 1] = -INF
        t[1, 2, :, 0] = INF
        t[1, 0, 3, :] = -INF
        t[0, 2, :, 4] = NAN
        return t
    raise ValueError(name)


SCENARIOS = ["rank0", "last", "several", "all_nan", "ties", "ties_nan", "inf", "rows"]
DIMS = [2, 3, 0, 1, -1]


def ops():
    """(name, f, exact): every reduction that combines extrema across ranks."""
    out = [("max()", lambda x: x.max(), True), ("min()", lambda x: torch.min(x), True),
           ("amax()", lambda x: x.amax(), True), ("amin()", lambda x: torch.amin(x), True),
           ("norm(inf)", lambda x: x.norm(p=INF), True),
           ("vector_norm(-inf)", lambda x: torch.linalg.vector_norm(x, -INF), True),
           ("argmax()", lambda x: x.argmax(), True), ("argmin()", lambda x: torch.argmin(x), True),
           ("amax(H,W)", lambda x: x.amax(dim=(2, 3)), True),
           ("amin(C,W)", lambda x: x.amin(dim=(1, 3), keepdim=True), True),
           ("adaptive_max_pool(1,1)", lambda x: F.adaptive_max_pool2d(x, 1), True),
           ("adaptive_max_pool(1,2)", lambda x: F.adaptive_max_pool2d(x, (1, 2)), True)]
    for d in DIMS:
        out += [(f"max({d})", lambda x, d=d: x.max(d), True),
                (f"min({d},keepdim)", lambda x, d=d: torch.min(x, d, keepdim=True), True),
                (f"amax({d})", lambda x, d=d: x.amax(d), True),
                (f"argmax({d})", lambda x, d=d: x.argmax(d), True),
                (f"argmin({d},keepdim)", lambda x, d=d: torch.argmin(x, d, keepdim=True), True),
                (f"norm(inf,{d})", lambda x, d=d: x.norm(p=INF, dim=d), True),
                (f"logsumexp({d})", lambda x, d=d: torch.logsumexp(x, d), False),
                (f"softmax({d})", lambda x, d=d: torch.softmax(x, d), False),
                (f"log_softmax({d})", lambda x, d=d: F.log_softmax(x, d), False)]
    return out


def _full(v):
    return v.full_tensor() if isinstance(v, dp.DomainTensor) else v


def _outputs(v) -> list[torch.Tensor]:
    return [_full(o) for o in (v if isinstance(v, tuple) else (v,))]


def _differs(got: torch.Tensor, want: torch.Tensor, exact: bool) -> str | None:
    """What differs between ``got`` and ``want`` (NaN equals NaN; inf must match), or None."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    tol = dict(rtol=0, atol=0) if exact or not want.is_floating_point() else \
        dict(rtol=1e-10, atol=1e-12)
    try:
        torch.testing.assert_close(got.detach(), want.detach(), equal_nan=True, **tol)
    except AssertionError as exc:
        return str(exc).splitlines()[0] + f" got {got.flatten()[:8].tolist()} " \
            f"want {want.flatten()[:8].tolist()}"
    return None


def _check_op(f, t, grid, shard, sizes, exact) -> list[str]:
    """Values, indices and the input gradient of ``f`` sharded against one process."""
    ref_in = t.clone().requires_grad_(True)
    x = shard_like(t, grid, shard, sizes, requires_grad=True)
    try:
        want, got = _outputs(f(ref_in)), _outputs(f(x))
    except dp.UnsupportedOpError as exc:
        return [f"refused: {exc}"]
    problems = [f"output {i}: {p}" for i, (g, w) in enumerate(zip(got, want))
                if (p := _differs(g, w, exact))]
    floats = [i for i, w in enumerate(want) if w.is_floating_point()]
    if floats:
        gen = torch.Generator().manual_seed(5)
        weights = [torch.randn(want[i].shape, generator=gen, dtype=torch.float64) for i in floats]
        sum((want[i] * w).sum() for i, w in zip(floats, weights)).backward()
        sharded = f(x)
        sharded = sharded if isinstance(sharded, tuple) else (sharded,)
        sum((sharded[i] * w).sum() for i, w in zip(floats, weights)).backward()
        if (p := _differs(_full(x.grad), ref_in.grad, exact=False)):
            problems.append(f"input gradient: {p}")
    return problems


def _check_all(t, grid, shard, sizes, selected=None):
    problems = []
    for name, f, exact in ops():
        if selected is None or name in selected:
            problems += [f"{name}: {p}" for p in _check_op(f, t, grid, shard, sizes, exact)]
    stories = COMM.allgather(problems)   # every rank fails alike, none waits
    failed = [f"rank {r}: {p}" for r, ps in enumerate(stories) for p in ps]
    assert not failed, f"{len(failed)} differences: " + "\n".join(failed[:20])


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_nan_and_inf_reductions_match_one_process(name, grid_ndim, kind):
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, grid_ndim, kind)
    dec = dp.Decomposition(SHAPE, grid, shard, sizes)
    _check_all(scenario(name, dec), grid, shard, sizes)


def test_nan_on_rank0_max_reported_case():
    """The issue's case on a 1-D grid: a NaN on rank 0 and the largest value on the
    last rank; max() is NaN and max(dim)/argmax give the NaN's index."""
    grid = dp.ProcessGrid([COMM.Get_size()])
    t = torch.arange(8, dtype=torch.float64)
    t[1] = NAN
    t[5] = NAN
    x = shard_like(t, grid, {0: 0})
    assert math.isnan(float(x.max())) and math.isnan(float(x.amin()))
    assert int(x.max(0).indices) == 1 and int(x.argmax()) == 1 and int(x.argmin(0)) == 1
    assert math.isnan(float(torch.linalg.vector_norm(x, INF)))
