"""Libraries that pick their array backend from the operand's type, and the one
torch op they reach that had no rule (``torch.tensordot``).

Measured on opt_einsum 3.4.0, tensorly 0.10.0 and einops 0.8.2 (constraints.txt):

- **opt_einsum** names the backend after the top-level module of the first
  operand's class (``contract.infer_backend``: ``type(x).__module__.split(".")[0]``),
  which for a DomainTensor is ``"domainpar"``; it then looks up
  ``domainpar.tensordot``, ``domainpar.transpose`` and ``domainpar.einsum``
  (``backends.dispatch.get_func``) and, finding no ``tensordot``, used to fall
  back to numpy (``np.tensordot`` -> ``Tensor.__array__``, refused). Its
  documented backend protocol ("any library that provides a numpy.tensordot and
  numpy.transpose implementation", backend detected from the first array) is
  what this module implements: the three functions below, with numpy's
  signatures and torch's semantics, re-exported lazily by ``domainpar``. So
  ``contract(eq, x, w)`` runs the torch ops on the DomainTensor, as does an
  explicit ``backend="torch"`` (opt_einsum then calls ``torch.tensordot``, which
  has the rule below) or ``backend="domainpar"``.
- **tensorly** dispatches on a global backend, not on the tensor's type: after
  ``tl.set_backend("pytorch")`` (neuraloperator does it on import) its functions
  call torch ops on DomainTensors. ``tensorly.plugins.use_opt_einsum`` (also
  turned on by neuraloperator's SpectralConv) routes ``tl.einsum`` through an
  opt_einsum ``contract_expression`` with automatic backend detection: the case
  above.
- **einops** picks its backend with ``isinstance(x, torch.Tensor)``, which a
  DomainTensor is: it takes the torch path without help, and each op it calls
  (reshape, permute, reductions, expand, repeat, einsum) meets its own rule or
  a clear UnsupportedOpError.

A contraction order chosen by opt_einsum depends only on the operands' global
shapes, which every rank has alike, so every rank runs the same pairwise
products. (``optimize="random-greedy"`` draws at random: seed it alike on every
rank, or use a deterministic optimizer.)
"""
from __future__ import annotations

import string

import torch

from ..tensor.dispatch import UnsupportedOpError, register
from .einsum import einsum as _einsum_rule


# -- opt_einsum's backend protocol (numpy signatures, torch semantics) ---------------------------
def einsum(equation, *operands, **kwargs):
    """Local or collective as ``torch.einsum`` on the operands. opt_einsum's backend
    hook: ``numpy.einsum(equation, *operands)``."""
    if kwargs.get("out") is not None:
        raise UnsupportedOpError("domainpar.einsum (opt_einsum's backend): out= is not "
                                 "supported; drop it and use the returned tensor")
    return torch.einsum(equation, *operands)


def tensordot(a, b, axes=2):
    """Local or collective as ``torch.tensordot`` (the rule below). opt_einsum's
    backend hook: ``numpy.tensordot(a, b, axes)``."""
    return torch.tensordot(a, b, dims=axes)


def transpose(a, axes=None):
    """Local or collective as ``Tensor.permute``. opt_einsum's backend hook:
    ``numpy.transpose(a, axes)`` (``None`` reverses the dims)."""
    return a.permute(*(range(a.ndim - 1, -1, -1) if axes is None else axes))


# -- torch.tensordot ----------------------------------------------------------------------------
def _refuse(why: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"torch.tensordot: {why}")


def _contracted(dims, na: int, nb: int) -> tuple[list[int], list[int]]:
    """The contracted dims of ``a`` and ``b``, paired, from tensordot's ``dims``."""
    if isinstance(dims, torch.Tensor):
        dims = dims.tolist()
    if isinstance(dims, int):
        if not 0 <= dims <= min(na, nb):
            raise _refuse(f"dims={dims} must be between 0 and {min(na, nb)}")
        return list(range(na - dims, na)), list(range(dims))
    if not isinstance(dims, (list, tuple)) or len(dims) != 2:
        raise _refuse(f"dims={dims!r}: expected an int or two lists of dims")
    da, db = ([d] if isinstance(d, int) else list(d) for d in dims)
    if len(da) != len(db):
        raise _refuse(f"dims={dims!r}: the two lists must have the same length")
    try:
        da, db = [d % na for d in da], [d % nb for d in db]
    except (TypeError, ZeroDivisionError):
        raise _refuse(f"dims={dims!r}: expected ints within the operands' dims") from None
    return da, db


def tensordot_equation(dims, na: int, nb: int) -> str:
    """Local. The einsum equation of ``torch.tensordot(a, b, dims)`` for ``a`` of
    ``na`` dims and ``b`` of ``nb``: a's free dims, then b's, in order."""
    da, db = _contracted(dims, na, nb)
    if na + nb - len(da) > len(string.ascii_letters):
        raise _refuse(f"{na} + {nb} dims need more einsum labels than there are letters")
    letters = iter(string.ascii_letters)
    a_labels = [next(letters) for _ in range(na)]
    pair = dict(zip(db, da))
    b_labels = [a_labels[pair[d]] if d in pair else next(letters) for d in range(nb)]
    out = [c for d, c in enumerate(a_labels) if d not in da]
    out += [c for d, c in enumerate(b_labels) if d not in pair]
    return f"{''.join(a_labels)},{''.join(b_labels)}->{''.join(out)}"


@register(torch.tensordot)
def tensordot_rule(func, args, kwargs):
    """As einsum (the same equation): local, collective when a contracted dim is
    sharded (allreduce of partial sums) or operands disagree (repartition). Every
    ``dims`` form (int, two lists, negative dims, a tensor); not ``out=``."""
    kwargs = dict(kwargs)
    if kwargs.pop("out", None) is not None:
        raise _refuse("out= is not supported on DomainTensors; drop it and use the result")
    a, b = args[:2]
    dims = args[2] if len(args) > 2 else kwargs.pop("dims", 2)
    if kwargs or len(args) > 3:
        raise _refuse(f"unexpected arguments {sorted(kwargs)}")
    equation = tensordot_equation(dims, a.ndim, b.ndim)
    try:
        return _einsum_rule(torch.einsum, (equation, a, b), {})
    except UnsupportedOpError as exc:
        raise _refuse(f"(as torch.einsum({equation!r}, a, b)) {exc}") from exc
