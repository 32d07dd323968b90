"""Deferred: a DomainTensor whose block is computed at its first use, so that a
rule that sees what the next op wants (a slice of a spectrum) can compute less.

Local to create. The block comes from ``compute()``, which may be collective
(the transposes of a distributed FFT, a pad's repartition). Every rank computes
it at the same call: ``dispatch.handle`` computes every Deferred operand of a
call before the call's rule runs, except for the ops in ``TAKES_DEFERRED``,
whose rules look at it first: ``__getitem__`` asks ``narrowed(index)``, the
FFTs take a deferred zero pad's input instead (``ops/fft.py``); where they do
not, they read ``_local``, which computes it. Both happen inside the same torch
call on every rank, as the program runs the same calls everywhere.

``narrowed(index)`` returns the result of ``self[index]`` computed without the whole
block (a DomainTensor), or None. It is asked only while the block has not been
computed: once it has, the block may have been written in place, and slicing it
is the only answer that follows the writes.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..comm.decomposition import Decomposition
from . import dispatch, layout
from .domain_tensor import DomainTensor


class Deferred(DomainTensor):
    """Local. A DomainTensor of layout ``decomposition`` whose block is
    ``compute()``, run at first use (module docstring); ``take(self, index)``
    answers ``self[index]`` without it, or returns None."""

    _compute: Callable[[], torch.Tensor] | None
    _take: Callable[[Deferred, Any], DomainTensor | None] | None
    _block: torch.Tensor | None
    _modes: tuple[bool, bool]  # grad and inference mode where it was made

    @staticmethod
    def __new__(cls, decomposition: Decomposition, dtype: torch.dtype, device: torch.device,
                compute: Callable[[], torch.Tensor],
                take: Callable[[Deferred, Any], DomainTensor | None] | None = None) -> Deferred:
        self = torch.Tensor._make_wrapper_subclass(
            cls, decomposition.global_shape, dtype=dtype, device=device, requires_grad=False)
        self._dec = decomposition
        self._compute, self._take, self._block = compute, take, None
        self._modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        dispatch.pending(self)
        return self

    @property
    def _local(self) -> torch.Tensor:
        """The block, computed on first use."""
        if self._block is None:
            assert self._compute is not None
            with self.as_made():
                block = self._compute()
            if tuple(block.shape) != self._dec.local_shape():
                raise RuntimeError(f"internal: a deferred block of shape {tuple(block.shape)} "
                                   f"does not fit {self._dec}")
            self._block, self._compute, self._take = block, None, None
            dispatch.done(self)
        return self._block

    @_local.setter
    def _local(self, block: torch.Tensor) -> None:
        self._block, self._compute, self._take = block, None, None
        dispatch.done(self)

    @contextlib.contextmanager
    def as_made(self) -> Iterator[None]:
        """Local. Grad and inference mode as where it was made: what is computed
        later records (or not) the graph that one process records at that call."""
        grad, inference = self._modes
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            yield

    def to_local(self) -> torch.Tensor:
        """Collective while the block is not computed (its computation may be),
        local after. This rank's block (differentiable)."""
        return self._local

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # noqa: D105
        if self._block is not None:
            return super().__repr__()
        # local, as repr must be: a rank may print alone
        return (f"DomainTensor(global_shape={tuple(self._dec.global_shape)}, "
                f"dtype={self.dtype}, device={self.device}, "
                f"{layout.sharded_dims_text(self._dec)}, local=<computed at its first use>)")

    @property
    def narrows(self) -> bool:
        """Local. Whether ``narrowed`` may answer (the block is not computed yet and
        the rule that made it can slice without it)."""
        return self._block is None and self._take is not None

    def narrowed(self, index: Any) -> DomainTensor | None:
        """Local or collective, as the rule that made it. ``self[index]`` without the
        whole block, or None (then index the block)."""
        return None if self._take is None else self._take(self, index)

