"""The tensor protocol on DomainTensors: metadata queries, autograd plumbing,
copies and moves that keep the layout, printing.

These are not domain-parallel ops; they answer for the global tensor (``size``,
``dim``, ``numel``) or act on the block and keep the decomposition (``detach``,
``clone``, ``to``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..comm.decomposition import Decomposition
from . import layout
from .dispatch import Args, Func, Kwargs, UnsupportedOpError, op_name, register
from .domain_tensor import DomainTensor

T = torch.Tensor


def _unwrap(a: Any) -> Any:
    return a._local if isinstance(a, DomainTensor) else a


# -- metadata of the global tensor: answered by the wrapper itself -----------------------------
@register(T.size, T.dim, T.ndimension, T.numel, T.nelement, T.__len__, T.element_size,
          T.is_floating_point, T.is_complex, T.get_device, T.is_signed, T.__hash__,
          T.is_inference, T.__format__)
def _global_metadata(func: Func, args: Args, kwargs: Kwargs) -> Any:
    return func(*args, **kwargs)


@register(T.is_contiguous)
def _local_metadata(func: Func, args: Args, kwargs: Kwargs) -> Any:
    return func(*pytree.tree_map(_unwrap, args), **kwargs)


@register(T.__repr__, T.__str__)
def _repr(func: Func, args: Args, kwargs: Kwargs) -> Any:
    return DomainTensor.__repr__(args[0])


@register(T.__bool__, T.item, T.tolist, T.numpy, T.__array__, T.__int__, T.__float__,
          T.__index__, T.data_ptr, T.storage, T.untyped_storage)
def _needs_the_whole(func: Func, args: Args, kwargs: Kwargs) -> Any:
    raise UnsupportedOpError(
        f"{op_name(func)} needs the whole tensor and a DomainTensor holds one block per rank; "
        f"call .full_tensor() first (it gathers) or .to_local() for this rank's block")


# -- copies and moves that keep the layout ------------------------------------------------------
# (Tensor.cfloat and cdouble exist but are missing from torch 2.13's type stubs.)
@register(T.detach, T.clone, torch.clone, T.contiguous, T.to, T.cpu, T.cuda, T.double, T.float,
          T.half, T.bfloat16, T.int, T.long, T.bool, T.type, T.type_as,
          T.cfloat, T.cdouble,  # type: ignore[attr-defined]
          T.pin_memory, torch.detach)
def _same_layout(func: Func, args: Args, kwargs: Kwargs) -> Any:
    self = args[0]
    if not isinstance(self, DomainTensor):  # e.g. plain.type_as(domain_tensor)
        return func(*pytree.tree_map(_unwrap, args), **pytree.tree_map(_unwrap, kwargs))
    out = func(self._local, *pytree.tree_map(_unwrap, args[1:]),
               **pytree.tree_map(_unwrap, kwargs))
    if isinstance(out, str):  # x.type() with no argument
        return out
    if out is self._local:
        return self
    return DomainTensor(out, self._dec)


@register(T.detach_, T.requires_grad_, T.retain_grad, T.share_memory_)
def _in_place_on_block(func: Func, args: Args, kwargs: Kwargs) -> Any:
    self = args[0]
    func(self._local, *args[1:], **kwargs)
    return self


# -- autograd ----------------------------------------------------------------------------------
@register(T.backward)
def _backward(func: Func, args: Args, kwargs: Kwargs) -> Any:
    """Collective when the graph communicates (every rank must call it)."""
    self, rest = args[0], args[1:]
    out = self._local if isinstance(self, DomainTensor) else self
    return out.backward(*pytree.tree_map(_unwrap, rest), **pytree.tree_map(_unwrap, kwargs))


@register(torch.autograd.backward)
def _autograd_backward(func: Func, args: Args, kwargs: Kwargs) -> Any:
    return func(*pytree.tree_map(_unwrap, args), **pytree.tree_map(_unwrap, kwargs))


@register(torch.autograd.grad)
def _autograd_grad(func: Func, args: Args, kwargs: Kwargs) -> Any:
    names = ("outputs", "inputs", "grad_outputs", "retain_graph", "create_graph",
             "only_inputs", "allow_unused", "is_grads_batched", "materialize_grads")
    given: dict[str, Any] = dict(zip(names, args), **kwargs)
    inputs: Any = given.get("inputs")
    seq = isinstance(inputs, (list, tuple))
    decs = [a._dec if isinstance(a, DomainTensor) else None
            for a in (inputs if seq else [inputs])]
    grads = func(**pytree.tree_map(_unwrap, given))
    return tuple(g if d is None or g is None else DomainTensor(g, d)
                 for g, d in zip(grads, decs))


@register(T.register_hook)
def _register_hook(func: Func, args: Args, kwargs: Kwargs) -> Any:
    self, hook = args[0], args[1] if len(args) > 1 else kwargs["hook"]
    dec = self._dec

    def on_block(grad: torch.Tensor) -> torch.Tensor | None:
        out = hook(DomainTensor(grad, dec))
        return out._local if isinstance(out, DomainTensor) else out

    return self._local.register_hook(on_block)


# -- factories on a tensor ------------------------------------------------------------------------
_SHAPED_FACTORIES = (T.new_zeros, T.new_ones, T.new_full, T.new_empty)


@register(T.new_tensor)
def _new_tensor(func: Func, args: Args, kwargs: Kwargs) -> Any:
    """Local. ``x.new_tensor(data)`` copies ``data``: a plain (replicated) tensor of
    ``x``'s dtype and device, as for any tensor."""
    return func(args[0]._local, *pytree.tree_map(_unwrap, args[1:]), **kwargs)


