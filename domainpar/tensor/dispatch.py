"""The op dispatch table: which domain-parallel rule runs for which torch call.

Why ``__torch_function__`` and not ``__torch_dispatch__``
--------------------------------------------------------
A DomainTensor reports the *global* shape (so unmodified model code that reads
``x.shape``, flattens or views keeps working) and holds its block in
``_local``. Every torch call that touches one reaches ``handle`` below, at the
Python API level, before autograd and before the call is decomposed into aten
ops. We route there, and only there, for three reasons:

- A rule sees the call as the user wrote it (``F.conv2d(x, w, stride=2)``,
  ``x.mean(dim=(2, 3))``, ``x.reshape(...)``). The halo width of a conv or the
  communicator of a reduction follows from those arguments; at aten level they
  are spread over several ops and the backward ops would need rules too.
- A rule runs plain torch ops on local blocks plus the Functions in
  ``domainpar.autograd``. Autograd records the local ops as usual, so backward
  needs no rules of its own: the adjoint of every message is in the Function
  that sent it. This is where sharded-tensor libraries working at aten level
  go wrong (a backward op whose sharding rule is missing or inconsistent).
- The autograd graph lives on the local tensors: ``.grad`` of a DomainTensor is
  its block's gradient, wrapped.

``__torch_dispatch__`` is defined only to refuse: a DomainTensor has no storage,
so anything that slips past the Python API level raises an error naming the op
instead of reading garbage.

Rules
-----
``register(*funcs)(rule)`` binds ``rule(func, args, kwargs)`` to torch callables
(``torch.add``, ``torch.Tensor.add``, ``F.relu`` ...). A rule runs with torch
function disabled for subclasses, so inside it plain tensors behave normally
and a DomainTensor handed to a torch op by mistake reaches the refusal above.
Metadata (decompositions, shapes) is the same on every rank, so a rule that
refuses on it refuses on every rank alike.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import torch
from torch.utils import _pytree as pytree

from ..comm.errors import DomainparError
from ..comm.grid import ProcessGrid
from . import aliasing, layout

if TYPE_CHECKING:
    from .domain_tensor import DomainTensor

# What a rule is handed: the torch callable as called, its positional and its
# keyword arguments. Torch calls take and return anything, hence the Anys.
Func: TypeAlias = Callable[..., Any]
Args: TypeAlias = tuple[Any, ...]
Kwargs: TypeAlias = dict[str, Any]
Rule: TypeAlias = Callable[[Func, Args, Kwargs], Any]
AttributeRule: TypeAlias = Callable[["DomainTensor"], Any]
_R = TypeVar("_R", bound=Rule)
_AR = TypeVar("_AR", bound=AttributeRule)

_RULES: dict[Any, Rule] = {}
_ATTRIBUTE_RULES: dict[str, AttributeRule] = {}
_GATHER_ALLOWED = contextvars.ContextVar("domainpar_allow_gather", default=False)
# ``observing_ops``: observers of the outermost DomainTensor calls, and the flag
# that marks a call already inside one (nested calls are not observed again).
_OP_OBSERVERS: list[Callable[[Any], contextlib.AbstractContextManager[object]]] = []
_OBSERVED = threading.local()
# Deferred DomainTensors (``deferred.py``) whose block is not computed yet, by id;
# and the ops whose rules take one as it is (they call its ``narrowed``).
_PENDING: dict[int, weakref.ref[Any]] = {}
TAKES_DEFERRED: set[Any] = set()


class UnsupportedOpError(DomainparError, NotImplementedError):
    """A torch op on a DomainTensor with no domain-parallel rule (or options the
    rule does not support)."""


def register(*funcs: Any) -> Callable[[_R], _R]:
    """Bind a rule ``rule(func, args, kwargs)`` to the torch callables ``funcs``."""
    def bind(rule: _R) -> _R:
        for f in funcs:
            _RULES[f] = rule
        return rule
    return bind


def register_attribute(*names: str) -> Callable[[_AR], _AR]:
    """Bind ``rule(tensor)`` to reading the tensor attributes ``names`` (``T``, ``real``)."""
    def bind(rule: _AR) -> _AR:
        for n in names:
            _ATTRIBUTE_RULES[n] = rule
        return rule
    return bind


def has_rule(func: Any) -> bool:
    """Local. Whether ``func`` has a rule in the dispatch table."""
    return func in _RULES


def rules() -> dict[Any, Rule]:
    """A copy of the dispatch table: ``{torch callable: rule}``."""
    return dict(_RULES)


@contextlib.contextmanager
def allow_gather() -> Iterator[None]:
    """Local (entering and leaving; the gathers inside are collective). A context
    in which ops without a domain-parallel rule gather instead of raising.

    Inside the block, a torch op with no rule gathers its DomainTensor arguments
    (allgatherv: every rank then holds the whole tensor), runs on the whole
    tensors and re-shards a result shaped like its first DomainTensor argument;
    other results come back replicated. Opt-in only: outside it, such an op
    raises UnsupportedOpError.

    Yields
    ------
    None
        Use as ``with dp.allow_gather(): ...`` on every rank alike.
    """
    token = _GATHER_ALLOWED.set(True)
    try:
        yield
    finally:
        _GATHER_ALLOWED.reset(token)


def op_name(func: Any) -> str:
    """Local. ``func``'s name as error messages give it (``Tensor.x``, ``F.x``, ``torch.x``)."""
    name = getattr(func, "__name__", None) or repr(func)
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    if isinstance(owner, type):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or ""
    if module.startswith("torch.nn.functional"):
        return f"torch.nn.functional.{name}"
    for sub in ("fft", "special", "linalg"):  # torch.fft.rfft2 is named fft_rfft2
        if module in (f"torch.{sub}", f"torch._C._{sub}") and name.startswith(sub + "_"):
            return f"torch.{sub}.{name[len(sub) + 1:]}"
    return f"torch.{name}"


