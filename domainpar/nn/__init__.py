"""Modules: DomainParallel (parameter broadcast, bucketed gradient reduction);
sharded_factories (buffers that take a DomainTensor's layout when written)."""
from .domain_parallel import DomainParallel
from .factories import sharded_factories

__all__ = ["DomainParallel", "sharded_factories"]
