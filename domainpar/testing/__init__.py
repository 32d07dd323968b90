"""Public test helpers: dot-product adjoint tests and the single-process oracle."""
from .adjoint import adjoint_error, global_dot
from .oracle import adjoint_test, assert_matches_single_process, inner, shard_like

__all__ = ["adjoint_error", "adjoint_test", "assert_matches_single_process", "global_dot",
           "inner", "shard_like"]
