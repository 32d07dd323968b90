"""User ``torch.autograd.Function``s applied to DomainTensors (custom Functions,
reentrant activation checkpointing, module backward hooks).

Why this is needed
------------------
domainpar keeps the autograd graph on the blocks (``_local``), never on the
wrapper (dispatch.py). ``Function.apply`` is not routed through
``__torch_function__``: its C++ half sees the wrapper itself, whose own
``requires_grad`` is always False, so the Function's node was connected to
nothing and every gradient upstream of it came back None, silently (issue 17).
The same held for anything built on ``Function.apply``:
``torch.utils.checkpoint(..., use_reentrant=True)``, and the
``BackwardHookFunction`` behind ``nn.Module.register_full_backward_hook``.

The fix
-------
``install()`` (run on import of ``domainpar.tensor``) wraps
``torch.autograd.Function.apply``: with no DomainTensor among the positional
arguments it is the original, untouched. With one, the call is lifted onto the
blocks: a Function of the same name (``_lifted(cls)``) takes the blocks as its
inputs, so its node is connected to their graph; its forward runs the user's
forward on the DomainTensors themselves (so the ops inside communicate as
usual) and hands autograd the blocks of the DomainTensor outputs; its backward
wraps the incoming block gradients as DomainTensors, runs the user's backward
and unwraps the result. ``ctx.save_for_backward``, ``ctx.saved_tensors``,
``ctx.mark_dirty``, ``ctx.mark_non_differentiable`` and the node's hooks
(``grad_fn.register_hook``, behind module full backward hooks) see
DomainTensors and act on the blocks, so saved outputs keep autograd's
cycle-free handling.

Measured on torch 2.13.0 (tests/test_checkpointing.py, tests/test_tensor_faults.py).
Every tensor and Function API used is public; the ctx overrides shadow the
Python methods of ``FunctionCtx`` and the ``saved_tensors`` getter and hook
methods of ``torch._C._FunctionBase`` (called through their descriptors).
"""
from __future__ import annotations

import contextvars
import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from ..comm.errors import LayoutError
from .dispatch import UnsupportedOpError
from .domain_tensor import DomainTensor

_Function = torch.autograd.Function
_ORIGINAL_APPLY = _Function.__dict__["apply"].__func__
# The call being lifted: (user class, its args with DomainTensors, a dict that
# receives the user's forward's outputs).
_PENDING: contextvars.ContextVar[tuple[type[_Function], tuple[Any, ...], dict[str, Any]]] = \
    contextvars.ContextVar("domainpar_lifted_call")
_LIFTED: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def install() -> None:
    """Local. Route ``Function.apply`` on DomainTensors through the blocks (idempotent)."""
    if _Function.__dict__["apply"].__func__ is not _apply:
        # patched on purpose: every Function's apply goes through _apply
        _Function.apply = classmethod(_apply)  # type: ignore[method-assign, assignment]


