"""Modules: DomainParallel (parameter broadcast, bucketed gradient reduction);
sharded_factories (buffers that take a DomainTensor's layout when written);
fused (halo fusion: one exchange for a chain of convs and pointwise ops)."""
from .domain_parallel import DomainParallel
from .factories import sharded_factories
from .fusion import fused

__all__ = ["DomainParallel", "fused", "sharded_factories"]
