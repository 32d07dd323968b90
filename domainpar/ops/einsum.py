"""torch.einsum with DomainTensor and plain (replicated) operands.

Every label of the equation names one dim of the iteration space; a label is
*sharded* when a DomainTensor operand shards a dim with that label. The rule:

- A sharded label that the output keeps stays sharded there, on the same grid
  axis with the same block sizes.
- Plain operands with a sharded label are cut to the block along it
  (``tensor.params.enter_domain``): their gradient is assembled over the ranks
  that hold the blocks and summed over the grid axes along which they are
  broadcast; a DomainTensor operand that lacks a sharded label is broadcast
  along its axis in the same way.
- A sharded label that is summed over (contracted) is summed in two stages:
  each rank contracts its block, then the partial results are summed over the
  label's grid axis (``ag.allreduce_sum``: the result is replicated along that
  axis, and its backward is the identity). This moves only the output, which
  for a sum over a sharded dim (an inner product, a projection of a field onto
  a few modes) is much smaller than the operands; repartitioning the operands
  to make the label whole would move them instead and leave whole dims on
  every rank. An output with no sharded dim left is a plain tensor replicated
  on every rank, like a global reduction's.
- A dim sharded over a grid axis of one rank is whole: it counts as unsharded.
- Two DomainTensor operands sharded on the same label must agree: the later
  one is repartitioned onto the first one's axis and block sizes.
- Two labels of two operands sharded over the same grid axis (attention scores
  ``einsum("bxd,byd->bxy", q, k)`` or ``q @ k.mT`` with both sequences sharded,
  then ``scores @ v``): one operand is gathered along that axis (its dim made
  whole there: ``ag.repartition`` to the layout without the cut, an allgatherv
  among the ranks of the axis, then ``ag.broadcast``, so that the adjoint sums
  the ranks' gradients of the whole operand and each owner keeps its block: a
  reduce-scatter), and the product is local; the result is sharded like the
  operand that stayed sharded. Which one: where one label is contracted and the
  other kept (``scores @ v``: v's sequence is summed over), the operand with the
  contracted label, so that the output stays sharded and needs no allreduce;
  otherwise the smaller operand by global element count (ties: the second).
  Memory per rank: the kept operand's block, the gathered operand whole (O(T)
  for k or v) and a scores block of the kept operand's rows by the gathered
  operand's whole sequence: at most ceil(T/P) x T for self-attention on T tokens
  over P ranks with balanced blocks (the largest block's rows on uneven ones;
  T_q/P x T_k or T_q x T_k/P for cross-attention); the gather moves the smaller
  operand, never the scores. Then ``softmax(dim=-1)`` on scores sharded on the
  queries is local, and ``scores @ v`` gathers v: the attention's output is
  sharded on the queries like q.

Refused (UnsupportedOpError on every rank): a label repeated within one operand
(a diagonal) and sharded; a sharded dim of size 1 that broadcasts against a
larger one; a repartition that would replicate an operand along an axis it was
sharded on to match another operand that shards the same label over another
axis. ``contract`` serves matmul and bmm of DomainTensors too
(``ops.linear``). torch turns the sublist form into an equation before the rule
sees the call.
"""
from __future__ import annotations

import dataclasses
import math
import string

import torch

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, op_name, register, same_grid
from ..tensor.domain_tensor import DomainTensor
from ..tensor.params import enter_domain
from .common import autocast_dtype, meta


