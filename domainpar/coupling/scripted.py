"""TorchScript models for the coupling API, run block by block with a halo.

Neighbour-wise collective (a halo fill per call; backward sums parameter
gradients over the grid).

A scripted module runs its ops in C++, below ``__torch_function__``, so it
cannot take DomainTensors. Instead every rank runs it on its own block widened
by ``halo`` ghost cells on both sides of every sharded dim, filled by domainpar's
halo exchange, and keeps the owned part of the output. That equals the model on
the whole domain exactly when (1) every grid axis is periodic (ghosts then hold
real cells; beyond a non-periodic edge the model would see zeros where its own
layers see their padding, which differs after the first layer: refused), (2)
the model keeps spatial extents (same padding) and is translation-equivariant
(convolutions, pointwise layers), and (3) each output cell depends only on
inputs at most ``halo`` cells away along each dim (the receptive-field radius:
the sum of the kernel radii of its layers). (2) is checked; (3) is the caller's
promise, as the ``halo`` option.

Training: the loss is domainpar's global reduction over the owned outputs, so
each rank's backward yields its partial parameter gradient; a hook on each
parameter sums the partials over the grid (the true gradient, docs/design.md).
"""
from __future__ import annotations

import torch

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from ..comm.grid import ProcessGrid
from ..comm.halo import HaloExchange
from .errors import ARGUMENT, MODEL, CouplingError


class Blockwise(torch.nn.Module):
    """A TorchScript module applied per block with ``halo`` ghost cells."""

    def __init__(self, scripted: torch.jit.ScriptModule, halo: object, grid: ProcessGrid):
        super().__init__()
        if not isinstance(halo, int) or isinstance(halo, bool) or halo < 0:
            raise CouplingError(ARGUMENT, "a TorchScript model needs the option \"halo\": the "
                                          "model's receptive-field radius in cells (an int >= 0)")
        if not all(grid.periodic):
            raise CouplingError(ARGUMENT, f"a TorchScript model runs block by block, exactly only "
                                          f"on a periodic grid; this grid has periodic="
                                          f"{grid.periodic}. Give a Python factory instead")
        self.scripted = scripted
        self.halo = halo
        self._exchanges: dict = {}
        self._summed = False

    def _sum_gradients_over(self, comm) -> None:
        """Once, on the parameters as they are at the first forward (after any
        dtype or device conversion): hooks that sum each gradient over ``comm``."""
        if not self._summed:
            for p in self.scripted.parameters():
                p.register_hook(lambda g: ag.allreduce_sum(g.contiguous(), comm))
            self._summed = True

    def forward(self, x):
        """Neighbour-wise collective (the halo exchange of the input block). The
        TorchScript model run on this rank's block padded by its neighbours' ghost cells."""
        from ..tensor import DomainTensor
        dec = x.decomposition
        self._sum_gradients_over(dec.grid.comm)
        h = self.halo
        local = x.to_local()
        padded = local.new_zeros(tuple(n + 2 * h if d in dec.shard else n
                                       for d, n in enumerate(local.shape)))
        owned = tuple(slice(h, h + n) if d in dec.shard else slice(None)
                      for d, n in enumerate(local.shape))
        with torch.no_grad():  # the input is data: no gradient flows back into it
            padded[owned] = local
            self._exchange(dec).fill(padded, check=False)
        out = self.scripted(padded)
        if not isinstance(out, torch.Tensor) or out.ndim != padded.ndim or \
                any(out.shape[d] != padded.shape[d] for d in dec.shard):
            raise CouplingError(MODEL, f"the TorchScript model turned a block of shape "
                                       f"{tuple(padded.shape)} into "
                                       f"{tuple(getattr(out, 'shape', ()))}: it must keep the "
                                       f"spatial extents (same padding) to run block by block")
        shape = list(dec.global_shape)
        shape[1] = out.shape[1]
        out_dec = Decomposition(shape, dec.grid, dec.shard,
                                {d: dec.block_sizes(d) for d in dec.shard}, check=False)
        return DomainTensor(out[owned], out_dec)

    def _exchange(self, dec: Decomposition) -> HaloExchange:
        key = (dec.global_shape, tuple(dec.block_sizes(d) for d in dec.shard))
        if key not in self._exchanges:
            self._exchanges[key] = HaloExchange(dec, {d: self.halo for d in dec.shard},
                                                check=False)
        return self._exchanges[key]
