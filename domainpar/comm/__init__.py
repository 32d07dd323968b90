"""MPI and arrays, no torch: the layer everything else in domainpar stands on."""
from .collectives import allgatherv, allreduce, bcast, gatherv, iallreduce, repartition, scatterv
from .decomposition import Decomposition, balanced_sizes
from .errors import DomainparError, LayoutError, MismatchError
from .grid import ProcessGrid
from .halo import HaloExchange
from .runtime import capabilities, cuda_aware_mpi, init, local_rank

__all__ = ["allgatherv", "allreduce", "bcast", "iallreduce", "gatherv", "repartition", "scatterv",
           "Decomposition", "balanced_sizes", "DomainparError", "LayoutError", "MismatchError", "ProcessGrid",
           "HaloExchange", "capabilities", "cuda_aware_mpi", "init", "local_rank"]