def _explicit(equation: str, ndims) -> tuple[list[str], str]:
    """Input terms and output term with the ellipsis spelt out as labels (right-aligned,
    as torch broadcasts it) and an implicit output made explicit."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    used = set(c for c in equation if c.isalpha())
    spare = [c for c in string.ascii_letters if c not in used]
    widths = [n - len(t.replace("...", "")) if "..." in t else 0 for t, n in zip(terms, ndims)]
    width = max(widths, default=0)
    ell = "".join(spare[:width])
    terms = [t.replace("...", ell[width - w:]) for t, w in zip(terms, widths)]
    if arrow:
        out = rhs.replace("...", ell)
    else:
        counts = {c: "".join(terms).count(c) for c in set("".join(terms))}
        out = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    return terms, out


def _refuse(func, equation: str, why: str) -> UnsupportedOpError:
    """The refusal of ``func``: an einsum names itself; another product computed as an
    einsum (matmul, bmm) also names the equation, whose labels the messages use."""
    name = op_name(func) if func is torch.einsum else \
        f"{op_name(func)} (computed as torch.einsum({equation!r}))"
    return UnsupportedOpError(f"{name}: {why}")


@register(torch.einsum)
def einsum(func, args, kwargs):
    """Local, collective when a contracted label is sharded (allreduce of partial sums),
    operands disagree (repartition) or two operands' labels share a grid axis: then
    one operand is gathered along it (allgatherv; adjoint: the ranks' gradients
    summed back to the owners), the one whose label is contracted, else the smaller
    (ties: the second), so attention scores with both sequences sharded take
    ceil(T/P) x T per rank plus the gathered k or v. String equations with ellipsis
    and broadcasting; sharded labels stay sharded in the output; plain operands are
    sliced to the block."""
    if kwargs or not args or not isinstance(args[0], str):
        raise UnsupportedOpError(f"{op_name(func)}: expected torch.einsum(equation, *operands)")
    equation, operands = args[0], list(args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    return contract(func, equation, operands)


def contract(func, equation: str, operands: list):
    """Collective where a contracted label is sharded, operands disagree or labels of
    two operands share a grid axis, local otherwise. ``torch.einsum(equation,
    *operands)`` by the rule of this module, for ``func`` (einsum itself, or a product
    such as matmul written as an einsum: errors then name ``func`` and the equation).
    Its plan (``_contract_plan``) is made once per equation and operand layouts."""
    key = _plan_key(func, equation, operands)
    make = lambda: _contract_plan(func, equation, operands)  # noqa: E731
    plan = make() if key is None else layout.planned(key, make)
    grid = next(t for t in operands if isinstance(t, DomainTensor))._dec.grid
    operands = list(operands)
    for i, d in plan.gathers:  # two labels on one axis: one operand made whole along it
        operands[i] = _gathered(operands[i], d)
    locals_ = []
    for t, entry in zip(operands, plan.entries):
        if not isinstance(t, DomainTensor):
            locals_.append(enter_domain(t, plan.space, entry))
            continue
        target, broadcast = entry
        local = ag.repartition(t._local, t._dec, target)
        if broadcast and local.requires_grad and torch.is_grad_enabled():
            local = ag.broadcast(local, grid.sub(broadcast))
        locals_.append(local)
    out = torch.einsum(plan.explicit, *locals_)
    if plan.contracted:
        out = ag.allreduce_sum(out, grid.sub(plan.contracted))
    return out if plan.out_dec is None else DomainTensor(out, plan.out_dec)


def _plan_key(func, equation: str, operands: list):
    """Local. What a contraction's plan depends on: the equation and, per operand,
    its layout (a DomainTensor) or shape (a plain tensor), dtype and autocast dtype
    (which the meta checks see); None (no caching) for an operand that is no tensor."""
    if not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    return ("einsum", func, equation, tuple(
        (t._dec if isinstance(t, DomainTensor) else tuple(t.shape), t.dtype,
         autocast_dtype(t) if t.is_floating_point() else None) for t in operands))


@dataclasses.dataclass(frozen=True)
class _ContractPlan:
    """What a contraction derives from layouts alone: the equation spelt out, the
    operands to gather first ((operand, dim), in order), the iteration space's
    layout, per operand its entry (a plain operand: ``{dim: space dim}`` it is cut
    along; a DomainTensor: its target layout and the grid axes it is broadcast
    along), the grid axes summed over, and the output layout (None: a plain tensor)."""
    explicit: str
    gathers: tuple
    space: Decomposition
    entries: tuple
    contracted: frozenset
    out_dec: Decomposition | None


def _contract_plan(func, equation: str, operands: list) -> _ContractPlan:
    """Local, no message. ``contract``'s plan, with torch's own checks on the meta
    device and this module's refusals (the same on every rank: layouts only)."""
    dts = [t for t in operands if isinstance(t, DomainTensor)]
    same_grid(func, dts)
    metas = [meta(t) for t in operands]
    out_shape = tuple(torch.einsum(equation, *metas).shape)  # torch's own checks
    terms, out_term = _explicit(equation, [t.ndim for t in operands])
    explicit = ",".join(terms) + "->" + out_term
    if tuple(torch.einsum(explicit, *metas).shape) != out_shape:
        raise _refuse(func, equation,
                      f"internal: {equation!r} read as {explicit!r} gives another shape")

    size: dict[str, int] = {}
    for term, t in zip(terms, operands):
        for c, n in zip(term, t.shape):
            size[c] = max(size.get(c, 1), n)
    decs: list[Decomposition | None] = [t._dec if isinstance(t, DomainTensor) else None
                                        for t in operands]
    shapes = [tuple(t.shape) for t in operands]
    gathers = []
    sharded, clash = _sharded_labels(func, equation, terms, decs, shapes, size)
    while clash is not None:  # two labels on one axis: gather one operand, look again
        i, d = _to_gather(clash, out_term, decs, shapes)
        gathers.append((i, d))
        gathered = decs[i]
        assert gathered is not None  # _sharded_labels names DomainTensors only
        decs[i] = layout.unsharded(gathered, [d])
        sharded, clash = _sharded_labels(func, equation, terms, decs, shapes, size)

    lead = dts[0]._dec
    labels = sorted(size)
    space = layout.derive(lead, [size[c] for c in labels],
                          {labels.index(c): a for c, (a, _) in sharded.items()},
                          {labels.index(c): s for c, (_, s) in sharded.items()})
    all_axes = {a for a, _ in sharded.values()}
    entries: list = []
    for term, dec, shape in zip(terms, decs, shapes):
        dims = {d: c for d, c in enumerate(term) if c in sharded and shape[d] == size[c]}
        if dec is None:
            entries.append({d: labels.index(c) for d, c in dims.items()})
            continue
        target = layout.derive(dec, shape, {d: sharded[c][0] for d, c in dims.items()},
                               {d: sharded[c][1] for d, c in dims.items()})
        lost = ({a for a in dec.shard.values() if dec.grid.dims[a] > 1}
                - set(target.shard.values()))
        if lost:
            raise _refuse(func, equation,
                          f"an operand sharded on {layout.sharded_dims_text(dec)} would have "
                          f"to be gathered along grid axes {sorted(lost)} to match the other "
                          f"operands' labels; redistribute it")
        entries.append((target, frozenset(all_axes - set(target.shard.values()))))
    contracted = frozenset(a for c, (a, _) in sharded.items() if c not in out_term)
    kept = {d: c for d, c in enumerate(out_term) if c in sharded}
    out_dec = None if contracted and not kept else layout.derive(
        lead, out_shape, {d: sharded[c][0] for d, c in kept.items()},
        {d: sharded[c][1] for d, c in kept.items()})
    return _ContractPlan(explicit, tuple(gathers), space, tuple(entries), contracted, out_dec)


