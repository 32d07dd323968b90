"""Public helpers for users who add ops: a dot-product adjoint test for linear
distributed maps, and a comparison of a model on sharded inputs with the same
model run by one process on the whole tensors (the oracle, docs/design.md)."""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..comm.decomposition import Decomposition
from ..comm.grid import ProcessGrid
from ..tensor.domain_tensor import DomainTensor
from .adjoint import adjoint_terms, global_dot

# Default tolerances (relative, absolute) per dtype: docs/design.md's oracle.
TOLERANCES = {torch.float64: (1e-10, 1e-12), torch.complex128: (1e-10, 1e-12),
              torch.float32: (1e-5, 1e-6), torch.complex64: (1e-5, 1e-6)}


# -- inner products over a space ----------------------------------------------------------------
def _space_of(value, space):
    if space is not None or not isinstance(value, DomainTensor):
        return space
    return value.decomposition


def _local(value) -> torch.Tensor:
    return value.to_local() if isinstance(value, DomainTensor) else value


def _comm_of(space):
    """The communicator that sums inner products over ``space`` (see ``inner``)."""
    if isinstance(space, Decomposition):
        return space.grid.sub(space.shard.values())
    return space


def _array(value):
    """This rank's block of ``value`` as a numpy array, widened to 64 bits."""
    t = _local(value).detach().cpu()
    return t.to(torch.complex128 if t.is_complex() else torch.float64).numpy()


def inner(a, b, space=None) -> float:
    """Collective for distributed spaces. <a, b> (real part) over ``space``:

    - None: a value replicated on every rank, counted once;
    - a Decomposition: blocks of that layout, summed over the ranks that hold
      distinct blocks (replicas counted once);
    - an MPI communicator: per-rank values summed over it (for example a tensor
      that lives on one root and is empty elsewhere).
    DomainTensors default to their own decomposition. (``adjoint.global_dot``
    on the blocks.)
    """
    return global_dot(_array(a), _array(b), _comm_of(_space_of(a, space)))


def _random_like(value, space, seed: int, rank: int) -> Any:
    local = _local(value)
    g = torch.Generator().manual_seed(seed if space is None else seed * 7919 + 1 + rank)
    r = torch.randn(local.shape, generator=g, dtype=torch.float64)
    if local.is_complex():
        r = torch.complex(r, torch.randn(local.shape, generator=g, dtype=torch.float64))
    r = r.to(dtype=local.dtype, device=local.device)
    return DomainTensor(r, value.decomposition) if isinstance(value, DomainTensor) else r


def adjoint_test(forward: Callable, x, *, adjoint: Callable | None = None, x_space=None,
                 y_space=None, rtol: float | None = None, seed: int = 0) -> float:
    """Collective. Dot-product test of a linear map F (``forward``) and its adjoint:
    ``|<F x, y> - <x, F* y>|`` relative to the terms, for a random ``y``.

    Parameters
    ----------
    forward : callable
        The linear map F.
    x : torch.Tensor, DomainTensor or numpy.ndarray
        A point of its domain.
    adjoint : callable, optional
        F*; by default what backward computes (the vector-Jacobian product of
        ``forward`` at ``x``), which is what the test is for.
    x_space, y_space : optional
        How to take inner products in F's domain and range (see ``inner``);
        DomainTensors need none.
    rtol : float, optional
        The largest relative error allowed: 1e-10 in float64, 1e-4 otherwise.
    seed : int, default 0
        Seeds the random ``y``.

    Returns
    -------
    float
        The relative error.

    Raises
    ------
    AssertionError
        Above ``rtol``.
    """
    fx = forward(x)
    y_space = _space_of(fx, y_space)
    x_space = _space_of(x, x_space)
    y = _random_like(fx, y_space, seed, _rank_in(y_space))
    if adjoint is not None:
        fty = adjoint(y)
    else:
        xl = _local(x).detach().requires_grad_(True)
        xin = DomainTensor(xl, x.decomposition) if isinstance(x, DomainTensor) else xl
        out = _local(forward(xin))
        (g,) = torch.autograd.grad(out, xl, _local(y), allow_unused=True)
        fty = torch.zeros_like(xl) if g is None else g
    lhs, rhs, err = adjoint_terms(_array(fx), _array(y), _array(x), _array(fty),
                                  _comm_of(y_space), x_comm=_comm_of(x_space))
    dtype = _local(x).dtype
    tol = rtol if rtol is not None else (1e-10 if dtype in (torch.float64, torch.complex128) else 1e-4)
    if err > tol:
        raise AssertionError(f"adjoint test failed: <F x, y> = {lhs!r}, <x, F* y> = {rhs!r}, "
                             f"relative error {err:.3e} > {tol:.1e}")
    return err


def _rank_in(space) -> int:
    """The seed offset of this rank's random values in ``space``: replicas of one
    block (ranks that differ only along replicated grid axes) must draw the same
    values, or the collectives that read one replica see another's numbers."""
    if space is None:
        return 0
    if isinstance(space, Decomposition):
        return space.grid.sub(space.shard.values()).Get_rank()
    return space.Get_rank()