def _buffer_layout(dec: Decomposition, shape: tuple[int, ...]) -> Decomposition | None:
    """The layout of a fresh ``shape`` buffer made from a tensor laid out by ``dec``
    (same number of dims): each sharded dim of unchanged size keeps its grid axis
    and blocks; one whose size changes to 1 is not cut (a broadcast dim); any other
    changed size is cut anew, balanced, over the same axis. None when no dim is cut."""
    shard: dict[int, int] = {}
    sizes: dict[int, tuple[int, ...]] = {}
    for d, axis in dec.shard.items():
        if shape[d] == dec.global_shape[d]:
            shard[d], sizes[d] = axis, dec.block_sizes(d)
        elif shape[d] != 1:
            shard[d] = axis  # no data to move: any blocks are right; balanced ones
    return layout.derive(dec, shape, shard, sizes) if shard else None


@register(*_SHAPED_FACTORIES)
def _new(func: Func, args: Args, kwargs: Kwargs) -> Any:
    """Local. ``x.new_zeros(shape)``, ``new_ones``, ``new_full``, ``new_empty``: with as
    many dims as ``x``, a DomainTensor of the global ``shape`` laid out like ``x``
    (see ``_buffer_layout``), so that spectral layers' ``out = x_ft.new_zeros(...)``
    followed by ``out[..., :m1, :m2] = x_ft[..., :m1, :m2] @ w`` stays sharded and
    never gathers; with other dims, or no dim left cut, a plain (replicated) tensor.
    Only dtype and device come from ``x``, as for any tensor."""
    self, rest = args[0], list(pytree.tree_map(_unwrap, args[1:]))
    kwargs = dict(kwargs)
    # torch parses the size (varargs, a sequence or size=) on a meta tensor
    meta = torch.empty((), dtype=self.dtype, device="meta")
    shape = tuple(func(meta, *rest, **{k: v for k, v in kwargs.items()
                                      if k not in ("device", "pin_memory")}).shape)
    dec = _buffer_layout(self._dec, shape) if len(shape) == self._dec.ndim else None
    if dec is None:
        return func(self._local, *rest, **kwargs)
    kwargs.pop("size", None)
    fill = rest[1:] if func is T.new_full else []  # new_full(size, fill_value)
    return DomainTensor(func(self._local, dec.local_shape(), *fill, **kwargs), dec)
