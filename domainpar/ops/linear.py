"""Linear maps over an unsharded dim, and softmax / log_softmax.

- F.linear(x, weight, bias), torch.matmul / x @ W / W @ x with x a DomainTensor
  and the weight a plain (replicated) tensor: local, provided the contracted dim
  of x is not sharded. The weight (and bias) enter every block's computation
  through ``enter_domain``, so their gradient is summed over the ranks (or
  handed to DomainParallel's deferred reduction). The output keeps x's layout
  with the contracted dim's size changed. A sharded contracted dim, a
  DomainTensor weight, or a batched (>2-D) weight is refused.
- torch.matmul / @ of two DomainTensors, and torch.bmm: computed as the einsum
  they are (``ops.einsum.contract``; matmul's batch dims broadcast as an
  ellipsis). Local where only shared batch dims are sharded (an operand laid
  out differently is repartitioned onto the first one's blocks); a sharded
  contracted dim gives per-rank partial products summed by an allreduce (the
  result is replicated along that axis: a plain tensor when no sharded dim
  remains). Free dims of both operands sharded over one grid axis (attention
  scores q @ k^T with both sequences sharded): one operand gathered along it
  (``ops.einsum`` says which, and the memory per rank).
- softmax / log_softmax: local along an unsharded dim. Collective along a
  sharded dim: the global maximum (a detached shift, so it carries no
  gradient, as in any stable softmax) and the global sum of exponentials
  (allreduce-sum, replicated), which re-enters the blocks through a Broadcast
  so that its gradient is summed over the ranks: values and gradients equal
  one process's.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .. import autograd as ag
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, op_name, register
from ..tensor.domain_tensor import DomainTensor
from ..tensor.params import enter_domain
from .common import bind, meta
from .einsum import contract
from .reduce import allreduce_extremum

T = torch.Tensor


def _refuse(func, x: DomainTensor, why: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"{op_name(func)} on a DomainTensor sharded on "
                              f"{layout.sharded_dims_text(x._dec)}: {why}")


def _replicated(func, p, what: str):
    if isinstance(p, DomainTensor):
        raise UnsupportedOpError(
            f"{op_name(func)}: the {what} must be a plain (replicated) tensor, not a "
            f"DomainTensor; only the input may be sharded")
    return p


# -- linear, matmul ----------------------------------------------------------------------------
@register(F.linear)
def linear(func, args, kwargs):
    """Local. y = x W^T + b over x's last dim (unsharded)."""
    names = ("input", "weight", "bias")
    a = dict(zip(names, args))
    a.update(kwargs)
    x, bias = a.get("input"), a.get("bias")
    weight: Any = a.get("weight")  # whatever the caller passed: checked below
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: only the input may be a DomainTensor")
    _replicated(func, weight, "weight")
    _replicated(func, bias, "bias")
    dec = x._dec
    last = x.ndim - 1
    if last in dec.shard:
        raise _refuse(func, x, f"the contracted (last) dim {last} is sharded; redistribute "
                               f"so that it is whole on every rank")
    if weight.ndim not in (1, 2):
        raise UnsupportedOpError(f"{op_name(func)}: weight must be 1-D or 2-D, got "
                                 f"{weight.ndim}-D")
    out_shape = tuple(x.shape[:-1]) + ((weight.shape[0],) if weight.ndim == 2 else ())
    out_dec = layout.remap(dec, out_shape, {d: d for d in dec.shard})
    w = enter_domain(weight, out_dec, {})
    b = None if bias is None else enter_domain(bias, out_dec, {})
    return DomainTensor(F.linear(x._local, w, b), out_dec)


@register(torch.matmul, T.matmul, T.__matmul__, T.__rmatmul__)
def matmul(func, args, kwargs):
    """Local. x @ W (x's last dim contracted) or W @ x (x's dim -2, or its only
    dim, contracted), with W plain and 1-D or 2-D. Two DomainTensors: as ``einsum``
    (local on sharded batch dims, allreduce on a sharded contracted dim; free dims of
    both sharded over one grid axis, such as attention scores: one operand gathered)."""
    if kwargs.get("out") is not None:
        raise UnsupportedOpError(f"{op_name(func)}: out= is not supported on DomainTensors")
    left, right = (args[1], args[0]) if func is T.__rmatmul__ else (args[0], args[1])
    if isinstance(left, DomainTensor) and isinstance(right, DomainTensor):
        torch.matmul(meta(left), meta(right))  # torch's own shape and dtype checks
        lhs = "...nk" if left.ndim >= 2 else "k"
        rhs = "...km" if right.ndim >= 2 else "k"
        out = ("..." if max(left.ndim, right.ndim) >= 2 else "") + \
            ("n" if left.ndim >= 2 else "") + ("m" if right.ndim >= 2 else "")
        return contract(func, f"{lhs},{rhs}->{out}", [left, right])
    x = left if isinstance(left, DomainTensor) else right
    w = right if x is left else left
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{op_name(func)}: expected a tensor operand, got {type(w).__name__}")
    if w.ndim not in (1, 2):
        raise UnsupportedOpError(
            f"{op_name(func)}: a {w.ndim}-D replicated operand (batched matmul) is not "
            f"supported with a DomainTensor; use a 1-D or 2-D one")
    dec, nd = x._dec, x.ndim
    if x is left:
        contracted = nd - 1
        out_shape = tuple(x.shape[:-1]) + ((w.shape[1],) if w.ndim == 2 else ())
        dim_map = {d: d for d in dec.shard}
    else:
        contracted = max(nd - 2, 0)
        if nd == 1:
            out_shape = (w.shape[0],) if w.ndim == 2 else ()
            dim_map = {}
        elif w.ndim == 2:
            out_shape = tuple(x.shape[:-2]) + (w.shape[0], x.shape[-1])
            dim_map = {d: d for d in dec.shard}
        else:  # (k,) @ (..., k, n) -> (..., n): dim -1 moves to -2
            out_shape = tuple(x.shape[:-2]) + (x.shape[-1],)
            dim_map = {d: (d if d < nd - 2 else d - 1) for d in dec.shard}
    if contracted in dec.shard:
        raise _refuse(func, x, f"the contracted dim {contracted} is sharded; redistribute so "
                               f"that it is whole on every rank")
    out_dec = layout.remap(dec, out_shape, dim_map)
    wl = enter_domain(w, out_dec, {})
    product = torch.matmul(x._local, wl) if x is left else torch.matmul(wl, x._local)
    return DomainTensor(product, out_dec)


