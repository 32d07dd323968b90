"""The OpInfo sweep: torch's own sample inputs (``op_db``) for every op, run on
DomainTensors against one process running torch on the whole tensors.

For each OpInfo whose callable has a domain-parallel rule, a few samples
(those with the most dims) are run with their input sharded along each of its
dims in turn, on a 1-D grid of 2 or 3 ranks, the layout kind (even, uneven,
zero-size blocks) rotating from case to case. Tensor arguments shaped like the
input are sharded alike; others stay replicated plain tensors. Forward output
and, where the op supports autograd, the gradients of the loss
``sum(output * w)`` with respect to every floating tensor argument are
compared with torch's (float64 where the op has it: rtol 1e-10). A refusal
(``UnsupportedOpError``, the same on every rank) is a documented outcome, not a
failure. For an OpInfo with no rule, the first sample must refuse on every rank
(or, where torch composes the op from ops that have rules, match torch).

Each rank computes torch's answer once per sample, reused for every sharded
dim; outcomes are gathered once per op. ``EXPECTED_FAILURES`` lists what is
known to fail, and the test fails when an entry no longer does, so the list
only shrinks.
"""
from __future__ import annotations

import functools
import itertools
import os
import re
import time

import pytest
import torch
from torch.utils import _pytree as pytree

pytestmark = pytest.mark.mpi

NP = int(os.environ.get("DOMAINPAR_TEST_NP", "1"))
if NP not in (2, 3):
    pytest.skip("the OpInfo sweep runs on 2 and 3 ranks (mpi stages -n 2 and -n 3)",
                allow_module_level=True)
pytest.importorskip("expecttest", reason="torch's op_db needs the expecttest package")
# The imports below come after the module-level skips on purpose: on other
# world sizes, or without expecttest, the slow op_db import never happens.
# ruff: noqa: E402

from mpi4py import MPI
from torch.testing._internal.common_methods_invocations import op_db

import domainpar as dp
from domainpar.tensor import dispatch
from domainpar.testing import block_sizes, shard_like

SAMPLES_PER_OP = 2       # samples run per op with a rule (the first and last non-empty one)
KINDS = ("even", "uneven", "zero")
RTOL, ATOL = 1e-10, 1e-12
# Ops whose output holds uninitialised memory: only shapes and dtypes are compared
# (torch's own OpInfo tests skip their values for the same reason).
NO_VALUES = {"empty_like", "new_empty", "new_empty_strided", "empty", "empty_strided",
             "empty_permuted"}

# Known failures: OpInfo name -> [(regex on the case text, why)]. The case text is
# "shape <input shape> dim <sharded dim> <kind> args <args> kwargs <kwargs>
# [forward|backward|error]". A listed case that passes fails the test: delete it.
# Only ops with a rule are listed; an op without one must refuse (or match torch).
EXPECTED_FAILURES: dict[str, list[tuple[str, str]]] = {
}


def _opinfo_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _ruled_callable(op):
    """The callable of ``op`` that the dispatch table has a rule for, or None."""
    for f in (op.op, op.method_variant):
        if f is not None and dispatch.has_rule(f):
            return f
    return None


def _dtype(op):
    supported = op.supported_dtypes("cpu")
    for dtype in (torch.float64, torch.complex128, torch.int64, torch.bool):
        if dtype in supported:
            return dtype
    return None


import domainpar.ops  # registers every rule before the split below

OPS = [op for op in op_db if _dtype(op) is not None]
RULED = [op for op in OPS if _ruled_callable(op) is not None]
UNRULED = [op for op in OPS if _ruled_callable(op) is None and op.op is not None]


# -- samples ----------------------------------------------------------------------------------
def _inputs(sample) -> list:
    x = sample.input
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _shardable(sample) -> list[int]:
    """The dims of the sample's input(s) that can be sharded (size at least 1, the
    same rank in every input of a list)."""
    xs = _inputs(sample)
    if not xs or not all(isinstance(x, torch.Tensor) and x.layout == torch.strided for x in xs):
        return []  # sparse layouts are not DomainTensor blocks
    if len({x.dim() for x in xs}) != 1:
        return []
    return [d for d in range(xs[0].dim()) if all(x.shape[d] >= 1 for x in xs)]


