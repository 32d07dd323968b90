"""Point sets sharded along their point dim: spatial partition (recursive
coordinate bisection), neighbour search across blocks (``knn``,
``radius_search``), the gather of neighbour features, and the routed exchange
(``route``: ``Push``/``Pull``) under them and under the index ops' rules on a
sharded dim (``rules``: index_select, gather, indexing by a DomainTensor,
index_add, scatter_add, scatter_reduce, cdist). docs/points.md is the guide.
"""
from . import rules  # noqa: F401  (registers the op rules)
from .partition import Partition, partition
from .route import Pull, Push, Route, fetch, pull, push
from .search import gather, knn, knn_halo_size, radius_search

__all__ = ["Partition", "Pull", "Push", "Route", "fetch", "gather", "knn", "knn_halo_size",
           "partition", "pull", "push", "radius_search"]
