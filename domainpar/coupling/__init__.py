"""The Python side of libdomainpar, the C and Fortran API for simulations.

A Fortran or C simulation keeps its decomposition, communicator and arrays. It
links libdomainpar (kernels/coupling/), which starts CPython inside the
simulation process and calls ``domainpar.coupling.api``; the simulation needs
to know nothing about Python. Why embedding with the plain CPython C API and not
cffi's embedding mode: cffi is one more build-time dependency (and not
installed in this project's environment), and its embedding still needs a
Python-side init script and a generated C file; the few calls made here (start
the interpreter, import one module, call functions with ints, tuples and
strings) are a page of C against the stable, documented embedding API.

- ``api``: the functions behind the ``dp_*`` calls; collective, returning
  (code, message, value) with the same code and message on every rank.
- ``field``: a simulation array as a DomainTensor over its memory (no copy).
- ``model``: entry-point loading, inference, online training, checkpoints.
- ``memory``: numpy / CuPy views of raw addresses, C and Fortran order.
- ``errors``: the DP_ERR_* codes and the agreement of every call's outcome.
"""
from .errors import CouplingError

__all__ = ["CouplingError"]