def _samples(op, count):
    """Up to ``count`` samples with a shardable input, spread evenly over the
    non-empty ones torch generates (options differ along the list), or just the
    first usable one when ``count`` is 1."""
    requires_grad = op.supports_autograd and _dtype(op).is_floating_point
    drawn = op.sample_inputs("cpu", _dtype(op), requires_grad=requires_grad)
    usable = (s for s in drawn if _shardable(s))
    if count == 1:
        return list(itertools.islice(usable, 1)), requires_grad
    usable = list(usable)
    full = [s for s in usable if _inputs(s)[0].numel()] or usable
    if len(full) <= count:
        return full, requires_grad
    picks = sorted({round(i * (len(full) - 1) / (count - 1)) for i in range(count)})
    return [full[i] for i in picks], requires_grad


# -- running one case ---------------------------------------------------------------------------
def _leaves_to_grad(sample):
    leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _loss(out):
    """sum(output * w) over the floating outputs, w fixed per output shape."""
    total = 0
    for i, o in enumerate(pytree.tree_leaves(out)):
        if isinstance(o, dp.DomainTensor):
            o = o.full_tensor()
        if not isinstance(o, torch.Tensor) or not o.requires_grad:
            continue
        o = torch.view_as_real(o) if o.is_complex() else o
        g = torch.Generator().manual_seed(7919 + i)
        total = total + (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum()
    return total


def _reference(op, sample, requires_grad):
    """One process on the whole tensors: (output leaves, gradients) or the error text."""
    try:
        out = op(sample.input, *sample.args, **sample.kwargs)
        grads = None
        if requires_grad:
            leaves = _leaves_to_grad(sample)
            loss = _loss(out)
            if isinstance(loss, torch.Tensor) and leaves:
                grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [_detached(o) for o in pytree.tree_leaves(out)], grads
    except Exception as exc:  # noqa: BLE001 (torch rejects the sample itself)
        return f"{type(exc).__name__}: {exc}", None


def _detached(o):
    return o.detach() if isinstance(o, torch.Tensor) else o


def _like_input(sample, t) -> bool:
    """Whether ``t`` is a tensor shaped like one of the sample's inputs."""
    return isinstance(t, torch.Tensor) and tuple(t.shape) in {
        tuple(x.shape) for x in _inputs(sample)}


def _has_args_like_input(sample) -> bool:
    return any(_like_input(sample, t) for t in pytree.tree_leaves((sample.args, sample.kwargs)))


def _shard_all(sample, dim, grid, kind, seed, args_too=True):
    """The sample's inputs (and, with ``args_too``, tensor arguments shaped like
    one) as DomainTensors cut along ``dim`` over the grid's one axis."""
    xs = _inputs(sample)

    def cut(t):
        if not _like_input(sample, t):
            return t
        sizes = block_sizes(t.shape[dim], NP, kind, seed)
        return shard_like(t, grid, {dim: 0}, None if sizes is None else {dim: sizes},
                          requires_grad=t.requires_grad)

    sharded = [cut(x) for x in xs]
    x = sharded if isinstance(sample.input, (list, tuple)) else sharded[0]
    if not args_too:
        return x, sample.args, sample.kwargs
    return x, pytree.tree_map(cut, sample.args), pytree.tree_map(cut, sample.kwargs)


def _close_meta(got, want) -> str | None:
    """None when ``got`` has torch's shape and dtype (values not compared)."""
    if isinstance(got, dp.DomainTensor):
        got = got.full_tensor()
    return _close(torch.zeros_like(got), torch.zeros_like(want))


def _close(got, want) -> str | None:
    """None when ``got`` is torch's ``want``, else what differs."""
    if isinstance(got, dp.DomainTensor):
        got = got.full_tensor()
    if not isinstance(want, torch.Tensor):
        return None if got == want else f"{got!r} != {want!r}"
    if not isinstance(got, torch.Tensor):
        return f"got a {type(got).__name__}, torch gives a tensor"
    got = got.detach()
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {tuple(got.shape)} {got.dtype}, torch {tuple(want.shape)} {want.dtype}"
    if not (want.is_floating_point() or want.is_complex()):
        return None if torch.equal(got, want) else "values differ"
    atol = max(ATOL, RTOL * float(want.abs().max())) if want.numel() else ATOL
    if torch.allclose(got, want, rtol=RTOL, atol=atol, equal_nan=True):
        return None
    return f"max abs difference {float((got - want).abs().nan_to_num().max()):.3e}"


def _run_case(op, sample, dim, grid, kind, seed, reference, requires_grad, values=True,
              args_too=True) -> str:
    """Local outcome of one case: 'ok', 'refused: ...', or 'forward/backward/error: ...'."""
    want, want_grads = reference
    x, args, kwargs = _shard_all(sample, dim, grid, kind, seed, args_too)
    try:
        out = op(x, *args, **kwargs)
        outs = pytree.tree_leaves(out)
        if len(outs) != len(want):
            return f"forward: {len(outs)} outputs, torch gives {len(want)}"
        for i, (got, ref) in enumerate(zip(outs, want)):
            why = _close(got, ref) if values else _close_meta(got, ref)
            if why:
                return f"forward: output {i}: {why}"
        if want_grads is None:
            return "ok"
        leaves = [t._local if isinstance(t, dp.DomainTensor) else t
                  for t in _leaves_to_grad_of(x, args, kwargs)]
        loss = _loss(out)
        got_grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        wrapped = _wrap_like(got_grads, _leaves_to_grad_of(x, args, kwargs))
        for i, (got, ref, t) in enumerate(zip(wrapped, want_grads, _leaves_to_grad(sample))):
            if got is None and ref is None:
                continue
            why = _close(_zero_if_none(got, t), _zero_if_none(ref, t))
            if why:
                return f"backward: gradient {i}: {why}"
        return "ok"
    except dispatch.UnsupportedOpError as exc:
        return f"refused: {exc}"
    except Exception as exc:  # noqa: BLE001 (compared on every rank, reported)
        return f"error: {type(exc).__name__}: {exc}"


def _leaves_to_grad_of(x, args, kwargs):
    leaves = pytree.tree_leaves((x, args, kwargs))
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _wrap_like(grads, leaves):
    """Gradients of the blocks as DomainTensors; None (no path from the loss to a
    block, an empty one for instance) as zeros, so every rank gathers alike."""
    out = []
    for g, t in zip(grads, leaves):
        if isinstance(t, dp.DomainTensor):
            local = t.to_local()
            g = dp.DomainTensor(torch.zeros_like(local) if g is None else g, t.decomposition)
        out.append(g)
    return out


def _zero_if_none(g, like):
    return torch.zeros_like(like) if g is None else g


# -- the tests ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grid():
    return dp.ProcessGrid((NP,))


@pytest.fixture(scope="module")
def tally(pytestconfig):
    """Counts of ops, samples and case outcomes, printed by rank 0 at the end."""
    counts: dict[str, int] = {}
    cpu0 = time.process_time()
    yield counts
    if MPI.COMM_WORLD.Get_rank() == 0 and counts:
        capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print("\nOpInfo sweep on", NP, "ranks:",
                  ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                  f"(rank 0 CPU {time.process_time() - cpu0:.1f} s after the imports)")


def _count(tally, key, n=1):
    tally[key] = tally.get(key, 0) + n


def _case_text(sample, dim, kind) -> str:
    shape = tuple(_inputs(sample)[0].shape)
    return f"shape {shape} dim {dim} {kind} args {_short(sample.args)} kwargs {_short(sample.kwargs)}"


def _short(value) -> str:
    text = repr(pytree.tree_map(
        lambda t: f"T{tuple(t.shape)}" if isinstance(t, torch.Tensor) else t, value))
    return text if len(text) < 120 else text[:117] + "..."


def _agreed(outcomes: list[str]) -> list[str]:
    """Collective. Per case: the outcome when every rank saw the same one, else
    every rank's outcome."""
    everyone = MPI.COMM_WORLD.allgather(outcomes)
    agreed = []
    for per_rank in zip(*everyone):
        same = len(set(per_rank)) == 1
        agreed.append(per_rank[0] if same else "error: ranks differ: " + " | ".join(per_rank))
    return agreed


def _failures(cases: list[tuple[str, str]]) -> list[str]:
    return [f"{text} {outcome}" for text, outcome in cases
            if outcome != "ok" and not outcome.startswith("refused")]


def _record(name: str, cases, outcomes) -> None:
    """With DOMAINPAR_OPINFO_REPORT=FILE, rank 0 appends every case's outcome to FILE."""
    path = os.environ.get("DOMAINPAR_OPINFO_REPORT")
    if path and MPI.COMM_WORLD.Get_rank() == 0:
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(f"{name} | {text} | {outcome[:300]}".replace("\n", " ") + "\n"
                         for (text, _), outcome in zip(cases, outcomes))


def _judge(name: str, failures: list[str], expected=()) -> None:
    """Fail on a failure no ``expected`` entry matches, and on an entry that no
    longer fails."""
    surprises = [f for f in failures if not any(re.search(p, f) for p, _ in expected)]
    stale = [p for p, _ in expected if not any(re.search(p, f) for f in failures)]
    assert not surprises, f"{name}: {len(surprises)} failing case(s): " + "; ".join(surprises[:6])
    assert not stale, f"{name}: expected failures that now pass, remove them: {stale}"


@pytest.mark.parametrize("op", RULED, ids=_opinfo_name)
def test_op_with_rule_matches_torch(op, grid, tally):
    """Collective. The op's samples sharded along each dim match torch."""
    func = _ruled_callable(op)
    samples, requires_grad = _samples(op, SAMPLES_PER_OP)
    cases, kinds = [], itertools.cycle(KINDS)
    for s, sample in enumerate(samples):
        reference = _reference(func, sample, requires_grad)
        if isinstance(reference[0], str):
            continue  # torch itself rejects this sample
        for dim in _shardable(sample):
            kind = next(kinds)
            run = functools.partial(_run_case, func, sample, dim, grid, kind, s, reference,
                                    requires_grad, values=op.name not in NO_VALUES)
            outcome, text = run(), _case_text(sample, dim, kind)
            if _has_args_like_input(sample) and _refused_everywhere(outcome):
                # Arguments shaped like the input may be weights (conv, layer_norm),
                # which must stay replicated: run again with them plain.
                outcome, text = run(args_too=False), text + " (plain args)"
            cases.append((text, outcome))
    outcomes = _agreed([o for _, o in cases])
    _tally_outcomes(tally, "ruled", outcomes)
    _count(tally, "ruled ops")
    _count(tally, "ruled samples", len(samples))
    _record(_opinfo_name(op), cases, outcomes)
    _judge(_opinfo_name(op), _failures([(t, o) for (t, _), o in zip(cases, outcomes)]),
           EXPECTED_FAILURES.get(_opinfo_name(op), ()))


def _refused_everywhere(outcome: str) -> bool:
    """Collective. Whether every rank's outcome is a refusal."""
    return MPI.COMM_WORLD.allreduce(outcome.startswith("refused"), op=MPI.LAND)


def _tally_outcomes(tally, prefix, outcomes):
    for o in outcomes:
        _count(tally, f"{prefix} cases {o.split(':', 1)[0]}")


@pytest.mark.parametrize("op", UNRULED, ids=_opinfo_name)
def test_op_without_rule_refuses(op, grid, tally):
    """Collective. An op with no rule refuses on every rank (or, composed by torch
    from ops that have rules, matches torch)."""
    samples, _ = _samples(op, 1)
    cases = []
    for sample in samples:
        reference = _reference(op.op, sample, False)
        if isinstance(reference[0], str):
            continue
        dim = _shardable(sample)[-1]
        cases.append((_case_text(sample, dim, "even"),
                      _run_case(op.op, sample, dim, grid, "even", 0, reference, False)))
    outcomes = _agreed([o for _, o in cases])
    _tally_outcomes(tally, "unruled", outcomes)
    _count(tally, "unruled ops")
    _record(_opinfo_name(op), cases, outcomes)
    _judge(_opinfo_name(op), _failures([(t, o) for (t, _), o in zip(cases, outcomes)]))
