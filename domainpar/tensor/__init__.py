"""DomainTensor and the op dispatch table (rules for op families live in ops/)."""
from . import compiling, functions, protocol  # noqa: F401  (registers the tensor protocol rules)
from .dispatch import UnsupportedOpError, allow_gather, register
from .domain_tensor import DomainTensor, scatter

functions.install()  # user autograd.Functions on DomainTensors keep the graph
compiling.hide_from_dynamo(DomainTensor)  # torch.compile: DomainTensor ops run eagerly

__all__ = ["DomainTensor", "UnsupportedOpError", "allow_gather", "register", "scatter"]
