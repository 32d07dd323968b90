"""Torch tensors to and from the arrays the comm layer speaks (numpy, CuPy).

Both directions are zero-copy: a CPU tensor is a numpy view, a CUDA tensor a
CuPy view (DLPack), and a comm result comes back as a tensor on the same device
sharing its memory. Autograd never sees these: the Functions in ``primitives``
call them on detached data inside ``forward`` and ``backward``.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack

from ..comm import buffers


def to_array(t: torch.Tensor, contiguous: bool = True) -> buffers.Array:
    """A numpy or CuPy view of ``t``'s data (made contiguous first if needed, or,
    with ``contiguous=False``, with ``t``'s strides, for a collective that copies
    it out piece by piece anyway)."""
    # A lazy conjugate or negation (x.conj(), x.imag of one) is a bit on the tensor
    # that DLPack and numpy cannot carry: materialise it.
    t = t.detach().resolve_conj().resolve_neg()
    if t._is_zerotensor():  # autograd's storage-less zeros (sgn's gradient of a real input)
        t = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    if contiguous and not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:  # DLPack has bool, but numpy's from_dlpack may not
        return buffers.as_array(t.view(torch.uint8)).view(np.bool_)
    if t.dtype == torch.bfloat16:  # no numpy dtype: travels as its 2-byte pattern
        return buffers.as_array(t.view(torch.int16))
    return buffers.as_array(t)


def from_array(a: buffers.Array, like: torch.Tensor) -> torch.Tensor:
    """The comm result ``a`` as a tensor with ``like``'s dtype and device."""
    if isinstance(a, np.ndarray):
        if like.dtype == torch.bool:
            out = torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(torch.bool)
        elif like.dtype == torch.bfloat16:
            out = torch.from_numpy(np.ascontiguousarray(a)).view(torch.bfloat16)
        else:
            out = torch.from_numpy(a)
    else:
        out = from_dlpack(a)
        if like.dtype == torch.bfloat16:
            out = out.view(torch.bfloat16)
    return out.to(like.device)
