"""DomainParallel: replicated parameters, gradients reduced bucketed and
overlapped with backward.

Without a wrapper every op that uses a parameter on sharded data sums that
parameter's gradient over the grid in its own backward (a Broadcast in the
graph, ``tensor.params.enter_domain``): correct, but one small allreduce per
use. Inside ``DomainParallel.forward`` those uses are *deferred*: each op's
backward hands its partial gradient to the reducer below and contributes
nothing to ``.grad`` itself. The reducer adds the partials of a parameter
until every use recorded in forward has arrived, and reduces parameters in
buckets of about ``bucket_cap_mb`` (a nonblocking allreduce per bucket while
backward goes on). At the end of backward (an autograd engine callback) the
last buckets start, all are waited for, and the sums are added to ``.grad``.

Why partials and not ``.grad`` (as DDP does): the true gradient is a SUM over
ranks (docs/design.md); summing ``.grad`` would also multiply by the number of
ranks whatever a parameter received from computations on replicated values
(identical on every rank) and whatever ``.grad`` held before this backward.
Only the partials are summed, so both stay exact.

Agreement, so that ranks whose graphs differ never hang or diverge:
- at wrap time the parameters and buffers (names, shapes, dtypes) are agreed
  before anything is broadcast: a model built differently on some rank is a
  MismatchError on every rank;
- at the end of every forward one allreduce agrees which parameters were used
  (and over which communicator), and whether the module raised on some rank (the
  others then raise PeerForwardError; the failing rank waits for them at most
  DOMAINPAR_FAULT_TIMEOUT seconds, since they may be blocked in communication
  it left, then raises its own error). The buckets are then a deterministic plan over
  the *union* of the parameters used on any rank, started strictly in plan
  order, so every rank issues the same reductions in the same order whatever
  its own graph. A parameter that a rank did not use (a boundary term only the
  ranks on the boundary apply), or whose backward never reached it there,
  contributes a zero partial: the sum is one process's gradient. Parameters
  not used on every rank go into buckets reduced at the end of backward, so a
  blocking reduction never waits mid-backward for a rank that is not coming;
- a backward that raised leaves state behind; the next forward notices it
  (agreed: if any rank does) and every rank starts afresh on new duplicated
  communicators, so no half-finished reduction can match a new one.
Limits: the grid's sub-communicators are made at wrap time; a parameter used on
some ranks only, on tensors of *another* grid whose sub-communicator was never
used on every rank, makes it (collective) on those ranks only and hangs. A rank
whose backward never reaches the model (no gradient flows into its output) never
finishes the step, and the others wait for it.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

import numpy as np
import torch
from mpi4py import MPI
from torch.utils._pytree import tree_leaves

from ..autograd._arrays import to_array
from ..comm import collectives
from ..comm.collectives import PendingReduction
from ..comm.errors import DomainparError, MismatchError, agree, completes_within, fault_timeout, signature_of
from ..comm.grid import ProcessGrid
from ..tensor import params as domain_params
from ..tensor.dispatch import UnsupportedOpError
from .factories import ShardedFactories
from .fusion import fuse_for


class DomainParallel(torch.nn.Module):
    """Collective (construction agrees on the module's structure and broadcasts
    parameters and buffers from rank 0 of ``grid``; every forward agrees on the
    parameters it used: one small allreduce). Wraps ``module`` so that its
    parameters' gradients are summed over the grid bucketed and asynchronously
    during backward.

    Parameters
    ----------
    module : torch.nn.Module
        The model, unchanged; every rank builds the same one.
    grid : ProcessGrid
        The processes whose gradients are summed (every rank of the grid).
    bucket_cap_mb : float, default 25.0
        The size of a bucket of gradients, in MiB.
    overlap : bool, default True
        Start each full bucket's allreduce nonblocking while backward goes on
        (for networks with asynchronous progress); False reduces it at once
        with a blocking allreduce, which is faster where nonblocking
        collectives are slower and do not progress in the background
        (``domainpar bench grads`` measures both).
    sharded_factories : bool, default True
        Run the forward inside ``dp.sharded_factories()``, so that a buffer made
        by ``torch.zeros(...)`` (and the like) takes a layout when a DomainTensor
        is written into it (``nn/factories.py``); False leaves every factory plain.
    fuse_halos : bool, optional
        Halo fusion (``nn/fusion.py``, docs/fusion.md): every block (an
        ``nn.Sequential`` or a residual block) made of two or more convs and
        pointwise ops only exchanges one halo as wide as its combined reach,
        not one per conv (where its input cannot fuse, it runs unfused). Marks
        the blocks in place; ``fused_chains`` names them.
        None (the default) reads ``DOMAINPAR_FUSE_HALOS`` (``1``: on; unset: off).

    Notes
    -----
    ``module`` runs unchanged on DomainTensors; grids with a batch axis (say
    ``shard={0: 0, 2: 1}``) need nothing special: gradients are summed over all
    ranks that hold distinct data. Buffers are broadcast once here; ops that
    update buffers (normalization running stats) keep them identical on every
    rank themselves. A parameter used on some ranks only gets the sum of the
    partial gradients of the ranks that used it (zero from the others).
    """

    def __init__(self, module: torch.nn.Module, grid: ProcessGrid, *,
                 bucket_cap_mb: float = 25.0, overlap: bool = True,
                 sharded_factories: bool = True, fuse_halos: bool | None = None):
        super().__init__()
        self.module = module
        self.grid = grid
        self._factories = sharded_factories
        _agree_structure(module, grid.comm)
        self.fused_chains = fuse_for(module, fuse_halos, grid.comm)
        with torch.no_grad():
            for t in itertools.chain(module.parameters(), module.buffers()):
                _broadcast_in_place(t, grid.comm)
        named = list(module.named_parameters())
        for _, p in named:  # equal now: ops need not compare them (collectively) again
            domain_params.check_replicated(p, grid.comm)
        # Every sub-communicator an op may reduce over, made now on every rank (each
        # is collective on first use) and numbered alike everywhere.
        subs = [grid.sub(axes) for r in range(1, grid.ndim + 1)
                for axes in itertools.combinations(range(grid.ndim), r)]
        self._reducer = _Reducer(named, grid.comm, subs, int(bucket_cap_mb * 2**20), overlap)

    def forward(self, *args, **kwargs):
        """Collective. The wrapped module's forward with parameter gradients deferred
        to this wrapper's bucketed allreduces; if the module raises on any rank, every
        rank raises (the others a PeerForwardError)."""
        self._reducer.begin_forward()
        token = domain_params.set_deferrer(self._reducer.deferral)
        try:
            with ShardedFactories() if self._factories else contextlib.nullcontext():
                out = self.module(*args, **kwargs)
        except Exception:
            # Tell the peers (or, if they never come, blocked in communication this
            # rank left, give up waiting), then raise here as before.
            self._reducer.agree_uses(failed=True)
            raise
        finally:
            domain_params.reset_deferrer(token)
        self._reducer.agree_uses()
        return self._reducer.watch(out)


class PeerForwardError(DomainparError):
    """Raised by DomainParallel's forward on the ranks whose own forward succeeded
    when the module raised on another rank (which raises its own error)."""
    elsewhere = True  # for callers that report every rank's own error only


def _agree_structure(module: torch.nn.Module, comm: MPI.Comm) -> None:
    """Collective. MismatchError on every rank if the module's parameters and
    buffers (names, shapes, dtypes) differ between ranks."""
    tensors = [(name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in
               itertools.chain(module.named_parameters(), module.named_buffers())]
    text = ", ".join(f"{n} {s} {d}" for n, s, d in tensors)
    if len(text) > 400:
        text = f"{text[:190]} ... {text[-190:]}"
    agree(comm, None, signature=signature_of(tensors),
          what="DomainParallel: the module's parameters and buffers (names, shapes, dtypes; "
               "build the same model on every rank)",
          described=f"{len(tensors)} tensors: {text}")


def _broadcast_in_place(t: torch.Tensor, comm: MPI.Comm) -> None:
    data = t.detach()
    work = data if data.is_contiguous() else data.contiguous()
    collectives.bcast(to_array(work), comm, root=0)
    if work is not data:
        data.copy_(work)


_UNUSED = 2**40  # larger than any communicator index


class _Reducer:
    """Deferred partial gradients of one module's parameters, reduced in buckets
    planned from the parameters used on any rank (agreed after each forward)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], comm: MPI.Comm,
                 known: Sequence[MPI.Comm], bucket_bytes: int, overlap: bool = True):
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._comm = comm
        self._overlap = overlap
        self._bucket_bytes = max(bucket_bytes, 1)
        # Communicators the ops reduce over: the grid's, numbered alike on every rank,
        # then any other in first-use order (ids differ between ranks; the numbers
        # must not); and private duplicates of them.
        self._op_comms: list[MPI.Comm] = list(known)
        self._comm_index = {id(c): k for k, c in enumerate(known)}
        self._dups: list[MPI.Comm] = []
        self._stale = False
        self._abandoned: list = []
        self._clear()

    def _clear(self) -> None:
        """Local. Forget the step: uses, partials, the plan, launched reductions."""
        self._uses: dict[int, int] = {}       # param index -> uses recorded in forward
        self._comm_of: dict[int, int] = {}    # param index -> communicator index
        self._arrived: dict[int, int] = {}
        self._partial: dict[int, torch.Tensor] = {}
        self._plan: list[tuple[list[int], int, bool]] = []  # (indices, comm, late)
        self._bucket_of: dict[int, int] = {}
        self._missing: list[int] = []
        self._ready: set[int] = set()
        self._next = 0
        self._launched: list[tuple[list[int], torch.Tensor, PendingReduction | _Done]] = []
        self._in_backward = False

    # -- forward: record uses, then agree on them ---------------------------------------------
    def begin_forward(self) -> None:
        """Local. A backward that started and never finished (it raised) left its
        state: drop it; ``agree_uses`` then renews the communicators everywhere."""
        if self._in_backward:
            # Reductions it started may never complete (a peer may not have started
            # them): keep their buffers and communicators alive, never wait on them.
            self._abandoned.append((self._launched, self._dups))
            self._clear()
            self._stale = True

    def deferral(self, p: torch.Tensor, comm: MPI.Comm):
        """Called by ops in forward for every use of a replicated tensor ``p``; returns
        the callable receiving its partial gradient, or None for tensors that are
        not this module's parameters (those are reduced by the op itself)."""
        i = self._index.get(id(p))
        view = None
        if i is None:  # view_as_complex(parameter), or a slice of one: reduced as it
            view = domain_params.base_of(p)
            if view is not None:
                i = self._index.get(id(view[0]))
        if i is None:
            return None
        c = self._comm_index.get(id(comm))
        if c is None:
            c = self._comm_index[id(comm)] = len(self._op_comms)
            self._op_comms.append(comm)
        if self._comm_of.setdefault(i, c) != c:
            raise UnsupportedOpError(
                "DomainParallel: a parameter used on tensors sharded over different grid "
                "axes in one step; use it outside DomainParallel (per-op reductions)")
        self._uses[i] = self._uses.get(i, 0) + 1
        if view is None:
            return lambda grad: self._arrive(i, grad)
        base, complex_view = view
        if complex_view:
            return lambda grad: self._arrive(i, torch.view_as_real(grad))
        geometry = p.detach()  # the view's shape and strides, not its graph
        return lambda grad: self._arrive(i, domain_params.view_gradient(geometry, base, grad))

    def agree_uses(self, failed: bool = False) -> None:
        """Collective (one nonblocking allreduce over the grid). Agree on the
        parameters used in forward on any rank and their communicators, then plan
        the buckets. ``failed``: this rank's forward raised; the others then raise
        PeerForwardError, and this rank waits for them at most ``fault_timeout()``
        seconds (they may be blocked in communication it left)."""
        n = len(self._params)
        v = np.zeros(n, dtype=np.int64)
        for i, c in self._comm_of.items():
            v[i] = c + 1 if self._uses.get(i) else 0
        ncomms = len(self._op_comms)
        flags = np.concatenate([v, -np.where(v > 0, v, _UNUSED), -v,
                                [ncomms, -ncomms, int(self._stale), int(failed)]]).astype(np.int64)
        if self._comm.Get_size() > 1:
            request = self._comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
            if not completes_within(request, fault_timeout() if failed else 0):
                self._abandoned.append((request, flags))
                self._clear()
                return
        vmax, vmin_used, vmin = flags[:n], -flags[n:2 * n], -flags[2 * n:3 * n]
        if flags[3 * n + 2]:  # some rank's backward broke off: fresh communicators
            self._dups, self._stale = [], False
        if flags[3 * n + 3]:
            self._clear()
            if failed:
                return
            raise PeerForwardError("DomainParallel: the module's forward raised on another "
                                   "rank (that rank raises its own error)")
        differ = [self._names[i] for i in range(n) if 0 < vmax[i] != vmin_used[i]]
        if flags[3 * n] != -flags[3 * n + 1] or differ:
            self._clear()
            raise MismatchError(
                f"DomainParallel: the ranks' forwards used parameters on different grid "
                f"communicators ({differ or 'a communicator used on some ranks only'}); "
                f"every rank must run the same ops on tensors sharded alike")
        while len(self._dups) < ncomms:  # collective over each op's communicator, in order
            self._dups.append(self._op_comms[len(self._dups)].Dup())
        self._make_plan(vmax, vmin)

    def _make_plan(self, vmax: np.ndarray, vmin: np.ndarray) -> None:
        """Local (the same on every rank: made from agreed values only). Buckets in
        the reverse order of the parameters (about the order backward reaches
        them); those not used on every rank come last, reduced at the end."""
        plan: list[tuple[list[int], int, bool]] = []
        for late in (False, True):
            open_: dict[tuple, tuple[list[int], int]] = {}
            for i in reversed(range(len(self._params))):
                if vmax[i] == 0 or bool(vmin[i] == 0) != late:
                    continue
                p = self._params[i]
                key = (int(vmax[i]) - 1, str(p.dtype), str(p.device))
                members, size = open_.get(key, ([], 0))
                members.append(i)
                size += p.numel() * p.element_size()
                open_[key] = (members, size)
                if size >= self._bucket_bytes:
                    plan.append((open_.pop(key)[0], key[0], late))
            plan.extend((members, key[0], late) for key, (members, _) in open_.items())
        self._plan = plan
        self._bucket_of = {i: b for b, (members, _, _) in enumerate(plan) for i in members}
        self._missing = [len(members) for members, _, _ in plan]

    def watch(self, out):
        """Local. Hooks on the outputs that start the step's end-of-backward work when
        backward reaches them, also on a rank where no parameter's gradient arrives."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._on_output_grad)
        return out

    # -- backward: collect partials, start complete buckets in plan order ----------------------
    def _on_output_grad(self, grad):
        self._begin_backward()

    def _begin_backward(self) -> None:
        if not self._in_backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._in_backward = True

    def _arrive(self, i: int, grad: torch.Tensor) -> None:
        self._begin_backward()
        if i not in self._bucket_of:
            raise DomainparError(f"DomainParallel: a gradient for {self._names[i]} from a "
                                 f"forward that did not finish")
        # Kept as handed over, no copy: autograd never writes to a gradient it has
        # passed to a backward, and a second use makes a new sum.
        self._partial[i] = self._partial[i] + grad if i in self._partial else grad
        for _, _, pending in self._launched:  # without a progress thread MPI moves
            pending.test()                      # nonblocking work only inside calls
        self._arrived[i] = self._arrived.get(i, 0) + 1
        if self._arrived[i] >= self._uses.get(i, 0):
            self._mark_ready(i)
            self._launch_in_order(final=False)

    def _mark_ready(self, i: int) -> None:
        if i not in self._ready:
            self._ready.add(i)
            self._missing[self._bucket_of[i]] -= 1

    def _launch_in_order(self, final: bool) -> None:
        while self._next < len(self._plan) and self._missing[self._next] == 0 and (
                final or not self._plan[self._next][2]):
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        members, c, _ = self._plan[b]
        flat = torch.cat([self._partial[i].reshape(-1) if i in self._partial else
                          torch.zeros(self._params[i].numel(), dtype=self._params[i].dtype,
                                      device=self._params[i].device) for i in members])
        request: PendingReduction | _Done
        if self._overlap:
            request = collectives.iallreduce(to_array(flat), self._dups[c], "sum")
        else:
            collectives.allreduce(to_array(flat), self._dups[c], "sum", check=False)
            request = _Done()
        self._launched.append((members, flat, request))

    # -- end of backward: the rest, then write .grad ---------------------------------------------
    def _finish(self) -> None:
        for i in self._bucket_of:  # unused here, or a backward that never ran: zero partials
            self._mark_ready(i)
        self._launch_in_order(final=True)
        for members, flat, request in self._launched:
            request.wait()
            offset = 0
            for i in members:
                p = self._params[i]
                n = p.numel()
                g = flat[offset:offset + n].view_as(p)
                offset += n
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        self._clear()


class _Done:
    """A reduction that completed when it was started (``overlap=False``)."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        pass
