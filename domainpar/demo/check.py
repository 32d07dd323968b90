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
  one-process run is, judged per group of quantities (the output, the input
  gradient, the parameter gradients): every member's error (relative to the
  group's largest value, see below) must be within ``FLOAT32_MARGIN`` times the group's
  float32 noise level, the worst one-process error in the group, plus
  ``FLOAT32_FLOOR``. One quantity's one-process error is a single draw of
  rounding and can be near zero by luck (a per-quantity ratio of 11 was seen
  on 3 ranks); the worst over a group is stable (sharded/one-process at most
  3.5 over 90 checks of the demo's UNet with trained-like weights on 2-4
  ranks), while a model that is wrong when sharded is off by orders of
  magnitude more.

The float64 runs are float64 throughout: complex parameters and buffers become
complex128 (``_converted``; ``Module.to`` would make them real) and the model's
own factory calls that name float32 or complex64 make the double dtype
(``_Double``, in both runs alike), since a hard-coded single-precision buffer
(neuraloperator's spectrum) would round both runs' gradients to float32 there.

In both precisions a quantity's scale (the ``max |want|`` above) is the largest
value in its group, not its own: a conv bias in front of a normalization (MONAI's
UNet, DynUNet) has gradient zero, and what both runs compute for it is the
rounding of sums whose terms are as large as the other parameter gradients;
against its own scale that rounding would read as a 100% error (float64) or
make the group's noise level 1e9 and the float32 check vacuous.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import domainpar as dp

from ..bench.timing import on_rank0
from ..testing.oracle import TOLERANCES, shard_like

DTYPES = (torch.float64, torch.float32)
# float32: a quantity's sharded error against float64 may be this many times its
# group's one-process error (the worst in the group) before the check fails.
FLOAT32_MARGIN = 10.0
# ... plus a couple of float32 roundings of the quantity's scale, always allowed.
FLOAT32_FLOOR = 2 * torch.finfo(torch.float32).eps


def _loss_weight(shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _converted(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Local. A copy of ``model`` whose floating parameters and buffers are in
    ``dtype`` and complex ones in the complex dtype of the same precision
    (``Module.to(torch.float64)`` would cast complex weights, such as
    neuraloperator's spectral weights, to real ones, dropping the imaginary part)."""
    as_complex = {torch.float64: torch.complex128, torch.float32: torch.complex64}[dtype]
    return copy.deepcopy(model)._apply(
        lambda t: t.to(dtype) if t.is_floating_point() else
        t.to(as_complex) if t.is_complex() else t)


# Factories whose explicit single-precision dtype the float64 runs make double.
_FACTORIES = frozenset((torch.zeros, torch.ones, torch.full, torch.empty, torch.zeros_like,
                        torch.ones_like, torch.full_like, torch.empty_like, torch.Tensor.new_zeros,
                        torch.Tensor.new_ones, torch.Tensor.new_full, torch.Tensor.new_empty,
                        torch.tensor, torch.as_tensor, torch.arange, torch.linspace))
_DOUBLE = {torch.float32: torch.float64, torch.complex64: torch.complex128}


class _Double(TorchFunctionMode):
    """Local. The float64 runs' mode: a factory call in the model that names
    float32 or complex64 makes float64 or complex128 (neuraloperator's
    SpectralConv allocates its spectrum buffer as complex64 whatever the input,
    which would round the float64 runs' spectral path, and its gradient, to
    single precision). The same in both runs: the truth is float64 throughout."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("dtype") in _DOUBLE:
            kwargs = {**kwargs, "dtype": _DOUBLE[kwargs["dtype"]]}
        return func(*args, **kwargs)


def _precision(dtype: torch.dtype):
    return _Double() if dtype == torch.float64 else contextlib.nullcontext()


def _one_process(model: torch.nn.Module, crop: torch.Tensor) -> dict:
    """Local. Output, input gradient and parameter gradients on the whole crop."""
    x = crop.clone().requires_grad_(True)
    out = model(x)
    (out * _loss_weight(out.shape, out.dtype)).sum().backward()
    return {"output": out.detach(), "input gradient": x.grad,
            **_parameter_gradients(model)}


def _sharded(model: torch.nn.Module, crop: torch.Tensor, grid, shard, sizes=None) -> dict:
    """Collective. The same quantities with the crop sharded, gathered whole."""
    net = dp.DomainParallel(model, grid)
    x = shard_like(crop, grid, shard, sizes, requires_grad=True)
    out = net(x)
    (out * _loss_weight(out.shape, out.dtype)).sum().backward()
    return {"output": out.full_tensor().detach(), "input gradient": x.grad.full_tensor(),
            **_parameter_gradients(model)}


def _parameter_gradients(model: torch.nn.Module) -> dict:
    """Local. Every parameter's gradient, zeros for one the loss never reached
    (an unused parameter, such as the cross-attention norms of UNETR's ViT), so
    that both runs compare alike: a gradient on one side only still differs."""
    return {name: torch.zeros_like(p) if p.grad is None else p.grad
            for name, p in model.named_parameters()}


def _group(name: str) -> str:
    """The report row of a quantity: parameter gradients share one."""
    return name if name in ("output", "input gradient") else "parameter gradients"


def _max_rel(a: torch.Tensor, b: torch.Tensor, scale: float) -> tuple[float, float]:
    """Max |a - b| and that over ``scale`` (b the reference; complex: the modulus)."""
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    diff = float((a.to(wide) - b.to(wide)).abs().max())
    return diff, diff / max(scale, 1e-30)


def _row(got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor | None,
         scales: tuple[float, float]) -> dict:
    """Local. One quantity: max abs and relative difference of ``got`` (sharded)
    from ``want`` (one process); without ``truth`` (float64) ok when every
    element is within the oracle's tolerance; with it (float32) both runs'
    errors against the float64 truth, judged in ``_fold``. ``scales``: the
    group's largest |want| and |truth| (see the module's docstring)."""
    max_abs, max_rel = _max_rel(got, want, scales[0])
    row = {"max_abs": max_abs, "max_rel": max_rel}
    if truth is None:
        rtol = TOLERANCES[want.dtype][0]
        row["ok"] = bool(((got - want).abs() <= rtol * (want.abs() + scales[0])).all())
    else:
        row["error_sharded"] = _max_rel(got, truth, scales[1])[1]
        row["error_one_process"] = _max_rel(want, truth, scales[1])[1]
    return row


def _fold(rows: dict[str, dict]) -> dict:
    """Local. One group's rows as its worst member's row (named in "worst" when
    the group has several). float32 rows (with errors against the truth) are
    judged here: ok when every member's sharded error is within
    ``FLOAT32_MARGIN`` times the group's noise (its worst one-process error),
    plus ``FLOAT32_FLOOR``; the row's "error_one_process" is that noise."""
    judged = "error_sharded" in next(iter(rows.values()))
    key = "error_sharded" if judged else "max_rel"
    name, worst = max(rows.items(), key=lambda item: item[1][key])
    if judged:
        noise = max(row["error_one_process"] for row in rows.values())
        ok = worst["error_sharded"] <= FLOAT32_MARGIN * noise + FLOAT32_FLOOR
        worst = {**worst, "error_one_process": noise}
    else:
        ok = all(row["ok"] for row in rows.values())
    return {**worst, "ok": bool(ok), **({"worst": name} if len(rows) > 1 else {})}


def _compare(got: dict, want: dict, truth: dict | None) -> dict:
    """Local. One row per group of quantities (output, input gradient, parameter
    gradients; see ``_row`` and ``_fold``), comparing ``got`` (sharded) with
    ``want`` (one process), and with ``truth`` (the float64 one-process run)
    when judging float32."""
    members: dict[str, list[str]] = {}
    for name in want:
        members.setdefault(_group(name), []).append(name)
    report = {}
    for group, names in members.items():
        scale_want, scale_truth = (
            max((float(ref[n].abs().max()) for n in names if ref[n].numel()), default=0.0)
            for ref in (want, truth or want))
        scales = (scale_want, scale_truth)
        report[group] = _fold({n: _row(got[n], want[n], None if truth is None else truth[n],
                                       scales) for n in names})
    return report


def check(model: torch.nn.Module, crop: torch.Tensor, grid: dp.ProcessGrid, shard, *,
          sizes=None) -> dict:
    """Collective. Compare ``model`` (copies of it, in training mode) sharded by
    ``shard`` over ``grid`` (block ``sizes`` as in ``Decomposition``; default
    even) with one process on rank 0, on ``crop`` (a global tensor every rank
    holds), in float64 and float32 (see ``_compare``).
    Returns, the same on every rank, ``{dtype: {quantity: row}}`` and ``ok``."""
    comm = grid.comm
    want: dict[torch.dtype, dict[str, torch.Tensor]] = {}
    got: dict[torch.dtype, dict[str, torch.Tensor]] = {}
    for dtype in DTYPES:
        ref_model = _converted(model, dtype).train()
        # The one-process run is rank 0's only: the others wait (asleep) meanwhile.
        def reference(dtype: torch.dtype = dtype, ref_model: torch.nn.Module = ref_model) -> None:
            want[dtype] = _one_process(ref_model, crop.to(dtype))

        with _precision(dtype):
            on_rank0(comm, reference)
            got[dtype] = _sharded(_converted(model, dtype).train(), crop.to(dtype), grid,
                                  shard, sizes)

    def judge() -> dict[str, Any]:
        report: dict[str, Any] = {"float64": _compare(got[torch.float64], want[torch.float64], None),
                  "float32": _compare(got[torch.float32], want[torch.float32],
                                      want[torch.float64])}
        report["ok"] = all(r["ok"] for rows in report.values() for r in rows.values())
        return report
    return on_rank0(comm, judge)
