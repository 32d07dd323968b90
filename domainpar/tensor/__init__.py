"""DomainTensor and the op dispatch table (rules for op families live in ops/)."""
from . import protocol  # noqa: F401  (registers the tensor protocol rules)
from .dispatch import UnsupportedOpError, allow_gather, register
from .domain_tensor import DomainTensor, scatter

__all__ = ["DomainTensor", "UnsupportedOpError", "allow_gather", "register", "scatter"]