# Argument types that pytree takes as leaves: a call whose arguments are all these
# or tensors is flat, and its tensors are found without a tree walk.
_LEAF_TYPES = frozenset((int, float, bool, complex, str, type(None), torch.dtype, torch.device,
                         torch.layout, torch.memory_format))


def _leaf(a: Any) -> bool:
    """Whether pytree takes ``a`` as a leaf without looking inside: a tensor or a
    plain value of ``_LEAF_TYPES``."""
    return isinstance(a, torch.Tensor) or type(a) in _LEAF_TYPES


def flat(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Local. Whether the plan cache is on and every argument is a tensor or a
    plain value (no list, tuple or dict to walk): then ``(*args,
    *kwargs.values())`` are the call's pytree leaves, in pytree's order."""
    return layout.ENABLED and all(_leaf(a) for a in (*args, *kwargs.values()))


def leaves(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """Local. The call's pytree leaves, in pytree's order: without a tree walk where
    every argument is a tensor, a plain value, or a list or tuple of those (with
    the plan cache on, as ``flat``)."""
    if not layout.ENABLED:
        return pytree.tree_leaves((args, kwargs))
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        if _leaf(a):
            out.append(a)
        elif type(a) in (list, tuple) and all(_leaf(v) for v in a):
            out.extend(a)
        else:
            return pytree.tree_leaves((args, kwargs))
    return out


def domain_tensors(args: Iterable[Any],
                   kwargs: Mapping[str, Any] | None = None) -> list[DomainTensor]:
    """The DomainTensors among (nested) ``args`` and ``kwargs``, in order."""
    from .domain_tensor import DomainTensor
    return [a for a in leaves(tuple(args), kwargs or {}) if isinstance(a, DomainTensor)]


def same_grid(func: Any, tensors: Sequence[DomainTensor], *, merged_ok: bool = False) -> None:
    """Refuse DomainTensors on different grids in one op. With ``merged_ok`` grids
    of the same processes (one merged from the other's root: a dim cut over
    several axes) pass; the rule repartitions them onto one layout."""
    grid = tensors[0]._dec.grid
    for t in tensors[1:]:
        if t._dec.grid is grid or (merged_ok and t._dec.grid.root is grid.root):
            continue
        hint = ("x.redistribute(shard=...) (axes of the grid you made) to bring one onto the "
                "other's layout" if t._dec.grid.root is grid.root
                else "repartition one onto the other's grid")
        raise UnsupportedOpError(
            f"{op_name(func)}: DomainTensors on different process grids ({_grid_text(grid)} "
            f"and {_grid_text(t._dec.grid)}) cannot be mixed; {hint}")


def _grid_text(grid: ProcessGrid) -> str:
    """A grid as every rank describes it alike (its repr names this rank)."""
    merged = f", grid axes {grid.merged_axes} of dims {grid.parent.dims} merged" \
        if grid.parent is not None else ""
    return f"dims {grid.dims}, periodic {grid.periodic}{merged}"


def unsupported(func: Any, args: Iterable[Any], kwargs: Mapping[str, Any] | None,
                why: str | None = None) -> UnsupportedOpError:
    """The error for a call with no rule: names the op and the sharded dims."""
    dts = domain_tensors(args, kwargs)
    where = "; ".join(layout.sharded_dims_text(t._dec) for t in dts) or "no sharded dims"
    reason = why or "domainpar has no domain-parallel rule for it"
    return UnsupportedOpError(
        f"{op_name(func)} on a DomainTensor sharded on {where}: {reason}. Wrap the call in "
        f"`with domainpar.allow_gather():` to gather the whole tensor on every rank, run it "
        f"there and re-shard the result")


# -- the entry point -------------------------------------------------------------------------
def handle(func: Func, types: object, args: Args = (), kwargs: Kwargs | None = None) -> Any:
    """Collective when the op's rule is. DomainTensor's ``__torch_function__``: run
    ``func``'s rule; without one, gather and run it whole inside ``allow_gather()``,
    else raise UnsupportedOpError (the same on every rank), as for a write into an
    alias it cannot follow."""
    if _OP_OBSERVERS and not getattr(_OBSERVED, "inside", False):
        return _observed_handle(func, types, args, kwargs)
    kwargs = kwargs or {}
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return _attribute(func, name, args, kwargs)
    rule = _RULES.get(func)
    if _PENDING and func not in TAKES_DEFERRED:
        _complete(leaves(args, kwargs))
    refusal = aliasing.write_refusal(func, args, kwargs) if _may_refuse(args, kwargs) else None
    if refusal is not None:
        raise UnsupportedOpError(f"{op_name(func)}: {refusal}")
    with torch._C.DisableTorchFunctionSubclass():
        if rule is not None:
            return aliasing.link(name, args, kwargs, rule(func, args, kwargs))
        if _GATHER_ALLOWED.get():
            return _gather_and_run(func, args, kwargs)
        raise unsupported(func, args, kwargs)


def pending(t: Any) -> None:
    """Local. Register the Deferred ``t``: its block is computed before any call
    that takes it, but those in ``TAKES_DEFERRED``."""
    key = id(t)
    _PENDING[key] = weakref.ref(t, lambda _ref: _PENDING.pop(key, None))


def done(t: Any) -> None:
    """Local. The Deferred ``t`` has its block."""
    _PENDING.pop(id(t), None)


def _complete(operands: Iterable[Any]) -> None:
    """Collective where a block's computation is. Compute the block of every
    pending Deferred among ``operands``, in their order (the same on every rank)."""
    for a in operands:
        if id(a) in _PENDING:
            a._local  # noqa: B018 (the property computes the block)


def _may_refuse(args: Args, kwargs: Kwargs) -> bool:
    """Whether ``aliasing.write_refusal`` can refuse the call: it writes only into
    ``out=`` and its first operand, and refuses only a tensor whose alias group
    holds a copy. Always True with the plan cache off (the check then runs)."""
    if not layout.ENABLED or kwargs.get("out") is not None:
        return True
    first = args[0] if args else kwargs.get("input", kwargs.get("self"))
    group = getattr(first, "_alias_group", None) if isinstance(first, torch.Tensor) else None
    return group is not None and group.copied is not None


@contextlib.contextmanager
def observing_ops(
        observer: Callable[[Any], contextlib.AbstractContextManager[object]]) -> Iterator[None]:
    """Local. Inside this block every outermost DomainTensor call on this process
    (an op, an attribute read or write: everything that reaches ``handle``) runs
    inside ``observer(func)``, a context manager made per call, ``func`` the torch
    callable (``op_name(func)`` names it). Calls made while one is observed are
    part of it. The public hook for benchmarks that time the dispatch path
    (``domainpar bench step``); outside any block a call pays one test of an
    empty list."""
    _OP_OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OP_OBSERVERS.remove(observer)


def _observed_handle(func: Func, types: object, args: Args, kwargs: Kwargs | None) -> Any:
    """``handle`` inside every observer, marked as observed for the calls it makes."""
    _OBSERVED.inside = True
    try:
        with contextlib.ExitStack() as stack:
            for observer in list(_OP_OBSERVERS):
                stack.enter_context(observer(func))
            return handle(func, types, args, kwargs)
    finally:
        _OBSERVED.inside = False


# Attributes that live on the block (autograd state) rather than on the wrapper.
_LOCAL_ATTRIBUTES = {"requires_grad", "grad_fn", "is_leaf", "_version", "retains_grad",
                     "output_nr", "_grad_fn", "_backward_hooks"}


def _attribute(func: Func, kind: str, args: Args, kwargs: Kwargs) -> Any:
    from .domain_tensor import DomainTensor
    descriptor = getattr(func, "__self__", None)
    attr = getattr(descriptor, "__name__", None) or getattr(
        getattr(descriptor, "fget", None), "__name__", "")
    self = args[0]
    with torch._C.DisableTorchFunctionSubclass():
        if not isinstance(self, DomainTensor):
            return func(*args, **kwargs)
        if kind == "__get__":
            if attr == "grad":
                g = self._local.grad
                return None if g is None else DomainTensor(g, self._dec)
            if attr == "data":
                return aliasing.link(attr, args, {}, DomainTensor(self._local.data, self._dec))
            if attr in _LOCAL_ATTRIBUTES:
                return getattr(self._local, attr)
            if attr in _ATTRIBUTE_RULES:
                return aliasing.link(attr, args, {}, _ATTRIBUTE_RULES[attr](self))
            return func(*args, **kwargs)  # metadata of the global tensor: shape, dtype ...
        if kind == "__set__":
            value = args[1]
            if attr in ("grad", "data"):
                if value is not None and not isinstance(value, DomainTensor):
                    raise UnsupportedOpError(
                        f"setting .{attr} of a DomainTensor needs a DomainTensor (or None), "
                        f"got a {type(value).__name__}")
                if value is not None and value._dec != self._dec:
                    raise UnsupportedOpError(
                        f"setting .{attr} of a DomainTensor needs the same decomposition: "
                        f"{value._dec} differs from {self._dec}")
                setattr(self._local, attr, None if value is None else value._local)
                return None
            if attr == "requires_grad":
                self._local.requires_grad = value
                return None
        raise UnsupportedOpError(f"{kind} of attribute {attr!r} is not supported on a DomainTensor")


def _gather_and_run(func: Func, args: Args, kwargs: Kwargs) -> Any:
    from ..autograd import allgather, shard
    from .domain_tensor import DomainTensor
    dts = domain_tensors(args, kwargs)
    same_grid(func, dts)
    lead = dts[0]

    def full(a: Any) -> Any:
        return allgather(a._local, a._dec) if isinstance(a, DomainTensor) else a

    out = func(*pytree.tree_map(full, args), **pytree.tree_map(full, kwargs))

    def reshard(o: Any) -> Any:
        if isinstance(o, torch.Tensor) and tuple(o.shape) == lead._dec.global_shape:
            return DomainTensor(shard(o, lead._dec), lead._dec)
        return o

    result = pytree.tree_map(reshard, out)
    if op_name(func).endswith("_") and args and isinstance(args[0], DomainTensor):
        # In place on the gathered copy: write this rank's block back.
        target = args[0]
        target._local.copy_(result._local if isinstance(result, DomainTensor) else
                            shard(out, target._dec))
        return target
    return result
