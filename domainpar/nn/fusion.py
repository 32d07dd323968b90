"""Halo fusion: one halo exchange for a chain of convolutions and pointwise ops.

Unfused, every conv of a chain fills its own halo (one neighbour-wise exchange
per conv, and its adjoint in backward). Fused, the chain's input gets one halo
as wide as the chain's combined reach along each sharded dim (the sum of the
convs' reaches along the longest path, residual branches included), and every
rank runs the plain torch modules on its extended block, computing the ghost
rings redundantly: each conv consumes its own reach of ghost cells, no padding
along the sharded dims, and the last one leaves exactly the rank's own block.

Exactness. Each local tensor holds the chain's intermediate value at a known
range of global cells. Before every zero-padded conv, the cells outside the
global domain are zeroed, which is what zero padding reads there; along a dim
on which the convs pad circularly, the exchange wraps around the domain and
nothing is zeroed (pointwise ops and circular convs keep a periodic extension
periodic). A binary op (a residual ``x + f(x)``) crops its operands to the
cells both hold. Parameters enter through ``tensor.params.enter_domain``, as in
``ops/conv.py``: their gradient is the sum of the ranks' partial gradients (or
DomainParallel's deferred sum); the input gradient comes back through the
halo fill's adjoint, the accumulate.

What fuses (a module traced by ``torch.fx``): one tensor input; ``nn.Conv1d``,
``Conv2d``, ``Conv3d`` with stride 1 and padding that keeps the size (``'same'``,
or ``dilation * (kernel - 1) / 2`` per side) along the sharded dims (anything
torch accepts along whole dims), any dilation and groups, padding mode
``zeros`` or ``circular`` (one of the two per sharded dim over the chain;
``reflect`` and ``replicate`` along whole dims only); pointwise activation
modules, ``Identity``, dropout in eval mode (or ``p=0``), and the pointwise
functions and methods in ``_FUNCTIONS``/``_METHODS``, residual adds included.
Not: norms, pooling, strides, transposed convs, anything with a parameter
other than a conv's, attribute reads (``get_attr``), data-dependent control flow.
"""
from __future__ import annotations

import dataclasses
import operator
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from .. import autograd as ag
from ..comm.errors import agree, signature_of
from ..comm.runtime import switch
from ..ops import window
from ..ops.common import autocast_operands
from ..ops.conv import ConvSpec, halo_conv, padding_pairs  # the unfused conv's path, no halo
from ..tensor.dispatch import UnsupportedOpError
from ..tensor.domain_tensor import DomainTensor
from ..tensor.params import enter_domain

_CONVS = {torch.nn.Conv1d: F.conv1d, torch.nn.Conv2d: F.conv2d, torch.nn.Conv3d: F.conv3d}
_POINTWISE = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.CELU,
              torch.nn.SELU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Mish, torch.nn.Sigmoid,
              torch.nn.Tanh, torch.nn.Softplus, torch.nn.Hardtanh, torch.nn.Hardswish,
              torch.nn.Hardsigmoid, torch.nn.Tanhshrink, torch.nn.Identity)
_DROPOUT = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
            torch.nn.AlphaDropout)
_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
              torch.add, torch.sub, torch.mul, torch.relu, torch.sigmoid, torch.tanh,
              F.relu, F.gelu, F.silu, F.leaky_relu, F.elu, F.mish, F.hardtanh, F.softplus}
_TRACE_ERRORS = (torch.fx.proxy.TraceError, TypeError, AttributeError, NotImplementedError,
                 ValueError, RuntimeError)
_METHODS = {"relu", "sigmoid", "tanh", "add", "sub", "mul", "neg", "contiguous", "clone"}


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A reference to the value of step ``index`` inside a step's arguments."""
    index: int


@dataclasses.dataclass(frozen=True)
class _Step:
    """One node of the traced graph: ``op`` is 'input', 'conv', 'module' (a
    pointwise module), 'function', 'method' or 'output'."""
    op: str
    target: Any
    args: tuple
    kwargs: tuple


@dataclasses.dataclass(frozen=True)
class Chain:
    """Local. A module's traced graph, checked for fusion; the modules are looked
    up by name at run time, so a deep copy of the module runs on its own."""
    steps: tuple[_Step, ...]
    convs: int        # convolutions with a reach > 0 along some spatial dim


def _refuse(what: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"halo fusion: {what}")