# -- the oracle ----------------------------------------------------------------------------------
def _as_tuple(inputs):
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def shard_like(t: torch.Tensor, grid: ProcessGrid, shard: Mapping[int, int] | None,
               sizes=None, requires_grad: bool = False):
    """Local (after a consistency check). This rank's block of ``t``, a tensor every
    rank holds whole, as a DomainTensor (``t`` itself when ``shard`` is None)."""
    if shard is None:
        return t.detach().clone().requires_grad_(requires_grad)
    dec = Decomposition(t.shape, grid, shard, sizes)
    block = t.detach()[dec.local_slices()].clone().requires_grad_(requires_grad)
    return DomainTensor(block, dec)


def _full(v):
    return v.full_tensor() if isinstance(v, DomainTensor) else v


def assert_matches_single_process(model: Callable, inputs, grid: ProcessGrid, shard,
                                  *, sizes=None, rtol: float | None = None,
                                  atol: float | None = None, seed: int = 0,
                                  wrap: Callable | None = None) -> dict[str, float]:
    """Collective. Run ``model`` (a module or function) on ``inputs`` sharded by
    ``shard`` over ``grid``, and a deep copy of it in this process on the whole
    ``inputs``; compare the outputs, the inputs' gradients and every parameter's
    gradient, for the loss sum(output * w) with a fixed random w.

    Parameters
    ----------
    model : callable
        A module or function.
    inputs : torch.Tensor or tuple of torch.Tensor
        Global tensors (rank 0's copies are used on every rank).
    grid : ProcessGrid
        The processes to shard over.
    shard : mapping or sequence of mappings
        One shard map for all inputs or one per input (None leaves an input
        replicated).
    sizes : optional
        Block sizes, as for Decomposition (one for all inputs or one per input).
    rtol, atol : float, optional
        Tolerances; ``TOLERANCES`` for the dtype by default (see Notes).
    seed : int, default 0
        Seeds the random weights ``w`` of the loss.
    wrap : callable, optional
        Applied to the sharded model copy, e.g. ``lambda m: dp.DomainParallel(m, grid)``.

    Returns
    -------
    dict
        The largest relative error per quantity.

    Raises
    ------
    AssertionError
        On every rank, when anything differs beyond the tolerances.

    Notes
    -----
    Tolerances are elementwise (``torch.allclose``) with ``TOLERANCES`` for the
    dtype, and an absolute tolerance of at least ``rtol`` times the quantity's
    largest element: parameter gradients, and input gradients that pass through
    a global reduction, hold sums over the whole domain, taken in another order
    on P ranks than on one, so an element's rounding error scales with the sum
    of the magnitudes of its terms, not with its own value.
    """
    comm = grid.comm
    inputs = comm.bcast(tuple(t.detach().cpu() for t in _as_tuple(inputs)), root=0)
    shards = list(shard) if isinstance(shard, (list, tuple)) else [shard] * len(inputs)
    all_sizes = list(sizes) if isinstance(sizes, (list, tuple)) else [sizes] * len(inputs)
    grads = [t.is_floating_point() or t.is_complex() for t in inputs]
    ref_model = copy.deepcopy(model)
    dp_model = copy.deepcopy(model)
    if wrap is not None:
        dp_model = wrap(dp_model)

    ref_in = [t.clone().requires_grad_(g) for t, g in zip(inputs, grads)]
    dp_in = [shard_like(t, grid, s, z, g) for t, s, z, g in zip(inputs, shards, all_sizes, grads)]
    ref_out = ref_model(*ref_in)
    dp_out = dp_model(*dp_in)
    # Offset: with seed 0, an input drawn the usual way (randn from seed 0) would
    # equal the weight, and sum(f(x) * x) hides some gradients (normalizations).
    g = torch.Generator().manual_seed(seed + 7919)
    weight = torch.randn(ref_out.shape, generator=g, dtype=torch.float64).to(ref_out.dtype)
    (ref_out * weight).sum().backward()
    (dp_out * weight).sum().backward()

    checks = [("output", _full(dp_out), ref_out)]
    for i, (a, b, gr) in enumerate(zip(dp_in, ref_in, grads)):
        if gr:
            checks.append((f"input {i} gradient", _full(a.grad), b.grad))
    ref_params = dict(_named_parameters(ref_model))
    for name, p in _named_parameters(dp_model):
        name = name.removeprefix("module.")
        checks.append((f"gradient of {name}", p.grad, ref_params[name].grad))

    errors, problems = {}, []
    for what, got, want in checks:
        if got is None or want is None:
            if got is not want:
                problems.append(f"{what}: one side is None")
            continue
        got = got.detach().cpu()
        r, a = _tolerances(want.dtype, rtol, atol)
        if want.numel():
            a = max(a, r * float(want.detach().abs().max()))
        diff = (got - want.detach()).abs()
        err = float((diff / (want.detach().abs() + a / r)).max()) if diff.numel() else 0.0
        errors[what] = err
        if not torch.allclose(got, want.detach(), rtol=r, atol=a, equal_nan=True):
            problems.append(f"{what}: max abs difference {float(diff.max()):.3e} "
                            f"(rtol {r:.0e}, atol {a:.0e})")
    stories = comm.allgather(problems)
    failed = [f"rank {r}: {p}" for r, ps in enumerate(stories) for p in ps]
    if failed:
        raise AssertionError("sharded run differs from one process: " + "; ".join(failed[:12]))
    return errors


def _named_parameters(model):
    return model.named_parameters() if isinstance(model, torch.nn.Module) else []


def _tolerances(dtype, rtol, atol):
    r, a = TOLERANCES.get(dtype, (1e-5, 1e-6))
    return (rtol if rtol is not None else r), (atol if atol is not None else a)
