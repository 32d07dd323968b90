"""DomainParallel: replicated parameters, gradients reduced bucketed and
overlapped with backward.

Without a wrapper every op that uses a parameter on sharded data sums that
parameter's gradient over the grid in its own backward (a Broadcast in the
graph, ``tensor.params.enter_domain``): correct, but one small allreduce per
use. Inside ``DomainParallel.forward`` those uses are *deferred*: each op's
backward hands its partial gradient to the reducer below and contributes
nothing to ``.grad`` itself. The reducer adds the partials of a parameter
until every use recorded in forward has arrived, packs ready parameters into
buckets of about ``bucket_cap_mb``, and starts a nonblocking allreduce per full
bucket while backward goes on. At the end of backward (an autograd engine
callback) the last buckets start, all are waited for, and the sums are added
to ``.grad``.

Why partials and not ``.grad`` (as DDP does): the true gradient is a SUM over
ranks (DESIGN.md); summing ``.grad`` would also multiply by the number of
ranks whatever a parameter received from computations on replicated values
(identical on every rank) and whatever ``.grad`` held before this backward.
Only the partials are summed, so both stay exact.

Ranks build buckets in the order parameters become ready. That order is the
autograd engine's, identical on every rank for the same model, so buckets and
their nonblocking allreduces match across ranks.
"""
from __future__ import annotations

import itertools
from typing import Iterable

import torch
from mpi4py import MPI

from ..autograd._arrays import to_array
from ..comm import collectives
from ..comm.grid import ProcessGrid
from ..tensor import params as domain_params
from ..tensor.dispatch import UnsupportedOpError


class DomainParallel(torch.nn.Module):
    """Collective (construction broadcasts parameters and buffers from rank 0 of
    ``grid``). Wraps ``module`` so that its parameters' gradients are summed over
    the grid bucketed and asynchronously during backward.

    ``bucket_cap_mb``: the size of a bucket. ``overlap``: start each full
    bucket's allreduce nonblocking while backward goes on (the default, for
    networks with asynchronous progress), or reduce it at once with a blocking
    allreduce, which is faster where nonblocking collectives are slower and do
    not progress in the background (``domainpar bench grads`` measures both).

    ``module`` runs unchanged on DomainTensors; grids with a batch axis (say
    ``shard={0: 0, 2: 1}``) need nothing special: gradients are summed over all
    ranks that hold distinct data. Buffers are broadcast once here; ops that
    update buffers (normalization running stats) keep them identical on every
    rank themselves.
    """

    def __init__(self, module: torch.nn.Module, grid: ProcessGrid, *,
                 bucket_cap_mb: float = 25.0, overlap: bool = True):
        super().__init__()
        self.module = module
        self.grid = grid
        with torch.no_grad():
            for t in itertools.chain(module.parameters(), module.buffers()):
                _broadcast_in_place(t, grid.comm)
        self._reducer = _Reducer(module.parameters(), int(bucket_cap_mb * 2**20), overlap)

    def forward(self, *args, **kwargs):
        token = domain_params.set_deferrer(self._reducer.deferral)
        try:
            return self.module(*args, **kwargs)
        finally:
            domain_params.reset_deferrer(token)


def _broadcast_in_place(t: torch.Tensor, comm: MPI.Comm) -> None:
    data = t.detach()
    work = data if data.is_contiguous() else data.contiguous()
    collectives.bcast(to_array(work), comm, root=0)
    if work is not data:
        data.copy_(work)


class _Reducer:
    """Deferred partial gradients of one module's parameters, reduced in buckets."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter], bucket_bytes: int,
                 overlap: bool = True):
        self._managed = {id(p): p for p in parameters}
        self._overlap = overlap
        self._bucket_bytes = max(bucket_bytes, 1)
        # id(op's comm) -> (index, private duplicate); the index, not id(), orders
        # buckets, since ids differ between ranks and the order must not.
        self._comms: dict[int, tuple[int, MPI.Comm]] = {}
        self._expected: dict[int, int] = {}       # id(p) -> uses recorded in forward
        self._partial: dict[int, torch.Tensor] = {}
        self._comm_of: dict[int, tuple[int, MPI.Comm]] = {}
        self._open: dict[tuple, list[int]] = {}   # bucket key -> ready param ids
        self._open_bytes: dict[tuple, int] = {}
        self._launched: list[tuple[list[int], torch.Tensor, collectives.PendingReduction]] = []
        self._callback_queued = False

    # -- forward: record uses ----------------------------------------------------------------
    def deferral(self, p: torch.Tensor, comm: MPI.Comm):
        """Called by ops in forward for every use of a replicated tensor ``p``; returns
        the callable receiving its partial gradient, or None for tensors that are
        not this module's parameters (those are reduced by the op itself)."""
        pid = id(p)
        if pid not in self._managed:
            return None
        if id(comm) not in self._comms:  # collective, in forward order on every rank
            self._comms[id(comm)] = (len(self._comms), comm.Dup())
        own = self._comms[id(comm)]
        previous = self._comm_of.setdefault(pid, own)
        if previous is not own:
            raise UnsupportedOpError(
                "DomainParallel: a parameter used on tensors sharded over different grid "
                "axes in one step; use it outside DomainParallel (per-op reductions)")
        self._expected[pid] = self._expected.get(pid, 0) + 1
        return lambda grad: self._arrive(pid, grad)

    # -- backward: collect partials, start full buckets --------------------------------------
    def _arrive(self, pid: int, grad: torch.Tensor) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        # Kept as handed over, no copy: autograd never writes to a gradient it has
        # passed to a backward, and a second use makes a new sum.
        self._partial[pid] = self._partial[pid] + grad if pid in self._partial else grad
        for _, _, pending in self._launched:  # without a progress thread MPI moves
            pending.test()                      # nonblocking work only inside calls
        self._expected[pid] = self._expected.get(pid, 1) - 1
        if self._expected[pid] <= 0:
            self._ready(pid)

    def _ready(self, pid: int) -> None:
        g = self._partial[pid]
        key = (self._comm_of[pid][0], str(g.dtype), str(g.device))
        self._open.setdefault(key, []).append(pid)
        self._open_bytes[key] = self._open_bytes.get(key, 0) + g.numel() * g.element_size()
        if self._open_bytes[key] >= self._bucket_bytes:
            self._launch(key)

    def _launch(self, key: tuple) -> None:
        pids = self._open.pop(key)
        self._open_bytes.pop(key)
        flat = torch.cat([self._partial[pid].reshape(-1) for pid in pids])
        comm = self._comm_of[pids[0]][1]
        if self._overlap:
            request = collectives.iallreduce(to_array(flat), comm, "sum")
        else:
            collectives.allreduce(to_array(flat), comm, "sum", check=False)
            request = _Done()
        self._launched.append((pids, flat, request))

    # -- end of backward: the rest, then write .grad ---------------------------------------------
    def _finish(self) -> None:
        for pid in list(self._partial):  # uses whose backward never ran: ready now
            if self._expected.get(pid, 0) > 0:
                self._expected[pid] = 0
                self._ready(pid)
        for key in sorted(self._open):
            self._launch(key)
        for pids, flat, request in self._launched:
            request.wait()
            offset = 0
            for pid in pids:
                p = self._managed[pid]
                n = p.numel()
                g = flat[offset:offset + n].view_as(p)
                offset += n
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        self._partial.clear()
        self._expected.clear()
        self._launched.clear()
        self._callback_queued = False


class _Done:
    """A reduction that completed when it was started (``overlap=False``)."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        pass
