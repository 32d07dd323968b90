"""Which DomainTensors share their data, so that a write that would not reach
every one of them is refused instead of giving another answer than one process.

Local: no communication. A ``view`` whose blocks had to be repartitioned first
(``ops/shape.py``) is a copy of its input's blocks, while in one process it
shares the input's storage: a write into either would reach the other there,
and not here. Such a view and its input are marked, with every tensor that
shares data with them (their *alias group*), and any in-place write into a
marked tensor is refused.

Every decision is made from the sequence of torch calls alone (op names, never
storage pointers or strides: an empty block views where a full one copies, and
a refusal on some ranks only would leave the others waiting), so every rank
refuses alike. An op named in ``ALIASING`` puts its DomainTensor results in
the alias group of its tensor operand, whether or not its blocks happen to be
views (a conservative choice: a copy that joins a marked group is refused
writes it could safely take). Writes through the blocks themselves
(``x.to_local().add_(1)``) are not seen.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from .domain_tensor import DomainTensor

_R = TypeVar("_R")

# Ops (Tensor methods, torch functions, attributes) whose result may share data
# with their first tensor operand, in one process or here.
ALIASING = frozenset({
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "ravel", "permute",
    "transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "t", "adjoint", "squeeze",
    "unsqueeze", "expand", "expand_as", "broadcast_to", "__getitem__", "narrow", "select",
    "split", "split_with_sizes", "tensor_split", "chunk", "unbind", "hsplit", "vsplit", "dsplit",
    "detach", "diagonal", "unfold", "real", "imag", "view_as_real", "view_as_complex",
    "contiguous", "to", "cpu", "cuda", "double", "float", "half", "bfloat16", "int", "long",
    "bool", "type", "type_as", "cfloat", "cdouble", "conj", "resolve_conj", "resolve_neg",
    "alias", "atleast_1d", "atleast_2d", "atleast_3d", "align_as",
    "T", "mT", "H", "mH", "data"})

# In-place dunders, and methods ending in "_" that change autograd state, not data.
_IN_PLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__idiv__", "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__",
    "__ilshift__", "__irshift__"})
_NOT_WRITES = frozenset({"requires_grad_", "detach_", "share_memory_", "retain_grad_"})


class AliasGroup:
    """Tensors that may share data. ``copied``: None, or why one of them is a
    copy that a write into any of them would not reach (or come from)."""

    __slots__ = ("copied",)

    def __init__(self) -> None:
        self.copied: str | None = None


def _domain(a: object) -> TypeGuard[DomainTensor]:
    from .domain_tensor import DomainTensor
    return isinstance(a, DomainTensor)


def group_of(t: DomainTensor) -> AliasGroup:
    """Local. ``t``'s alias group (a new one of its own if it has none yet)."""
    group = getattr(t, "_alias_group", None)
    if group is None:
        group = t._alias_group = AliasGroup()
    return group


def _operand(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    return args[0] if args else kwargs.get("input", kwargs.get("self"))


def link(name: str, args: Sequence[Any], kwargs: Mapping[str, Any] | None, result: _R) -> _R:
    """Local. Put the DomainTensors in ``result`` of the op ``name`` into the alias
    group of its tensor operand when the op may alias; returns ``result``."""
    if name not in ALIASING:
        return result
    source = _operand(args, kwargs or {})
    if not _domain(source):
        return result
    group = group_of(source)
    for leaf in pytree.tree_leaves(result):
        if _domain(leaf) and leaf is not source:
            leaf._alias_group = group
    return result


def mark_copied(base: DomainTensor, view: DomainTensor, why: str) -> None:
    """Local. ``view`` was made from ``base`` as a copy where one process would
    share storage: writes into either (and their aliases) are refused from now on."""
    group = group_of(base)
    group.copied = why
    view._alias_group = group


@functools.cache
def _inplace_position(func: Callable[..., Any]) -> int | None:
    """Where a function's ``inplace`` parameter sits (F.dropout(x, p, training,
    inplace), F.relu(x, inplace) ...), or None."""
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("inplace") if "inplace" in names else None


def writes_operand(func: Callable[..., Any], args: Sequence[Any],
                   kwargs: Mapping[str, Any]) -> bool:
    """Local. Whether the call writes into its first tensor operand: an in-place
    method or operator (``add_``, ``+=``, ``__setitem__``), or ``inplace=True``
    given by keyword or by position."""
    name = getattr(func, "__name__", "")
    if name in _IN_PLACE_DUNDERS:
        return True
    if name.endswith("_") and not name.startswith("__"):
        return name not in _NOT_WRITES
    if kwargs.get("inplace"):
        return True
    try:
        pos = _inplace_position(func)
    except TypeError:  # unhashable callable
        return False
    return pos is not None and len(args) > pos and bool(args[pos])


def written(func: Callable[..., Any], args: Sequence[Any],
            kwargs: Mapping[str, Any] | None) -> list[DomainTensor]:
    """Local. The DomainTensors the call writes into: its tensor operand for an
    in-place op, and its ``out=`` tensors."""
    kwargs = kwargs or {}
    out = [a for a in pytree.tree_leaves(kwargs.get("out")) if _domain(a)]
    first = _operand(args, kwargs)
    if _domain(first) and writes_operand(func, args, kwargs):
        out.insert(0, first)
    return out


def write_refusal(func: Callable[..., Any], args: Sequence[Any],
                  kwargs: Mapping[str, Any] | None) -> str | None:
    """Local. Why the call must not run (it writes into a tensor whose alias group
    holds a copy that the write would not reach), or None."""
    for t in written(func, args, kwargs):
        group = getattr(t, "_alias_group", None)
        if group is not None and group.copied is not None:
            return (f"it writes in place into a DomainTensor of global shape "
                    f"{tuple(t._dec.global_shape)} that shares its data with a view that is "
                    f"a copy here ({group.copied}); in one process the write would reach "
                    f"both, here only one. Write into a copy instead (y = y.clone(), or an "
                    f"out-of-place op such as y = y + 1), or lay the blocks out so that the "
                    f"view needs no repartition")
    return None