def trace(module: torch.nn.Module) -> Chain:
    """Local (the same on every rank for the same module). ``module``'s graph as a
    ``Chain``; UnsupportedOpError naming the first thing that cannot fuse."""
    try:
        graph = torch.fx.symbolic_trace(module).graph
    except _TRACE_ERRORS as exc:
        raise _refuse(f"{type(module).__name__} cannot be traced by torch.fx ({exc})") from exc
    graph.eliminate_dead_code()
    index: dict[torch.fx.Node, int] = {}
    steps: list[_Step] = []
    convs = 0

    def ref(a):
        return torch.fx.node.map_arg(a, lambda n: _Ref(index[n]))  # type: ignore[arg-type,return-value]

    for node in graph.nodes:
        op, target = _classify(module, node)
        if op == "output" and not isinstance(node.args[0], torch.fx.Node):
            raise _refuse("a fused module returns one tensor")
        if op == "input" and any(s.op == "input" for s in steps):
            raise _refuse("a fused module takes one tensor input")
        if op == "conv":
            convs += _reaches(module.get_submodule(node.target))
        index[node] = len(steps)
        steps.append(_Step(op, target, ref(node.args), tuple(ref(dict(node.kwargs)).items())))
    return Chain(tuple(steps), convs)


def _classify(module: torch.nn.Module, node: torch.fx.Node) -> tuple[str, Any]:
    if node.op in ("placeholder", "output"):
        return ("input" if node.op == "placeholder" else "output"), None
    if node.op == "call_module":
        sub: Any = module.get_submodule(str(node.target))
        if type(sub) in _CONVS:
            if any(s != 1 for s in sub.stride):
                raise _refuse(f"{node.target} ({sub}): stride {sub.stride}; only stride 1 fuses")
            return "conv", node.target
        if isinstance(sub, _POINTWISE + _DROPOUT):
            return "module", node.target
        raise _refuse(f"{node.target} ({type(sub).__name__}) is not a conv or a pointwise module")
    if node.op == "call_function" and node.target in _FUNCTIONS:
        return "function", node.target
    if node.op == "call_method" and node.target in _METHODS:
        return "method", node.target
    raise _refuse(f"{node.op} {getattr(node.target, '__name__', node.target)!r} is not "
                  f"pointwise (fuses: convs, pointwise modules, functions and methods)")


# -- the plan for one layout -------------------------------------------------------------
def _pads(conv: Any) -> list[tuple[int, int]]:
    """(lo, hi) per spatial dim, as torch resolves the conv's padding."""
    return padding_pairs(conv.padding, conv.kernel_size, conv.dilation, len(conv.kernel_size))


def _conv_wraps(name: str, conv: Any, sharded: Sequence[int],
                wraps: dict[int, bool]) -> None:
    """Check the conv along the sharded dims; record whether each wraps."""
    pads = _pads(conv)
    for d in sharded:
        lo, hi = pads[d - 2]
        reach = conv.dilation[d - 2] * (conv.kernel_size[d - 2] - 1)
        if lo + hi != reach:
            raise _refuse(f"{name} ({conv}) pads dim {d} by {(lo, hi)}, which does not keep its "
                          f"size; along a sharded dim a fused conv must (padding='same')")
        if reach == 0:
            continue
        if conv.padding_mode not in ("zeros", "circular"):
            raise _refuse(f"{name}: padding_mode {conv.padding_mode!r} along the sharded dim {d}; "
                          f"fused convs pad sharded dims with zeros or circularly")
        wrap = conv.padding_mode == "circular"
        if wraps.setdefault(d, wrap) != wrap:
            raise _refuse(f"the chain pads the sharded dim {d} both with zeros and circularly")


def plan(module: torch.nn.Module, chain: Chain, sharded: Sequence[int]):
    """Local. ``(widths, wraps)`` for the sharded spatial dims ``sharded``: the
    ghost cells ``{dim: (lo, hi)}`` the chain consumes along its deepest path,
    and whether each dim's exchange wraps. UnsupportedOpError if it cannot fuse."""
    wraps: dict[int, bool] = {}
    margins: list[dict[int, tuple[int, int]]] = []
    for step in chain.steps:
        inputs = [margins[r.index] for r in _refs(step)]
        m = {d: (min(x[d][0] for x in inputs), min(x[d][1] for x in inputs)) if inputs
             else (0, 0) for d in sharded}
        if step.op == "conv":
            conv: Any = module.get_submodule(step.target)
            _conv_wraps(step.target, conv, sharded, wraps)
            pads = _pads(conv)
            m = {d: (m[d][0] - pads[d - 2][0], m[d][1] - pads[d - 2][1]) for d in sharded}
        margins.append(m)
    final = margins[-1]
    return {d: (-final[d][0], -final[d][1]) for d in sharded}, wraps