def _sharded_labels(func, equation: str, terms, decs, shapes, size):
    """Local. ``({label: (grid axis, block sizes)}, clash)``, the first DomainTensor's
    say per label (``decs``: each operand's layout, None for a plain one; ``shapes``:
    their global shapes); ``clash`` is None, or ``((label, operand), (label, operand),
    axis)``: the first two labels of two operands found sharded over one grid axis."""
    sharded: dict[str, tuple[int, tuple[int, ...]]] = {}  # label -> (axis, block sizes)
    owner: dict[int, tuple[str, int]] = {}  # axis -> (label, operand)
    for i, (term, dec, shape) in enumerate(zip(terms, decs, shapes)):
        if dec is None:
            continue
        for d, axis in dec.shard.items():
            c = term[d]
            if dec.grid.dims[axis] == 1:
                continue  # one rank along the axis: the dim is whole, not cut
            if shape[d] != size[c]:
                raise _refuse(func, equation,
                              f"dim {d} of an operand is sharded "
                              f"({layout.sharded_dims_text(dec)}) but has size {shape[d]} "
                              f"and broadcasts against label {c!r} of size {size[c]}")
            if term.count(c) > 1:
                raise _refuse(func, equation, f"label {c!r} is repeated in {term!r} (a diagonal) "
                                              f"and sharded; redistribute so that it is not")
            if c in sharded:
                continue
            if axis in owner:
                return sharded, (owner[axis], (c, i), axis)
            sharded[c], owner[axis] = (axis, dec.block_sizes(d)), (c, i)
    return sharded, None


def _to_gather(clash, out_term: str, decs, shapes) -> tuple[int, int]:
    """Local. (operand, dim) to gather for ``clash`` (``_sharded_labels``), by the rule of
    this module: the operand whose label is contracted where the other label is kept,
    else the smaller by global element count (ties: the second)."""
    (first, i), (second, j), axis = clash
    kept_first, kept_second = first in out_term, second in out_term
    if kept_first != kept_second:
        pick = j if kept_first else i
    else:
        pick = i if math.prod(shapes[i]) < math.prod(shapes[j]) else j
    return pick, next(d for d, a in decs[pick].shard.items() if a == axis)


def _gathered(t: DomainTensor, d: int) -> DomainTensor:
    """Collective over the grid axis that cuts dim ``d`` (an allgatherv among its ranks).
    ``t`` with dim ``d`` whole on every rank, replicated along that axis; the caller
    broadcasts it into per-rank work, so that backward sums the ranks' gradients."""
    whole = layout.unsharded(t._dec, [d])
    return DomainTensor(ag.repartition(t._local, t._dec, whole), whole)
