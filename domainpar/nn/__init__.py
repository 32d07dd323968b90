"""Modules: DomainParallel (parameter broadcast, bucketed gradient reduction)."""
from .domain_parallel import DomainParallel

__all__ = ["DomainParallel"]
