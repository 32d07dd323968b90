"""domainpar: domain parallelism for scientific machine learning on MPI.

The public face: re-exports only (see ../shared/DESIGN.md, "The public names").
"""
from .comm import (Decomposition, DomainparError, HaloExchange, LayoutError, MismatchError,
                   ProcessGrid, init)
from . import ops  # noqa: F401  (registers the op rules)
from .tensor import DomainTensor, UnsupportedOpError, allow_gather, scatter

__version__ = "0.1.0"

__all__ = ["Decomposition", "DomainTensor", "DomainparError", "HaloExchange", "LayoutError",
           "MismatchError", "ProcessGrid", "UnsupportedOpError", "allow_gather", "init",
           "scatter", "__version__"]