def _apply(cls: type[_Function], *args: Any, **kwargs: Any) -> Any:
    args = tuple(_stood_for(a) for a in args)
    if not any(isinstance(a, DomainTensor) for a in args) \
            or torch._C._are_functorch_transforms_active():
        return _ORIGINAL_APPLY(cls, *args, **kwargs)
    if cls.setup_context is not _Function.setup_context:  # bind as Function.apply does
        bound = inspect.signature(cls.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        args, kwargs = bound.args, bound.kwargs
    if kwargs:  # the original refuses these with torch's own error
        return _ORIGINAL_APPLY(cls, *args, **kwargs)
    outputs: dict[str, Any] = {}
    token = _PENDING.set((cls, args, outputs))
    try:
        blocks = _ORIGINAL_APPLY(_lifted(cls), *[_block(a) for a in args])
    finally:
        _PENDING.reset(token)
    return _rewrap(blocks, outputs["user"])


def _stood_for(a: Any) -> Any:
    """``a``, or what it stands for when it is a stand-in with no layout yet
    (``nn/factories.py``'s pending buffer: the plain tensor, a plain use)."""
    resolve = getattr(a, "_stand_in_for", None) if isinstance(a, DomainTensor) else None
    return a if resolve is None else resolve()


def _block(a: Any) -> Any:
    return a._local if isinstance(a, DomainTensor) else a


def _rewrap(blocks: Any, user_out: Any) -> Any:
    """The lifted Function's outputs as the user's forward returned them:
    DomainTensors again, the same object for a DomainTensor modified in place."""
    if not isinstance(blocks, tuple):
        return _rewrap_one(blocks, user_out)
    return tuple(_rewrap_one(b, u) for b, u in zip(blocks, user_out))


def _rewrap_one(block: Any, user: Any) -> Any:
    if not isinstance(user, DomainTensor):
        return block
    if block is user._local:  # marked dirty (in place): autograd kept the object
        return user
    return DomainTensor(block, user._dec)


def _lifted(cls: type) -> type:
    """The Function, named like ``cls`` (so its node's name() is the user's), that
    runs ``cls`` with the blocks as the graph's inputs and outputs."""
    lifted = _LIFTED.get(cls)
    if lifted is None:
        lifted = type(cls.__name__, (_OnBlocks,), {"__module__": cls.__module__,
                                                    "__qualname__": cls.__qualname__,
                                                    "_user": cls})
        ctx_cls = lifted._backward_cls  # type: ignore[attr-defined]  # set by torch's FunctionMeta
        for name in _CTX_OVERRIDES:
            setattr(ctx_cls, name, _CTX_OVERRIDES[name])
        ctx_cls.saved_tensors = property(_saved_tensors)
        _LIFTED[cls] = lifted
    return lifted


class _OnBlocks(_Function):
    _user: type

    @staticmethod
    def forward(ctx: Any, *blocks: Any) -> Any:
        cls, args, outputs = _PENDING.get()
        ctx._domainpar_user = cls
        if cls.setup_context is not _Function.setup_context:
            out = cls.forward(*args)
            cls.setup_context(ctx, args, out)
        else:
            out = cls.forward(ctx, *args)
        outputs["user"] = out
        outs = out if isinstance(out, tuple) else (out,)
        ctx._domainpar_out_decs = [o._dec if isinstance(o, DomainTensor) else None for o in outs]
        ctx._domainpar_in_decs = [a._dec if isinstance(a, DomainTensor) else None for a in args]
        if isinstance(out, tuple):
            return tuple(_block(o) for o in out)
        return _block(out)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        cls = ctx._domainpar_user
        user_fn = cls.vjp if cls.vjp is not _Function.vjp else cls.backward
        result = user_fn(ctx, *_wrap_all(grads, ctx._domainpar_out_decs))
        single = not isinstance(result, tuple)
        results = (result,) if single else result
        unwrapped = tuple(_grad_block(g, d, cls, i)
                          for i, (g, d) in enumerate(zip(results, ctx._domainpar_in_decs)))
        unwrapped += tuple(results[len(unwrapped):])  # let autograd judge a count mismatch
        return unwrapped[0] if single else unwrapped


def _grad_block(g: Any, dec: Decomposition | None, cls: type, i: int) -> Any:
    """The block of the gradient the user's backward returned for input ``i``."""
    if g is None or dec is None:
        if isinstance(g, DomainTensor):
            raise UnsupportedOpError(
                f"{cls.__name__}.backward returned a DomainTensor gradient for input {i}, "
                f"which is not a DomainTensor: return a plain tensor (a replicated value)")
        return g
    if not isinstance(g, DomainTensor):
        if tuple(g.shape) == dec.local_shape() == tuple(dec.global_shape):
            return g  # nothing is cut: the block is the whole tensor
        raise UnsupportedOpError(
            f"{cls.__name__}.backward returned a plain tensor of shape {tuple(g.shape)} as "
            f"the gradient of DomainTensor input {i}: return a DomainTensor laid out like "
            f"that input (compute it from the DomainTensor gradient it receives)")
    if g._dec == dec:
        return g._local
    if tuple(g._dec.global_shape) != tuple(dec.global_shape) or g._dec.grid is not dec.grid:
        raise LayoutError(
            f"{cls.__name__}.backward returned a gradient of global shape "
            f"{tuple(g._dec.global_shape)} for input {i} of global shape "
            f"{tuple(dec.global_shape)} (or on another grid)")
    return ag.repartition(g._local, g._dec, dec)  # same tensor, other layout: move it


# -- the ctx, seen by the user's forward and backward -------------------------------------------
def _save_for_backward(ctx: Any, *tensors: Any) -> None:
    ctx._domainpar_saved_decs = [t._dec if isinstance(t, DomainTensor) else None
                                 for t in tensors]
    torch.autograd.function.FunctionCtx.save_for_backward(ctx, *map(_block, tensors))


def _mark_dirty(ctx: Any, *tensors: Any) -> None:
    torch.autograd.function.FunctionCtx.mark_dirty(ctx, *map(_block, tensors))


def _mark_non_differentiable(ctx: Any, *tensors: Any) -> None:
    torch.autograd.function.FunctionCtx.mark_non_differentiable(ctx, *map(_block, tensors))


def _register_hook(ctx: Any, hook: Callable[..., Any]) -> Any:
    """A node hook (``grad_fn.register_hook``, as module full backward hooks use)
    sees DomainTensor gradients; what it returns goes back as blocks."""
    def on_blocks(grad_inputs: tuple[Any, ...],
                  grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        out = hook(_wrap_all(grad_inputs, ctx._domainpar_in_decs),
                   _wrap_all(grad_outputs, ctx._domainpar_out_decs))
        return None if out is None else tuple(_block(g) for g in out)
    return torch._C._FunctionBase.register_hook(ctx, on_blocks)


def _register_prehook(ctx: Any, hook: Callable[..., Any]) -> Any:
    def on_blocks(grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        out = hook(_wrap_all(grad_outputs, ctx._domainpar_out_decs))
        return None if out is None else tuple(_block(g) for g in out)
    return torch._C._FunctionBase.register_prehook(ctx, on_blocks)


def _wrap_all(grads: Iterable[Any], decs: Iterable[Decomposition | None]) -> tuple[Any, ...]:
    return tuple(g if g is None or d is None else DomainTensor(g, d) for g, d in zip(grads, decs))


def _saved_tensors(ctx: Any) -> tuple[Any, ...]:
    # the C getter (torch's stubs declare saved_tensors a plain tuple attribute)
    saved = torch._C._FunctionBase.saved_tensors.__get__(ctx, type(ctx))  # type: ignore[attr-defined]
    return _wrap_all(saved, getattr(ctx, "_domainpar_saved_decs", [None] * len(saved)))


_CTX_OVERRIDES = {"save_for_backward": _save_for_backward, "mark_dirty": _mark_dirty,
                  "mark_non_differentiable": _mark_non_differentiable,
                  "register_hook": _register_hook, "register_prehook": _register_prehook}
