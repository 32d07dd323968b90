"""Sharded factories: a buffer made by ``torch.zeros`` (``ones``, ``full``,
``empty``) from a shape takes a layout when a DomainTensor is written into it.

The idiom of hand-written spectral layers (neuraloperator's SpectralConv, AFNO)::

    out = torch.zeros(B, C, H, W // 2 + 1, dtype=torch.cfloat, device=x.device)
    out[..., :m1, :m2] = x_ft[..., :m1, :m2] @ w

A plain tensor cannot become sharded in place, and filling it whole would put the
whole tensor on every rank. Inside ``sharded_factories()`` (a TorchFunctionMode;
``DomainParallel`` runs every forward inside it) such a factory call allocates
nothing: it returns a *pending* buffer, a tensor of the global shape, dtype and
device with no data yet, and the first use decides what it is:

- the first write into it is ``buf[index] = value`` with ``value`` a DomainTensor
  (basic index: ints, slices, None, Ellipsis): the buffer becomes a DomainTensor
  (the same Python object) whose dims are cut where the written region's dims are
  cut in ``value``, over the same grid axes (none when ``value`` cuts none: on
  one rank, or on grid axes of one process); the blocks of such a dim are those
  of the last DomainTensor that the forward used or produced with that size on that dim
  over that axis (so ``out`` is laid out like the spectrum it was sliced from and
  the write sends nothing), else balanced. Each rank allocates only its block,
  filled as the factory says; regions not written keep that fill on their
  owners. The write itself is then the DomainTensor rule (``ops/index.py``): the
  value is repartitioned onto the region where its blocks differ. Indices are
  global, as in one process.
  A zero buffer whose first written region is ``[0:end]`` along a dim (end
  short of the dim) is marked as holding zeros past ``end`` there
  (``ops/pad.py``, ``zeros_past``) until it is written again: a transform of
  it then carries only what lies below the end (``ops/fft.py``).
- any other use (a read, a plain write, an in-place op, ``.shape`` excepted):
  the factory runs as called, whole, and the buffer forwards every torch call to
  that plain tensor from then on; it is the plain tensor one process has.

A DomainTensor written into a buffer that is already plain is refused on every
rank (``ops/index.py``'s message names the fix: allocate from the DomainTensor,
``x.new_zeros(...)``), as is a write whose region has no dim that the value cuts
although the value is cut (only along dims the region broadcasts: the buffer
would be whole on every rank, which is what sharding was asked to avoid), and a
write whose index holds tensors; the decision is made from layouts and
the index alone, the same on every rank. Calls with a DomainTensor argument
(``x.new_zeros``, ``torch.zeros_like(x)``) are not touched: their own rules lay
them out like ``x``. Neither are ``*_like`` and ``new_*`` calls on plain tensors:
a buffer shaped after a plain tensor (often a rank's own block,
``torch.zeros_like(x.to_local())``) is plain work, and deferring it would only
hand a wrapper to code that reads its memory directly.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..ops.index import _expand_index, _int
from ..ops.pad import mark_zeros_past
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, op_name
from ..tensor.domain_tensor import DomainTensor

T = torch.Tensor
# factory -> (what fills a block, index of the fill value among the args or None)
_FACTORIES = {torch.zeros: ("zeros", None), torch.ones: ("ones", None),
              torch.empty: ("empty", None), torch.full: ("full", 1)}
_FILL: dict[str, Callable[..., torch.Tensor]] = {"zeros": torch.zeros, "ones": torch.ones,
                                                 "empty": torch.empty}
# Metadata of the global tensor, answered by the pending buffer without deciding it.
_METADATA = {T.size, T.dim, T.ndimension, T.numel, T.nelement, T.element_size,
             T.is_floating_point, T.is_complex, T.__len__, T.get_device}
_METADATA_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_cpu",
                        "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested",
                        "itemsize", "nbytes"}


class _Recipe:
    """How a pending buffer was made: the call itself (to run it whole) and what
    a block needs (fill, dtype, device, requires_grad, pin_memory)."""

    def __init__(self, func, args, kwargs, kind: str, fill, dtype, device, seen: dict):
        self.call = (func, args, kwargs)
        self.kind, self.fill, self.dtype, self.device = kind, fill, dtype, device
        self.requires_grad = bool(kwargs.get("requires_grad", False))
        self.pin_memory = bool(kwargs.get("pin_memory", False))
        self.seen = seen

    def block(self, shape) -> torch.Tensor:
        """Local. This rank's block of the buffer, filled as the factory says."""
        opts = {"dtype": self.dtype, "device": self.device,
                "requires_grad": self.requires_grad, "pin_memory": self.pin_memory}
        if self.kind == "full":
            return torch.full(tuple(shape), self.fill, **opts)
        return _FILL[self.kind](tuple(shape), **opts)

    def whole(self) -> torch.Tensor:
        """Local. The factory as called: the plain tensor one process has."""
        func, args, kwargs = self.call
        return func(*args, **{**kwargs, "dtype": self.dtype})


