"""Losses: mse, l1, smooth_l1, huber, cross_entropy, nll_loss, as global reductions.

Collective for reduction='mean' and 'sum'; local for reduction='none'. Each rank
computes the elementwise loss of its block with torch's own function
(reduction='none'), on operands brought onto one layout first (a target laid
out differently is repartitioned, a plain target is cut to the block; see
``common``). 'sum' is the allreduced sum of the block sums, replicated on every
rank, and 'mean' divides it by the same denominator torch uses, itself global:
the element count, the sum of the weights (mse/l1 with ``weight``), or for
class-index targets the sum of the class weights of the non-ignored targets.
Backward follows docs/design.md: the replicated loss's gradient reaches every block
whole (AllreduceSum's adjoint is the identity), so input gradients equal one
process's. nn.MSELoss, nn.CrossEntropyLoss ... call these functions and work too.

cross_entropy and nll_loss apply log_softmax / pick the class along dim 1 (dim
0 for a 1-D input): that dim must not be sharded.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, op_name, register, same_grid
from ..tensor.domain_tensor import DomainTensor
from ..tensor.params import enter_domain
from .common import bind, onto, output_layout

_REDUCTIONS = ("none", "mean", "sum")


def _check_common(func, a) -> str:
    """Refuse the legacy arguments; validate ``reduction``."""
    if a.get("size_average") is not None or a.get("reduce") is not None:
        raise UnsupportedOpError(
            f"{op_name(func)}: the legacy size_average= / reduce= arguments are not supported "
            f"on DomainTensors; pass reduction='mean', 'sum' or 'none' instead")
    reduction = a.get("reduction", "mean")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    return reduction


def global_total(local: torch.Tensor, dec: Decomposition) -> torch.Tensor:
    """Collective over the axes that cut ``dec``'s dims. The sum of every element
    of the global tensor whose block is ``local``, replicated (differentiable)."""
    part = local.sum()
    comm = layout.comm_of(dec, tuple(dec.shard))
    return part if comm.Get_size() == 1 else ag.allreduce_sum(part, comm)


def _replicated_total(t) -> torch.Tensor:
    """The sum of all elements of ``t`` (a DomainTensor or a replicated plain tensor)."""
    if isinstance(t, DomainTensor):
        return global_total(t._local, t._dec)
    return t.sum()


# -- elementwise losses ------------------------------------------------------------------------
# torch's positional order for each, and the denominator of 'mean' with weight=.
_ELEMENTWISE = {
    F.mse_loss: (("input", "target", "size_average", "reduce", "reduction", "weight"), {}),
    F.l1_loss: (("input", "target", "size_average", "reduce", "reduction", "weight"), {}),
    F.smooth_l1_loss: (("input", "target", "size_average", "reduce", "reduction", "beta"),
                       {"beta": 1.0}),
    F.huber_loss: (("input", "target", "reduction", "delta", "weight"), {"delta": 1.0}),
}
# 'mean' with a weight: torch divides mse/l1 by sum(weight), huber by the element count.
_WEIGHT_SUM_MEAN = {F.mse_loss, F.l1_loss}


@register(*_ELEMENTWISE)
def elementwise_loss(func, args, kwargs):
    """Local elementwise loss, then a global reduction (allreduce) for reduction='mean' or
    'sum'; 'none' keeps the layout. weight, beta and delta as torch."""
    names, defaults = _ELEMENTWISE[func]
    a = bind(func, args, kwargs, names, {"reduction": "mean", **defaults})
    reduction = _check_common(func, a)
    x, target, weight = a["input"], a["target"], a.get("weight")
    if func is F.l1_loss and weight is None:
        weight = _l1_weight_dropped_by_torch()
    if weight is not None and tuple(weight.shape) != tuple(x.shape):
        raise ValueError("Weights and input must have the same size.")
    operands = [t for t in (x, target, weight) if isinstance(t, torch.Tensor)]
    out_dec, out_shape = output_layout(func, operands)
    extra = {k: a[k] for k in ("beta", "delta") if k in a}
    if weight is not None:
        extra["weight"] = onto(weight, out_dec)
    elem = func(onto(x, out_dec), onto(target, out_dec), reduction="none", **extra)
    if reduction == "none":
        return DomainTensor(elem, out_dec)
    total = global_total(elem, out_dec)
    if reduction == "sum":
        return total
    if weight is not None and func in _WEIGHT_SUM_MEAN:
        return total / _replicated_total(weight)
    return total / math.prod(out_shape)


def _l1_weight_dropped_by_torch():
    """The ``weight`` that F.l1_loss was called with, when torch left it out.

    torch's F.l1_loss does not pass ``weight`` on to ``handle_torch_function``
    (mse_loss and huber_loss do), so a rule never sees it; computing the
    unweighted loss would be silently wrong. The caller's frame still holds it.
    """
    frame = sys._getframe(1)
    for _ in range(12):
        back = frame.f_back
        if back is None:
            return None
        frame = back
        if frame.f_code is _L1_CODE:
            return frame.f_locals.get("weight")
    return None


_L1_CODE = getattr(F.l1_loss, "__code__", None)


# -- cross entropy, nll ------------------------------------------------------------------------
_CLASS_LOSSES = {
    F.cross_entropy: (("input", "target", "weight", "size_average", "ignore_index", "reduce",
                       "reduction", "label_smoothing"), {"label_smoothing": 0.0}),
    F.nll_loss: (("input", "target", "weight", "size_average", "ignore_index", "reduce",
                  "reduction"), {}),
}


@register(*_CLASS_LOSSES)
def class_loss(func, args, kwargs):
    """Local log_softmax / class pick along the class dim (unsharded), then a
    global reduction over the remaining (batch and spatial) dims."""
    names, defaults = _CLASS_LOSSES[func]
    a = bind(func, args, kwargs, names, {"reduction": "mean", "ignore_index": -100, **defaults})
    reduction = _check_common(func, a)
    x, target, weight = a["input"], a["target"], a["weight"]
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(
            f"{op_name(func)}: the input (scores) must be the DomainTensor; a plain input with a "
            f"sharded target is not supported")
    same_grid(func, [t for t in (x, target, weight) if isinstance(t, DomainTensor)])
    if isinstance(weight, DomainTensor):
        raise UnsupportedOpError(
            f"{op_name(func)}: weight= must be a plain (replicated) tensor of the C class "
            f"weights, not a DomainTensor")
    dec = x._dec
    cdim = 0 if x.ndim == 1 else 1
    if cdim in dec.shard:
        raise UnsupportedOpError(
            f"{op_name(func)} on a DomainTensor sharded on {layout.sharded_dims_text(dec)}: the "
            f"class dim {cdim} is sharded; log_softmax over it needs it whole. Redistribute so "
            f"that dim {cdim} is not sharded")
    extra = {"ignore_index": a["ignore_index"]}
    if func is F.cross_entropy:
        extra["label_smoothing"] = a["label_smoothing"]
    # The loss per position: x's layout without the class dim.
    tshape = _drop(x.shape, cdim)
    tdec = layout.remap(dec, tshape, {d: (d if d < cdim else d - 1) for d in dec.shard})
    prob_target = tuple(target.shape) == tuple(x.shape)
    if prob_target and func is F.nll_loss:
        raise ValueError(f"nll_loss: expected a target of shape {tshape} (class indices), got "
                         f"{tuple(target.shape)}")
    if not prob_target and tuple(target.shape) != tshape:
        raise ValueError(f"{op_name(func)}: expected a target of shape {tshape} (class "
                         f"indices) or {tuple(x.shape)} (class probabilities), got "
                         f"{tuple(target.shape)}")
    local_target = onto(target, dec if prob_target else tdec)
    # The class weights enter every block's computation: gradient (if any) summed.
    local_weight = None if weight is None else enter_domain(weight, tdec, {})
    elem = func(x._local, local_target, weight=local_weight, reduction="none", **extra)
    if reduction == "none":
        return DomainTensor(elem, tdec)
    total = global_total(elem, tdec)
    if reduction == "sum":
        return total
    if prob_target:  # torch divides by the number of positions, weight or not
        return total / math.prod(tshape)
    # Class indices: torch divides by the summed class weights of the
    # non-ignored targets (their count without weight), over the whole tensor.
    kept = local_target != a["ignore_index"]
    if local_weight is None:
        part = kept.sum().to(elem.dtype)
    else:
        safe = torch.where(kept, local_target, torch.zeros_like(local_target))
        part = torch.where(kept, local_weight[safe], torch.zeros((), dtype=local_weight.dtype,
                                                                  device=elem.device)).sum()
    comm = layout.comm_of(tdec, tuple(tdec.shard))
    denominator = part if comm.Get_size() == 1 else ag.allreduce_sum(part, comm)
    return total / denominator


def _drop(shape, dim: int) -> tuple[int, ...]:
    return tuple(n for d, n in enumerate(shape) if d != dim)
