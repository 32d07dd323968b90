"""Models for the fault driver (faults.c, tests/test_coupling_faults.py).

``make_boundary``: conv, then a learned gain on the global x = 0 row that only
the ranks holding that row apply (a parameter used on some ranks only). In eval
mode with ``digest`` it returns a field filled with the sum of its parameters,
so a test can see whether the replicas on every rank are the same.
``raise_first_on``: ranks whose forward raises before any communication.
"""
import torch
from mpi4py import MPI
from torch import nn


class Boundary(nn.Module):
    def __init__(self, raise_first_on=(), digest=False):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1, padding_mode="circular", bias=False)
        self.gain = nn.Parameter(torch.full((1, 1, 1), 0.5))
        self.raise_first_on = tuple(raise_first_on)
        self.digest = digest

    def forward(self, u):
        if MPI.COMM_WORLD.Get_rank() in self.raise_first_on:
            raise RuntimeError("fault model: raising before the first message")
        if self.digest and not self.training:
            total = sum(float(p.detach().double().sum()) for p in self.parameters())
            return u * 0 + total
        from domainpar.tensor import DomainTensor
        y = self.conv(u)
        if not isinstance(u, DomainTensor):  # one process: the whole field
            edge = torch.zeros_like(u)
            edge[:, :, 0] = 1.0
            return y + self.gain * edge * y
        dec = u.decomposition
        if dec.offsets()[2] == 0 and dec.local_shape()[2] > 0:  # holds the x = 0 row
            edge = torch.zeros_like(u.to_local())
            edge[:, :, 0] = 1.0
            y = y + self.gain * DomainTensor(edge, dec) * y
        return y


def make_boundary(**kwargs):
    return Boundary(**kwargs)
