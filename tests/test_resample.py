"""F.interpolate and nn.Upsample on DomainTensors (domainpar/ops/resample.py)
against one process on the whole tensor: output and input gradient, float64
and float32, over a seeded sample of (mode x size / scale_factor, up and down,
integer and not, per dim x align_corners x recompute_scale_factor x antialias
x 1-, 2-, 3-D) x (even, uneven, zero-size, periodic layouts) x (1-, 2-, 3-D
grids); the layouts it derives; and the refusals, on every rank.

The serial test checks the building block first: the taps read off torch's
probes reproduce torch on whole tensors."""
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

import domainpar as dp
from domainpar.ops import resample
from domainpar.testing import (
    assert_matches_single_process,
    check_on_every_rank,
    raises_on_every_rank,
    shard_like,
)
from tensor_cases import SIZE, global_tensor, layout

SHAPES = {1: (2, 3, 23), 2: (2, 3, 13, 11), 3: (2, 2, 9, 7, 6)}
INTERPOLATING = {"linear": 1, "bilinear": 2, "bicubic": 2, "trilinear": 3}
SELECTING = ("nearest", "nearest-exact", "area")  # no align_corners; any spatial rank
SPECS = ("size_up", "size_down", "scale_int", "scale_frac", "scale_down", "scale_per_dim")