def _refs(step: _Step) -> list[_Ref]:
    found: list[_Ref] = []
    torch.fx.node.map_aggregate((step.args, step.kwargs),
                                lambda a: found.append(a) if isinstance(a, _Ref) else None)
    return found


def _check_dropout(module: torch.nn.Module, chain: Chain) -> None:
    for step in chain.steps:
        sub: Any = module.get_submodule(step.target) if step.op == "module" else None
        if isinstance(sub, _DROPOUT) and sub.training and sub.p > 0:
            raise _refuse(f"{step.target} ({sub}) in training mode: its random mask on the ghost "
                          f"cells would differ from the owners'; call .eval() or leave it unfused")


# -- running a chain on a DomainTensor ---------------------------------------------------
class Fusion:
    """Local. What ``fused`` attaches to a module: its chain, whether a module that
    cannot fuse on some input is refused (``strict``) or run unfused, and the
    plans and output shapes derived so far (per layout)."""

    def __init__(self, chain: Chain, strict: bool):
        self.chain, self.strict = chain, strict
        self._plans: dict[tuple[int, ...], tuple] = {}
        self._shapes: dict[tuple, tuple[int, ...]] = {}

    def prepare(self, module: torch.nn.Module, x: DomainTensor):
        """Local. ``(widths, wraps, out_shape)`` for ``x``; UnsupportedOpError if
        the chain cannot fuse on it. Derived from the layout alone (no message)."""
        dec = x._dec
        if x.ndim < 3 or 1 in dec.shard:
            raise _refuse(f"the input needs whole channels and a batch dim (N, C, spatial...), "
                          f"got {x.ndim} dims sharded along {sorted(dec.shard)}")
        _check_dropout(module, self.chain)
        sharded = tuple(d for d in range(2, x.ndim) if d in dec.shard)
        if sharded not in self._plans:
            self._plans[sharded] = plan(module, self.chain, sharded)
        key = (tuple(x.shape), x.dtype)
        if key not in self._shapes:
            self._shapes[key] = _out_shape(module, x)
        widths, wraps = self._plans[sharded]
        return widths, wraps, self._shapes[key]


def _out_shape(module: torch.nn.Module, x: DomainTensor) -> tuple[int, ...]:
    """torch's own checks and output shape, on the meta device from the global
    shape (the same error on every rank)."""
    # (no torch-function modes: DomainParallel's sharded_factories would defer the factories)
    with torch.no_grad(), torch._C.DisableTorchFunction():
        meta = {n: torch.empty_like(t, device="meta")
                for n, t in list(module.named_parameters()) + list(module.named_buffers())}
        out = torch.func.functional_call(module, meta, (torch.empty(x.shape, dtype=x.dtype,
                                                                    device="meta"),))
    if out.ndim != x.ndim or any(out.shape[d] != x.shape[d] for d in x._dec.shard):
        raise _refuse(f"the output {tuple(out.shape)} is not laid out like the input "
                      f"{tuple(x.shape)} along its sharded dims {sorted(x._dec.shard)}")
    return tuple(out.shape)


def run(module: torch.nn.Module, fusion: Fusion, x: DomainTensor) -> DomainTensor:
    """Neighbour-wise collective (one halo fill; backward: its accumulate, and the
    parameters' gradient sums). ``module`` on ``x`` with one exchange."""
    widths, wraps, out_shape = fusion.prepare(module, x)
    dec = x._dec
    out_dec = window.out_layout(dec, out_shape)
    ext = _extend(x, widths, wraps)
    entered: dict[str, tuple] = {}
    for step in fusion.chain.steps:
        if step.op == "conv" and step.target not in entered:
            conv: Any = module.get_submodule(step.target)
            entered[step.target] = tuple(None if p is None else enter_domain(p, out_dec, {})
                                         for p in (conv.weight, conv.bias))
    if 0 in dec.local_shape():
        sources = [p for wb in entered.values() for p in wb if p is not None]
        return DomainTensor(window.placeholder(out_dec.local_shape(), ext, ext, *sources), out_dec)
    env: list[tuple[torch.Tensor, dict[int, tuple[int, int]]]] = []
    for step in fusion.chain.steps:
        if step.op == "input":
            env.append((ext, dict(widths)))
        elif step.op == "output":
            out, _ = env[step.args[0].index]
            return DomainTensor(out, out_dec)
        elif step.op == "conv":
            t, m = env[step.args[0].index]
            if step.args[0].index != 0:  # (the filled input is zero outside the domain)
                t = _zero_outside(t, m, dec, wraps)
            conv = module.get_submodule(step.target)
            env.append(_conv(conv, entered[step.target], t, m))
        else:
            env.append(_pointwise(module, step, env))
    raise AssertionError("a traced graph ends with its output")


