"""domainpar: domain parallelism for scientific machine learning on MPI.

The public face: re-exports only (see ../shared/DESIGN.md, "The public names").
"""
from .comm import (Decomposition, DomainparError, HaloExchange, LayoutError, MismatchError,
                   ProcessGrid, init)

__version__ = "0.1.0"

__all__ = ["Decomposition", "DomainparError", "HaloExchange", "LayoutError", "MismatchError",
           "ProcessGrid", "init", "__version__"]
