"""Public test helpers: dot-product adjoint tests, the single-process oracle,
errors raised on every rank alike, and rank-agreed test layouts.

``global_dot``/``adjoint_error`` work on numpy arrays (no torch) and are the one
implementation of the dot-product test: ``adjoint_test`` (torch, DomainTensors)
is built on them. The torch helpers load on first use.
"""
from .adjoint import adjoint_error, global_dot
from .errors import check_on_every_rank, raises_on_every_rank
from .layouts import block_sizes, layout

_TORCH_NAMES = ("adjoint_test", "assert_matches_single_process", "inner", "shard_like")


def __getattr__(name):
    if name in _TORCH_NAMES:
        import importlib
        importlib.import_module("domainpar.ops")
        return getattr(importlib.import_module(".oracle", __name__), name)
    raise AttributeError(f"module 'domainpar.testing' has no attribute {name!r}")


__all__ = ["adjoint_error", "adjoint_test", "assert_matches_single_process", "block_sizes",
           "check_on_every_rank", "global_dot", "inner", "layout", "raises_on_every_rank",
           "shard_like"]