def _extend(x: DomainTensor, widths: Mapping[int, tuple[int, int]],
            wraps: Mapping[int, bool]) -> torch.Tensor:
    """Neighbour-wise collective. ``x``'s block with ``widths`` ghost cells filled
    (wrapped along the dims of ``wraps``, zero outside the domain elsewhere)."""
    dec, local = x._dec, x._local
    widths = {d: w for d, w in widths.items() if w[0] or w[1]}
    if not widths:
        return local
    pads: list[int] = []
    for d in reversed(range(local.ndim)):
        pads += list(widths.get(d, (0, 0)))
    exchange = window.exchange(dec, widths, {d: wraps.get(d, False) for d in dec.shard})
    return ag.halo_fill(F.pad(local, pads), exchange, owned=True)


def _conv(conv: Any, wb: tuple, t: torch.Tensor,
          m: dict[int, tuple[int, int]]) -> tuple[torch.Tensor, dict[int, tuple[int, int]]]:
    """Local. One conv on the extended block ``t`` holding ``m`` ghost cells per
    sharded dim: no padding along those, the conv's own along whole dims. Runs
    the unfused conv's Function with no halo (its local kernel choice, its
    backward in pieces)."""
    pads = _pads(conv)
    whole = [(0, 0) if d in m else pads[d - 2] for d in range(2, t.ndim)]
    if conv.padding_mode == "zeros" and all(lo == hi for lo, hi in whole):
        torch_pads = tuple(lo for lo, _ in whole)
    else:
        torch_pads = (0,) * len(whole)
        if any(lo or hi for lo, hi in whole):
            mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
            t = F.pad(t, [p for lo_hi in reversed(whole) for p in lo_hi], mode=mode)
    t, w, b = autocast_operands(t, *wb)
    spatial = [t.shape[d] + 2 * p - conv.dilation[d - 2] * (conv.kernel_size[d - 2] - 1)
               for d, p in zip(range(2, t.ndim), torch_pads)]
    spec = ConvSpec.no_halo(_CONVS[type(conv)], torch_pads, tuple(conv.dilation), conv.groups,
                            (t.shape[0], conv.out_channels, *spatial))
    out = halo_conv(t, w, b, None, spec)
    return out, {d: (lo - pads[d - 2][0], hi - pads[d - 2][1]) for d, (lo, hi) in m.items()}


def _zero_outside(t: torch.Tensor, m: Mapping[int, tuple[int, int]], dec,
                  wraps: Mapping[int, bool]) -> torch.Tensor:
    """Local. ``t`` (``m`` ghost cells per sharded dim) with the cells outside the
    global domain zeroed, along the dims that do not wrap: what zero padding reads."""
    mask = None
    for d, (lo, _) in m.items():
        if wraps.get(d, False):
            continue
        start, n, length = dec.offsets()[d] - lo, dec.global_shape[d], t.shape[d]
        below, above = min(max(-start, 0), length), min(max(start + length - n, 0), length)
        if not (below or above):
            continue
        keep = torch.ones(length, dtype=t.dtype, device=t.device)
        keep[:below] = 0
        keep[length - above:] = 0
        shape = [1] * t.ndim
        shape[d] = length
        mask = keep.view(shape) if mask is None else mask * keep.view(shape)
    return t if mask is None else t * mask


def _pointwise(module: torch.nn.Module, step: _Step, env: list) -> tuple:
    """Local. A pointwise module, function or method; tensor operands cropped to
    the ghost cells all of them hold."""
    refs = _refs(step)
    margins = [env[r.index][1] for r in refs]
    common = {d: (min(x[d][0] for x in margins), min(x[d][1] for x in margins))
              for d in margins[0]} if margins else {}

    def value(a):
        if not isinstance(a, _Ref):
            return a
        t, m = env[a.index]
        for d, (lo, hi) in common.items():
            if m[d] != (lo, hi):
                t = t.narrow(d, m[d][0] - lo, t.shape[d] - (m[d][0] - lo) - (m[d][1] - hi))
        return t

    args = torch.fx.node.map_aggregate(step.args, value)
    kwargs = dict(torch.fx.node.map_aggregate(step.kwargs, value))
    if step.op == "module":
        out = module.get_submodule(step.target)(*args, **kwargs)
    elif step.op == "function":
        out = step.target(*args, **kwargs)
    else:
        out = getattr(args[0], step.target)(*args[1:], **kwargs)
    return out, common


