"""domainpar: domain parallelism for scientific machine learning on MPI.

The public face: re-exports only (see docs/design.md, "The public names").
The torch layers load on first use of one of their names, so code that needs
only the MPI core (``domainpar.comm``) never imports torch.
"""
from typing import TYPE_CHECKING, Any

from .comm import Decomposition, DomainparError, HaloExchange, LayoutError, MismatchError, ProcessGrid, init

# The names __getattr__ loads on first use, for type checkers (which cannot
# follow importlib); "x as x" re-exports the ones __all__ leaves out (PEP 484).
if TYPE_CHECKING:
    from . import balance as balance
    from . import io as io
    from . import nn as nn
    from . import points as points
    from .balance import Balancer
    from .nn import DomainParallel, sharded_factories
    from .ops.interop import einsum as einsum
    from .ops.interop import tensordot as tensordot
    from .ops.interop import transpose as transpose
    from .tensor import DomainTensor, UnsupportedOpError, allow_gather, scatter

__version__ = "0.1.0"

# name -> submodule that defines it; importing ``ops`` registers the op rules.
_TORCH_NAMES = {"DomainTensor": "tensor", "UnsupportedOpError": "tensor",
                "allow_gather": "tensor", "scatter": "tensor", "DomainParallel": "nn",
                "sharded_factories": "nn",
                "Balancer": "balance",
                # opt_einsum's backend protocol for arrays of this package (ops/interop.py)
                "einsum": "ops.interop", "tensordot": "ops.interop", "transpose": "ops.interop"}
# torch-level subpackages reachable as attributes (``dp.io``).
_TORCH_MODULES = ("io", "balance", "points", "nn")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        import importlib
        importlib.import_module(".ops", __name__)
        value = getattr(importlib.import_module("." + _TORCH_NAMES[name], __name__), name)
        globals()[name] = value
        return value
    if name in _TORCH_MODULES:
        import importlib
        importlib.import_module(".ops", __name__)
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'domainpar' has no attribute {name!r}")


__all__ = ["Balancer", "Decomposition", "DomainParallel", "DomainTensor", "DomainparError",
           "HaloExchange", "LayoutError", "MismatchError", "ProcessGrid", "UnsupportedOpError",
           "allow_gather", "init", "scatter", "sharded_factories", "__version__"]
