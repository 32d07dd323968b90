"""Public test helpers: dot-product adjoint tests and layout generators."""
from .adjoint import global_dot, adjoint_error

__all__ = ["global_dot", "adjoint_error"]