class PendingTensor(DomainTensor):
    """A factory's buffer inside ``sharded_factories()`` before its first use: the
    global shape, dtype and device, no data. A subclass of DomainTensor so that
    torch asks it first in any call it takes part in (subclasses before their
    bases); it then becomes a DomainTensor (written with one) or forwards to the
    plain tensor the factory makes."""

    _recipe: _Recipe
    _plain: torch.Tensor | None

    @staticmethod
    def __new__(cls, shape, recipe: _Recipe):
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=recipe.dtype,
                                                   device=recipe.device, requires_grad=False)
        self._recipe, self._plain = recipe, None
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if isinstance(target, PendingTensor) and target._plain is None:
            if func in _METADATA or _attribute(func) in _METADATA_ATTRIBUTES:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            if func is T.__setitem__ and len(args) == 3 and _is_domain(args[2]) \
                    and not isinstance(args[1], torch.Tensor):
                ends = _zero_ends(target, args[1])
                target._take_layout(args[1], args[2])
                out = DomainTensor.__torch_function__(func, types, args, kwargs)
                mark_zeros_past(target, ends)  # a transform need not carry those zeros
                return out
        return func(*pytree.tree_map(_resolved, args), **pytree.tree_map(_resolved, kwargs))

    def _take_layout(self, index, value: DomainTensor) -> None:
        """Local (layouts and the index only, alike on every rank). Become the
        DomainTensor that ``value``'s layout gives (see the module docstring)."""
        if self._recipe.requires_grad and torch.is_grad_enabled():
            # one process's error, raised alike on every rank (the blocks would
            # raise it as a leaf or as a view of one, depending on the region)
            raise RuntimeError("a leaf Variable that requires grad is being used in an "
                               "in-place operation.")
        dec = _layout_for(self, index, value)
        block = self._recipe.block(dec.local_shape())
        del self._recipe, self._plain
        # the pending buffer becomes a DomainTensor in place: the model holds this object
        self.__class__ = DomainTensor  # type: ignore[assignment]
        self._local, self._dec = block, dec

    def plain(self) -> torch.Tensor:
        """Local. The whole plain tensor (made on first call)."""
        if self._plain is None:
            with torch._C.DisableTorchFunction():
                self._plain = self._recipe.whole()
        return self._plain

    _stand_in_for = plain  # tensor/functions.py: a custom Function's argument is a plain use

    # (mypy 2.4 misreads torch 2.13's __repr__ signature, as for DomainTensor's)
    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]  # noqa: D105
        if self._plain is not None:
            return repr(self._plain)
        return (f"PendingTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"{self._recipe.kind}: a buffer that takes a layout when a DomainTensor "
                f"is written into it)")


def _attribute(func) -> str | None:
    """The attribute name when ``func`` reads one (``x.shape``), else None."""
    if getattr(func, "__name__", "") != "__get__":
        return None
    descriptor = getattr(func, "__self__", None)
    return getattr(descriptor, "__name__", None) or getattr(
        getattr(descriptor, "fget", None), "__name__", None)


def _is_domain(a) -> bool:
    return isinstance(a, DomainTensor) and not isinstance(a, PendingTensor)


def _resolved(a):
    return a.plain() if isinstance(a, PendingTensor) else a


def _region_dims(index, shape) -> tuple[list, list]:
    """The buffer dim behind each dim of the region ``buf[index]`` selects (None
    for a dim that ``None`` inserts), and the region's sizes."""
    dims: list[int | None] = []
    sizes: list[int] = []
    d = 0
    for it in _expand_index(T.__setitem__, index, len(shape)):
        if it is None:
            dims.append(None)
            sizes.append(1)
        elif isinstance(it, slice):
            dims.append(d)
            sizes.append(len(range(*it.indices(shape[d]))))
            d += 1
        elif _int(it) is not None:
            d += 1
        else:
            raise _refusal(f"the index holds a {type(it).__name__} (only ints, slices, None "
                           f"and Ellipsis lay a buffer out)")
    return dims, sizes


def _zero_ends(buf: PendingTensor, index) -> dict[int, int]:
    """``{dim: end}`` of a zero buffer written at ``index``: the dims along which
    the region is a slice ``[0:end]`` with ``end`` short of the dim (zeros past it)."""
    if buf._recipe.kind != "zeros":
        return {}
    shape, ends, d = tuple(buf.shape), {}, 0
    for it in _expand_index(T.__setitem__, index, len(shape)):
        if it is None:
            continue
        if isinstance(it, slice):
            start, stop, step = it.indices(shape[d])
            if start == 0 and step == 1 and stop < shape[d]:
                ends[d] = max(stop, 0)
        d += 1
    return ends