# -- marking modules ---------------------------------------------------------------------
def fused(module: torch.nn.Module, *, strict: bool = True) -> torch.nn.Module:
    """Local (the trace; the marked forward is a neighbour-wise collective). Mark
    ``module`` for halo fusion: on a DomainTensor its forward fills one halo as
    wide as the chain's combined reach and computes the ghost rings redundantly
    (docs/fusion.md); on anything else it is the module's own forward.

    Parameters
    ----------
    module : torch.nn.Module
        Traceable by ``torch.fx``: one tensor input and output; stride-1 convs
        that keep the size of the sharded dims, pointwise modules, functions
        and methods (residual adds included).
    strict : bool, default True
        Refuse an input the chain cannot fuse on (below); False runs the module
        unfused on it instead (DomainParallel's ``fuse_halos``).

    Returns
    -------
    torch.nn.Module
        ``module`` itself, marked in place: its type, parameter names and
        state dict are unchanged.

    Raises
    ------
    UnsupportedOpError
        The same on every rank (it depends on the module and the input's layout
        only): here for a module that does not trace or holds anything else
        (norms, pooling, strides, transposed convs); at forward for a sharded
        channel dim, a conv that changes the size of a sharded dim, reflect,
        replicate or mixed zero and circular padding along one, dropout in
        training mode.
    """
    return _mark(module, trace(module), strict)


def _mark(module: torch.nn.Module, chain: Chain, strict: bool) -> torch.nn.Module:
    setattr(module, "_domainpar_fusion", Fusion(chain, strict))  # noqa: B010 (a plain attribute)
    setattr(module, "forward", types.MethodType(_fused_forward, module))  # noqa: B010
    return module


def _fused_forward(self: torch.nn.Module, *args, **kwargs):
    fusion: Fusion = getattr(self, "_domainpar_fusion")  # noqa: B009
    if len(args) != 1 or kwargs or not isinstance(args[0], DomainTensor):
        return type(self).forward(self, *args, **kwargs)
    if not fusion.strict:
        try:
            fusion.prepare(self, args[0])
        except UnsupportedOpError:
            return type(self).forward(self, *args)
    return run(self, fusion, args[0])


def fuse_chains(module: torch.nn.Module) -> list[str]:
    """Local. Mark (``fused(..., strict=False)``) every block in ``module`` that
    fuses: an ``nn.Sequential`` or a module of the user's (a residual block)
    whose modules are all convs and pointwise modules, two or more of the convs
    reaching past their cell; outermost first, not inside one marked. Only such
    blocks are traced. Returns their names."""
    marked: list[str] = []
    for name, sub in module.named_modules():
        inside = any(name == p or name.startswith(p + ".") or p == "" for p in marked)
        if inside or not _candidate(sub) or hasattr(sub, "_domainpar_fusion"):
            continue
        try:
            chain = trace(sub)
        except UnsupportedOpError:
            continue
        if chain.convs >= 2:
            _mark(sub, chain, strict=False)
            marked.append(name)
    return marked


def _candidate(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds modules, all of them containers, convs or pointwise
    modules, with two or more convs that reach past their cell."""
    leaves = [m for m in module.modules() if not list(m.children())]
    if not leaves or leaves[0] is module:
        return False
    if not all(type(m) in _CONVS or isinstance(m, _POINTWISE + _DROPOUT) for m in leaves):
        return False
    return sum(type(m) in _CONVS and _reaches(m) for m in leaves) >= 2


def _reaches(conv: Any) -> bool:
    """Whether the conv reads cells other than its output's own along some dim."""
    return any(d * (k - 1) for k, d in zip(conv.kernel_size, conv.dilation))


def fuse_for(module: torch.nn.Module, fuse_halos: bool | None, comm) -> list[str]:
    """Collective over ``comm`` (one small allreduce). DomainParallel's
    ``fuse_halos``: None reads ``DOMAINPAR_FUSE_HALOS`` (``1`` fuses; unset or
    ``0`` does not); True marks the chains ``fuse_chains`` finds. The marked
    names are agreed over ``comm`` (a difference, say in the environment, is a
    MismatchError on every rank), so every rank exchanges alike."""
    if fuse_halos is None:
        value, problem = switch("DOMAINPAR_FUSE_HALOS")
        fuse_halos = value == "1"
    else:
        problem = None
    marked = fuse_chains(module) if fuse_halos and problem is None else []
    agree(comm, problem, signature=signature_of(marked), what="the halo-fused chains",
          described=marked)
    return marked
