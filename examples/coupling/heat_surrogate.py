"""A small CNN surrogate for one explicit step of the 2-D heat equation, the
model heat2d.f90 and heat2d.c train online through libdomainpar.

Entry point: ``heat_surrogate:make_surrogate`` (module on PYTHONPATH) or
``/path/to/heat_surrogate.py:make_surrogate``. It is a plain torch module: the
same code runs domain-parallel on the simulation's DomainTensors and in one
process on the gathered field (which is how the tests check it).

Why this architecture: one explicit Euler step of u_t = kappa * laplacian(u) is
the linear 5-point stencil u + alpha * (sum of the 4 neighbours - 4 u). A 3x3
convolution into a few channels, mixed back by a 1x1 convolution and added to
the input, can represent that stencil exactly (it is linear, and so is the
net), so online training can drive the error far down, and a falling error
shows learning rather than luck. Circular padding matches the periodic domain.
"""
from __future__ import annotations

from torch import nn


class HeatSurrogate(nn.Module):
    """u -> u + mix(lift(u)); ``raise_on_ranks`` makes forward raise on those MPI
    ranks after all its communication (for the error-path tests: a Python
    exception inside the model, on some ranks only or on all)."""

    def __init__(self, channels: int = 4, raise_on_ranks=()):
        super().__init__()
        self.lift = nn.Conv2d(1, channels, 3, padding=1, padding_mode="circular", bias=False)
        self.mix = nn.Conv2d(channels, 1, 1, bias=False)
        self.raise_on_ranks = tuple(raise_on_ranks)

    def forward(self, u):
        out = u + self.mix(self.lift(u))
        if self.raise_on_ranks:
            from mpi4py import MPI
            if MPI.COMM_WORLD.Get_rank() in self.raise_on_ranks:
                raise RuntimeError("heat surrogate: failing on purpose (raise_on_ranks)")
        return out


def make_surrogate(channels: int = 4, raise_on_ranks=()) -> HeatSurrogate:
    """The factory libdomainpar calls (keyword arguments from the simulation's JSON)."""
    return HeatSurrogate(channels, raise_on_ranks)