@register(torch.bmm, T.bmm)
def bmm(func, args, kwargs):
    """Local where only the batch dim is sharded; collective (allreduce of partial
    products) where the contracted dim is, or (one operand gathered, as ``einsum``)
    where free dims of both are; operands DomainTensors or plain."""
    a = bind(func, args, kwargs, ("input", "mat2", "out"))
    if a["out"] is not None:
        raise UnsupportedOpError(f"{op_name(func)}: out= is not supported on DomainTensors")
    torch.bmm(meta(a["input"]), meta(a["mat2"]))  # torch's own shape and dtype checks
    return contract(func, "bnk,bkm->bnm", [a["input"], a["mat2"]])


# -- softmax, log_softmax ------------------------------------------------------------------------
_F_FORMS = {F.softmax: False, F.log_softmax: True}
_FORMS = {torch.softmax: False, T.softmax: False, torch.log_softmax: True, T.log_softmax: True,
          torch.special.softmax: False, torch.special.log_softmax: True}


@register(*_F_FORMS, *_FORMS)
def softmax(func, args, kwargs):
    """Local along an unsharded dim; collective along a sharded one (global max shift and
    allreduce of exponentials). dim, dtype."""
    log = _F_FORMS.get(func, _FORMS.get(func))
    assert log is not None  # registered for these forms only
    names = ("input", "dim", "_stacklevel", "dtype") if func in _F_FORMS else \
        ("input", "dim", "dtype")
    a = bind(func, args, kwargs, names, {"_stacklevel": 3})
    x, dim, dtype = a["input"], a["dim"], a["dtype"]
    if dim is None:
        # F.softmax's legacy implicit dim (warns as torch does).
        dim = F._get_softmax_dim(  # type: ignore[attr-defined]  # private, not in torch's stubs
            "log_softmax" if log else "softmax", x.ndim, a["_stacklevel"])
    if not isinstance(dim, int):
        raise UnsupportedOpError(f"{op_name(func)}: dim must be an int on DomainTensors, "
                                 f"got {dim!r}")
    dim = dim % max(x.ndim, 1) if -max(x.ndim, 1) <= dim < max(x.ndim, 1) else None
    if dim is None:
        raise IndexError(f"Dimension out of range (expected to be in range of "
                         f"[{-x.ndim}, {x.ndim - 1}], but got {a.get('dim')})")
    return global_softmax(x, dim, log, dtype)


def global_softmax(x: DomainTensor, dim: int, log: bool, dtype=None) -> DomainTensor:
    """softmax (or log_softmax) of ``x`` along ``dim``; collective over the grid
    axis that cuts ``dim`` when it is sharded, local otherwise."""
    local = x._local if dtype is None else x._local.to(dtype)
    dec = x._dec
    if dim not in dec.shard:
        return DomainTensor((torch.log_softmax if log else torch.softmax)(local, dim), dec)
    comm = layout.comm_of(dec, (dim,))
    if local.shape[dim] == 0:
        keep = [1 if d == dim else n for d, n in enumerate(local.shape)]
        part = torch.full(keep, -math.inf, dtype=local.dtype, device=local.device)
    else:
        part = local.detach().amax(dim=dim, keepdim=True)
    # The shift guards exp against overflow; detached, it adds no gradient. As in
    # torch it is the maximum itself: a row holding +inf or NaN, or all -inf, is NaN.
    z = local - allreduce_extremum(part, comm, "max")
    s = z.exp().sum(dim=dim, keepdim=True)
    if comm.Get_size() > 1:
        # The replicated sum re-enters every block: Broadcast sums its gradient.
        s = ag.broadcast(ag.allreduce_sum(s, comm), comm)
    out = z - s.log() if log else z.exp() / s
    return DomainTensor(out, dec)
