"""The demo's check: the trained model sharded over the ranks against plain
PyTorch in one process, on a crop of a held-out sample.

Both runs take the loss sum(output * w) for one fixed random w; the sharded
run's output, input gradient and every parameter gradient are gathered and
compared with the one-process run on rank 0, in two precisions:

- float64: every element within the oracle's tolerance
  (``domainpar.testing.oracle.TOLERANCES``, rtol 1e-10):
  ``|got - want| <= rtol * (|want| + max |want|)``, the second term because
  gradients are sums over the whole crop, taken in another order on P ranks
  than on one. Only a bug exceeds that.
- float32, the training precision: a whole trained UNet amplifies rounding
  (normalizations divide by small variances; weight gradients are sums of
  terms of both signs), so two float32 runs that only add in another order
  differ by far more than 1e-5 of their largest value in places. The test is
  then whether the sharded run is as close to the float64 truth as the
  one-process run is.
"""
from __future__ import annotations

import copy

import torch

import domainpar as dp
from ..bench.timing import on_rank0
from ..testing.oracle import TOLERANCES, shard_like

DTYPES = (torch.float64, torch.float32)
# float32: the sharded run's error against float64 may be this many times the
# one-process run's before the check fails (two summation orders, same rounding).
FLOAT32_MARGIN = 10.0


def _loss_weight(shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _one_process(model: torch.nn.Module, crop: torch.Tensor) -> dict:
    """Local. Output, input gradient and parameter gradients on the whole crop."""
    x = crop.clone().requires_grad_(True)
    out = model(x)
    (out * _loss_weight(out.shape, out.dtype)).sum().backward()
    return {"output": out.detach(), "input gradient": x.grad,
            **{name: p.grad for name, p in model.named_parameters()}}


def _sharded(model: torch.nn.Module, crop: torch.Tensor, grid, shard) -> dict:
    """Collective. The same quantities with the crop sharded, gathered whole."""
    net = dp.DomainParallel(model, grid)
    x = shard_like(crop, grid, shard, requires_grad=True)
    out = net(x)
    (out * _loss_weight(out.shape, out.dtype)).sum().backward()
    return {"output": out.full_tensor().detach(), "input gradient": x.grad.full_tensor(),
            **{name: p.grad for name, p in model.named_parameters()}}


def _fold(name: str) -> str:
    """The report row of a quantity: parameter gradients share one."""
    return name if name in ("output", "input gradient") else "parameter gradients"


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Max |a - b| and that over max |b| (b the reference)."""
    diff = float((a.double() - b.double()).abs().max())
    return diff, diff / max(float(b.abs().max()), 1e-30)


def _compare(got: dict, want: dict, truth: dict | None) -> dict:
    """Local. One row per quantity (parameter gradients folded into their worst):
    max abs and relative difference of ``got`` (sharded) from ``want`` (one
    process), and ok. Without ``truth`` (float64): ok when every element is
    within the oracle's tolerance. With ``truth`` (the float64 one-process run,
    for float32): ok when the sharded run is about as close to the truth as the
    one-process run (within ``FLOAT32_MARGIN`` times its error), i.e. the cuts
    cost nothing beyond float32 rounding."""
    rows = {}
    for name, ref in want.items():
        max_abs, max_rel = _max_rel(got[name], ref)
        row = {"max_abs": max_abs, "max_rel": max_rel}
        if truth is None:
            rtol = TOLERANCES[ref.dtype][0]
            scale = float(ref.abs().max())
            row["ok"] = bool(((got[name] - ref).abs() <= rtol * (ref.abs() + scale)).all())
        else:
            row["error_sharded"] = _max_rel(got[name], truth[name])[1]
            row["error_one_process"] = _max_rel(ref, truth[name])[1]
            row["ok"] = row["error_sharded"] <= FLOAT32_MARGIN * row["error_one_process"] + 1e-7
        key = _fold(name)
        if key != name:
            row["worst"] = name
        before = rows.get(key)
        if before is not None:
            worse = row if row["max_rel"] > before["max_rel"] else before
            row = {**worse, "ok": row["ok"] and before["ok"]}
        rows[key] = row
    return rows


def check(model: torch.nn.Module, crop: torch.Tensor, grid: dp.ProcessGrid, shard) -> dict:
    """Collective. Compare ``model`` (copies of it, in training mode) sharded by
    ``shard`` over ``grid`` with one process on rank 0, on ``crop`` (a global
    tensor every rank holds), in float64 and float32 (see ``_compare``).
    Returns, the same on every rank, ``{dtype: {quantity: row}}`` and ``ok``."""
    comm = grid.comm
    want, got = {}, {}
    for dtype in DTYPES:
        ref_model = copy.deepcopy(model).to(dtype).train()
        # The one-process run is rank 0's only: the others wait (asleep) meanwhile.
        on_rank0(comm, lambda: want.__setitem__(dtype, _one_process(ref_model, crop.to(dtype))))
        got[dtype] = _sharded(copy.deepcopy(model).to(dtype).train(), crop.to(dtype), grid,
                              shard)
    report = None
    if comm.Get_rank() == 0:
        report = {"float64": _compare(got[torch.float64], want[torch.float64], None),
                  "float32": _compare(got[torch.float32], want[torch.float32],
                                      want[torch.float64])}
        report["ok"] = all(r["ok"] for rows in report.values() for r in rows.values())
    return comm.bcast(report, root=0)