def spec_kwargs(spec: str, nsp: int, rng: random.Random) -> dict:
    """size= or scale_factor= for one sample (scalar or per dim)."""
    n = SHAPES[nsp][2:]
    if spec == "size_up":
        size = tuple(int(s * 1.6) + 1 for s in n)
        return {"size": size[0] if nsp == 1 and rng.random() < 0.5 else size}
    if spec == "size_down":
        return {"size": tuple(max(2, s // 3) for s in n)}
    recompute = {"recompute_scale_factor": rng.choice((None, False, True))}
    if spec == "scale_int":
        return {"scale_factor": rng.choice((2, 3)), **recompute}
    if spec == "scale_frac":
        return {"scale_factor": rng.choice((1.7, 2.5, 4.3)), **recompute}
    if spec == "scale_down":
        return {"scale_factor": rng.choice((0.45, 0.7, 1 / 3)), **recompute}
    return {"scale_factor": (2.5, 0.6, 1.0)[:nsp], **recompute}


def option_sample():
    """Every mode with every spec (and both align_corners where it applies),
    antialias on the modes that have it; each mode's cases, in a seeded order,
    take turns at the layout kinds, grids and dtypes, so every mode meets each."""
    rng = random.Random(4)
    combos = []
    for mode in SELECTING:
        for spec in SPECS:
            combos.append((mode, rng.choice((1, 2, 3)), spec, {}))
    for mode, nsp in INTERPOLATING.items():
        for spec in SPECS:
            for align in (False, True):
                combos.append((mode, nsp, spec, {"align_corners": align}))
    for mode in ("bilinear", "bicubic"):
        for spec in ("size_down", "scale_down", "scale_frac"):
            combos.append((mode, 2, spec, {"align_corners": rng.choice((False, True)),
                                           "antialias": True}))
    rng.shuffle(combos)
    cases, seen = [], {}
    for i, (mode, nsp, spec, extra) in enumerate(combos):
        c = seen[mode, "antialias" in extra] = seen.get((mode, "antialias" in extra), -1) + 1
        kind = ("even", "uneven", "zero", "periodic")[c % 4]
        grid_ndim = 1 + (c + c // 4) % 3
        dtype = (torch.float64, torch.float32)[(c + c // 4) % 2]
        kw = {"mode": mode, **spec_kwargs(spec, nsp, rng), **extra}
        cases.append(pytest.param(nsp, kw, kind, grid_ndim, dtype,
                                  id=f"{mode}-{nsp}d-{spec}-{i}-{kind}-grid{grid_ndim}-"
                                     f"{str(dtype)[-7:]}"))
    return cases


def sharded_layout(shape, kind: str, grid_ndim: int, with_batch: bool = True):
    """Spatial dims first (the first grid_ndim of them are cut), then the batch dim."""
    spatial = tuple(range(2, len(shape)))
    periodic = kind == "periodic"
    return layout(shape, spatial + ((0,) if with_batch else ()), grid_ndim,
                  "uneven" if periodic else kind, periodic=periodic)


def atol(dtype):
    """The oracle's absolute tolerance, except in float32: an input gradient cell
    sums up to ~100 products (trilinear x2.5: 5^3) of O(1) terms, so float32
    rounding alone puts torch's own gradient ~4e-6 from the float64 truth, and
    ours as far on the other side; rtol stays 1e-5."""
    return 1e-5 if dtype == torch.float32 else None


@pytest.mark.mpi
@pytest.mark.parametrize("nsp, kw, kind, grid_ndim, dtype", option_sample())
def test_interpolate_matches_one_process(monkeypatch, nsp, kw, kind, grid_ndim, dtype):
    """In the linear modes also with torch's bilinear kernel on planes of any size
    (``PLANE`` 0), in the nearest modes also with torch's nearest kernel on blocks
    of any size (``NEAREST_CELLS`` 0), as the field sizes that take them by
    default are large."""
    shape = SHAPES[nsp]
    grid, shard, sizes = sharded_layout(shape, kind, grid_ndim)
    kernels = kw["mode"] in ("bilinear", "trilinear", "nearest", "nearest-exact")
    plane, cells = resample.PLANE, resample.NEAREST_CELLS
    for everywhere in (False, True)[:1 + kernels]:  # the large fields' kernels on small ones
        monkeypatch.setattr(resample, "PLANE", 0 if everywhere else plane)
        monkeypatch.setattr(resample, "NEAREST_CELLS", 0 if everywhere else cells)
        assert_matches_single_process(lambda x: F.interpolate(x, **kw),
                                      global_tensor(shape, dtype), grid, shard, sizes=sizes,
                                      atol=atol(dtype))


UPSAMPLES = [
    nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False),
    nn.Upsample(size=(17, 8, 13), mode="trilinear", align_corners=True),
]


MODULE_CASES = [pytest.param(m, kind, 1 + (2 * m + i) % 3, id=f"{name}-{kind}")
                for m, name in enumerate(("scale2", "size-align"))
                for i, kind in enumerate(("even", "uneven", "zero", "periodic"))]


@pytest.mark.mpi
@pytest.mark.parametrize("module, kind, grid_ndim", MODULE_CASES)
def test_upsample_module(module, kind, grid_ndim):
    shape = (1, 2, 10, 7, 6)
    grid, shard, sizes = sharded_layout(shape, kind, grid_ndim, with_batch=False)
    for dtype in (torch.float64, torch.float32):
        assert_matches_single_process(UPSAMPLES[module], global_tensor(shape, dtype), grid,
                                      shard, sizes=sizes, atol=atol(dtype))


@pytest.mark.mpi
def test_even_layouts_stay_even():
    """A 2x upsample keeps every rank's share: output block = 2 x input block;
    a 2x area downsample halves it."""
    shape = (1, 2, 8 * SIZE, 6)
    grid, shard, _ = layout(shape, (2,), 1, "even")
    x = shard_like(global_tensor(shape), grid, shard)
    for mode, extra in (("nearest", {}), ("bilinear", {"align_corners": False}),
                        ("bicubic", {"align_corners": True})):
        y = F.interpolate(x, scale_factor=2, mode=mode, **extra)
        assert y._dec.block_sizes(2) == tuple(2 * s for s in x._dec.block_sizes(2)), mode
    y = F.interpolate(x, scale_factor=0.5, mode="area")
    assert y._dec.block_sizes(2) == tuple(s // 2 for s in x._dec.block_sizes(2))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ("bilinear", "area"))
def test_batch_only_sharded(mode):
    """No spatial dim cut: torch runs on each block as it is."""
    shape = (5, 2, 6, 7)
    grid, shard, sizes = layout(shape, (0,), 1, "uneven")
    assert_matches_single_process(lambda x: F.interpolate(x, size=(9, 4), mode=mode),
                                  global_tensor(shape), grid, shard, sizes=sizes)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ("nearest", "nearest-exact"))
def test_selection_on_integers(mode):
    """Nearest modes only select cells: they work on integer dtypes too."""
    shape = (1, 2, 11, 9)
    grid, shard, sizes = layout(shape, (2, 3), 2, "uneven")
    whole = (global_tensor(shape) * 50).to(torch.uint8)
    x = shard_like(whole, grid, shard, sizes)
    got = F.interpolate(x, scale_factor=(1.7, 0.6), mode=mode).full_tensor()
    assert torch.equal(got, F.interpolate(whole, scale_factor=(1.7, 0.6), mode=mode))


def _cut(shape, shard, dtype=torch.float64):
    grid = dp.ProcessGrid(MPI.Compute_dims(SIZE, len(shard)))
    return shard_like(global_tensor(shape).to(dtype), grid, shard)


@pytest.mark.mpi
def test_refusals():
    x = _cut((2, 4, 6, 6), {1: 0})
    raises_on_every_rank(dp.UnsupportedOpError, ["channel dim 1 is sharded"],
                         lambda: F.interpolate(x, scale_factor=2))
    raises_on_every_rank(dp.UnsupportedOpError, ["channel dim 1 is sharded"],
                         lambda: nn.Upsample(scale_factor=2)(x))
    y = _cut((2, 4, 6, 6), {2: 0}, torch.uint8)
    raises_on_every_rank(dp.UnsupportedOpError, ["'bilinear'", "torch.uint8", "floating dtype"],
                         lambda: F.interpolate(y, scale_factor=2, mode="bilinear"))
    z = _cut((1, 2, 12, 5), {2: 0})
    raises_on_every_rank(dp.UnsupportedOpError, ["antialias", "width of 1"],
                         lambda: F.interpolate(z, size=(4, 1), mode="bilinear", antialias=True))


@pytest.mark.mpi
def test_torch_errors_on_every_rank():
    """Bad arguments get torch's own error, on every rank, before any message."""
    x = _cut((1, 2, 8, 6), {2: 0})
    for kw in ({"scale_factor": 2, "align_corners": True},  # nearest has no corners
               {"size": 4, "scale_factor": 2, "mode": "bilinear"},
               {"size": (4, 4, 4), "mode": "bilinear"},
               {"size": 4, "mode": "bilinear", "recompute_scale_factor": True},
               {"scale_factor": 2, "mode": "nearest", "antialias": True}):
        raises_on_every_rank((ValueError, RuntimeError, NotImplementedError), "",
                             lambda kw=kw: F.interpolate(x, **kw))


def _recording(monkeypatch, *names):
    """The calls of resample's passes ``names`` as (name, dims) pairs, in order,
    each still doing its work."""
    calls = []
    for name in names:
        real = getattr(resample, name)
        monkeypatch.setattr(resample, name, lambda c, d, *rest, real=real, name=name: (
            calls.append((name, d)), real(c, d, *rest))[1])
    return calls


@pytest.mark.mpi
@pytest.mark.parametrize("shape, shard, kernel", (
    ((1, 2, 4, 33, 33), {0: 0}, (3, 4)), ((1, 2, 4, 33, 33), {2: 0}, (3, 4)),
    ((2, 2, 9, 32, 32), {2: 0}, (4,)), ((2, 2, 9, 7, 6), {2: 0, 3: 1}, (4,)),
    ((2, 2, 9, 7, 6), {2: 0, 3: 1, 4: 2}, ())),
    ids=("none-cut", "D-cut", "D-cut-small-planes", "DH-cut", "DHW-cut"))
def test_linear_modes_hand_whole_trailing_dims_to_torch(monkeypatch, shape, shard, kernel):
    """Trilinear: the last spatial dim, not cut, goes to torch's linear kernel, and
    the last two, neither cut, on planes of more than 1024 cells to its bilinear
    kernel, in one call; taps cover the others (D even with no dim cut); the
    result is torch's."""
    calls = _recording(monkeypatch, "kernel_pass", "apply_taps")
    whole = global_tensor(shape)
    x = _cut(shape, shard)
    got = F.interpolate(x, scale_factor=(2, 1.5, 2), mode="trilinear", align_corners=False)
    taps = {d for name, d in calls if name == "apply_taps"}
    assert taps == set(range(2, 5)) - set(kernel)
    assert [d for name, d in calls if name == "kernel_pass"] == ([kernel] if kernel else [])
    torch.testing.assert_close(got.full_tensor(), F.interpolate(
        whole, scale_factor=(2, 1.5, 2), mode="trilinear", align_corners=False))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ("nearest", "nearest-exact"))
def test_nearest_modes_hand_whole_dims_to_torch(monkeypatch, mode):
    """A nearest mode with D cut, on a block of ``NEAREST_CELLS`` or more, selects
    along D by taps, then runs torch's own nearest kernel once over all the
    spatial dims (it once tapped every dim, the innermost by a gather: 1x16x256^2
    took 5x torch's time on a one-rank grid); the result is torch's, bit for bit."""
    monkeypatch.setattr(resample, "NEAREST_CELLS", 0)  # the kernel on a small field too
    calls = _recording(monkeypatch, "nearest_pass", "apply_taps")
    shape = (2, 2, 9, 7, 6)
    x = _cut(shape, {2: 0})
    got = F.interpolate(x, scale_factor=(2, 1.5, 2), mode=mode)
    # every rank calls both whatever its block (an empty one gets a placeholder)
    check_on_every_rank(calls == [("apply_taps", 2), ("nearest_pass", [2])],
                        f"calls {calls}")
    want = F.interpolate(global_tensor(shape), scale_factor=(2, 1.5, 2), mode=mode)
    full = got.full_tensor()
    check_on_every_rank(torch.equal(full, want), "the result differs from torch's")


# -- serial: the taps themselves --------------------------------------------------------------
def tap_sample():
    rng = random.Random(7)
    modes = {1: ("nearest", "nearest-exact", "linear", "area"),
             2: ("nearest", "nearest-exact", "bilinear", "bicubic", "area", "aa-bilinear",
                 "aa-bicubic"),
             3: ("nearest", "nearest-exact", "trilinear", "area")}
    cases = []
    while len(cases) < 120:
        nsp = rng.choice((1, 2, 3))
        mode = rng.choice(modes[nsp])
        shape = [1, 2] + [rng.randint(1, 40 if nsp < 3 else 12) for _ in range(nsp)]
        kw = {"mode": mode.removeprefix("aa-"), "antialias": mode.startswith("aa-")}
        if kw["mode"] in INTERPOLATING or kw["mode"] == "bicubic":
            kw["align_corners"] = rng.random() < 0.5
        if rng.random() < 0.5:
            kw["size"] = [rng.randint(1, 50 if nsp < 3 else 14) for _ in range(nsp)]
        else:
            kw["scale_factor"] = [rng.choice((2, 3, 0.5, 1.7, 0.3, 2.5, 1 / 3, 0.7, 1.0, 4.3))
                                  for _ in range(nsp)]
            kw["recompute_scale_factor"] = rng.choice((None, False, True))
        try:
            out = F.interpolate(torch.zeros(shape), **kw)
        except (ValueError, RuntimeError):
            continue
        if kw["antialias"] and out.shape[-1] == 1 and out.shape[-2] != shape[-2]:
            continue  # torch's own kernel is off there (refused, see test_refusals)
        cases.append((shape, kw))
    return cases


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_taps_reproduce_torch(dtype):
    """Applying the per-dim taps to a whole tensor is torch's interpolation:
    float64 to ~1e-13, float32 to torch's own rounding."""
    tol = {torch.float64: (1e-12, 1e-13), torch.float32: (1e-5, 1e-6)}[dtype]
    for i, (shape, kw) in enumerate(tap_sample()):
        x = global_tensor(shape, dtype, seed=i)
        out = x
        for d, t in resample.dim_taps(x.shape, dtype, "cpu", kw).items():
            m = t.index.shape[1]
            index, weight = resample.local_taps(t, 0, m, 0, out.shape[d], dtype, "cpu")
            out = resample.apply_taps(out, d, index, weight)
        torch.testing.assert_close(out, F.interpolate(x, **kw), rtol=tol[0], atol=tol[1],
                                   msg=lambda m, shape=shape, kw=kw: f"{shape} {kw}: {m}")


@pytest.mark.parametrize("dtype", (torch.float64, torch.bfloat16))
def test_nearest_pass_after_taps_reproduces_torch(dtype):
    """In the nearest modes, taps along some spatial dims (the cut ones) and then
    torch's nearest kernel over all of them, the identity along the tapped ones
    (``nearest_pass``), select exactly torch's cells: sizes, scale factors and
    every recompute_scale_factor, 1- to 3-D, with or without a dim left whole."""
    checked = 0
    for i, (shape, kw) in enumerate(tap_sample()):
        if kw["mode"] not in ("nearest", "nearest-exact"):
            continue
        x = global_tensor(shape, torch.float64, seed=i).to(dtype)
        want = F.interpolate(x, **kw)
        for k in range(len(shape) - 1):
            tapped = list(range(2, 2 + k))
            out = x
            for d, t in resample.dim_taps(x.shape, dtype, "cpu", kw, tapped).items():
                index, weight = resample.local_taps(t, 0, t.index.shape[1], 0, out.shape[d],
                                                    dtype, "cpu")
                out = resample.apply_taps(out, d, index, weight)
            out = resample.nearest_pass(out, tapped, kw, want.shape)
            assert torch.equal(out, want), f"{shape} {kw}, dims {tapped} tapped"
            checked += 1
    assert checked >= 60  # the sample holds both nearest modes of each dimensionality


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_kernel_pass_after_taps_reproduces_torch(dtype):
    """In the linear modes, taps along the leading spatial dims and then torch's
    linear or bilinear kernel along the last one or two (``kernel_pass``) is torch's
    interpolation: float64 to ~1e-13, float32 to torch's own rounding."""
    tol = {torch.float64: (1e-12, 1e-13), torch.float32: (1e-5, 1e-6)}[dtype]
    checked = 0
    for i, (shape, kw) in enumerate(tap_sample()):
        if kw["mode"] not in INTERPOLATING or kw["mode"] == "bicubic" or kw["antialias"]:
            continue
        x = global_tensor(shape, dtype, seed=i)
        want = F.interpolate(x, **kw)
        for k in range(1, min(2, len(shape) - 2) + 1):
            kernel = tuple(range(len(shape) - k, len(shape)))
            out = x
            for d, t in resample.dim_taps(x.shape, dtype, "cpu", kw,
                                          range(2, len(shape) - k)).items():
                index, weight = resample.local_taps(t, 0, t.index.shape[1], 0, out.shape[d],
                                                    dtype, "cpu")
                out = resample.apply_taps(out, d, index, weight)
            out = resample.kernel_pass(out, kernel, kw, want.shape[len(shape) - k:])
            torch.testing.assert_close(out, want, rtol=tol[0], atol=tol[1],
                                       msg=lambda m, shape=shape, kw=kw: f"{shape} {kw}: {m}")
            checked += 1
    assert checked >= 25  # the sample holds linear modes of each dimensionality