def _layout_for(buf: PendingTensor, index, value: DomainTensor):
    """The buffer's decomposition: its dims cut where ``value`` cuts the region
    (a value dim that broadcasts, of size 1, cuts nothing); none cut when the
    value cuts none either (a replicated value: one rank, axes of one process)."""
    shape = tuple(buf.shape)
    dims, region = _region_dims(index, shape)
    lead = len(dims) - value.ndim
    vdec = value._dec
    shard, sizes = {}, {}
    for k, axis in vdec.shard.items():
        r = k + lead
        if r < 0 or dims[r] is None or vdec.global_shape[k] != region[r]:
            continue
        b = dims[r]
        shard[b] = axis
        seen = buf._recipe.seen.get((shape[b], axis))
        if seen is not None and seen[0] is vdec.grid:
            sizes[b] = seen[1]
    if vdec.shard and not shard:
        raise _refusal(f"the written value ({layout.sharded_dims_text(vdec)}) is cut only "
                       f"along dims that the region {tuple(region)} broadcasts or does not have")
    return layout.derive(vdec, shape, shard, sizes)


def _refusal(why: str) -> UnsupportedOpError:
    return UnsupportedOpError(
        f"{op_name(T.__setitem__)}: a buffer made by a factory inside sharded_factories() "
        f"cannot take a layout from this write: {why}. Allocate it from a DomainTensor laid "
        f"out as the buffer should be, e.g. out = x_ft.new_zeros(shape, dtype=...)")


class ShardedFactories(TorchFunctionMode):
    """Local. The mode behind ``sharded_factories()``: factory calls on plain
    arguments give pending buffers; the layouts of the DomainTensors that the
    calls take (top-level arguments) and produce are remembered (per size and grid axis) to give buffers the
    same blocks."""

    def __init__(self):
        super().__init__()
        self.seen: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = _FACTORIES.get(func)
        if spec is not None and _plain_call(args, kwargs):
            return _pending(func, args, kwargs, spec, self.seen)
        for a in args:
            if _sharded(a):
                self._note(a._dec)
        out = func(*args, **kwargs)
        if _sharded(out):
            self._note(out._dec)
        return out

    def _note(self, dec) -> None:
        for d, axis in dec.shard.items():
            self.seen[(dec.global_shape[d], axis)] = (dec.grid, dec.block_sizes(d))


def _sharded(a) -> bool:
    """A DomainTensor that is no pending buffer (a spectrum in transit counts)."""
    return isinstance(a, DomainTensor) and not isinstance(a, PendingTensor)


def _plain_call(args, kwargs) -> bool:
    """Whether a factory call may be deferred: no DomainTensor or pending argument,
    no ``out=``, strided layout, no named dims."""
    if kwargs.get("out") is not None or kwargs.get("names") is not None:
        return False
    if kwargs.get("layout", torch.strided) is not torch.strided:
        return False
    return not (args and isinstance(args[0], DomainTensor))


def _pending(func, args, kwargs, spec, seen: dict) -> torch.Tensor:
    """Local. A PendingTensor for the factory call (torch parses its arguments on
    the meta device: shape, dtype, as the modes below this one leave them), or the
    call's plain result when it cannot be deferred (a size that does not parse, ...)."""
    kind, fill_at = spec
    meta_kwargs = {k: v for k, v in kwargs.items()
                   if k not in ("device", "pin_memory", "requires_grad")}
    try:  # through the modes below this one (their dtype choice is kept)
        meta = func(*args, **meta_kwargs, device="meta")
    except (TypeError, RuntimeError, ValueError):
        return func(*args, **kwargs)
    device = kwargs.get("device")
    if device is None:
        device = torch.get_default_device()
    fill = None
    if kind == "full":
        fill = kwargs["fill_value"] if "fill_value" in kwargs else args[fill_at]
    recipe = _Recipe(func, args, kwargs, kind, fill, meta.dtype, torch.device(device), seen)
    return PendingTensor(meta.shape, recipe)


@contextlib.contextmanager
def sharded_factories() -> Iterator[None]:
    """Local. A context in which factory buffers take the layout of the first
    DomainTensor written into them.

    Inside the block, ``torch.zeros``/``ones``/``full``/``empty`` called with a
    shape allocate nothing at first.
    ``out[index] = value`` with ``value`` a DomainTensor makes ``out`` a
    DomainTensor cut where ``value`` cuts the region (indices are global; each
    rank allocates its block, regions not written keep the fill); any other first
    use makes it the plain tensor one process has. ``DomainParallel`` runs every
    forward inside it, so spectral layers written as
    ``out = torch.zeros(...); out[..., :m1, :m2] = x_ft[..., :m1, :m2] @ w`` run
    unmodified.

    Yields
    ------
    None
        Use as ``with dp.sharded_factories(): ...`` on every rank alike.
    """
    with ShardedFactories():
        yield


__all__ = ["PendingTensor", "ShardedFactories", "sharded_factories"]
