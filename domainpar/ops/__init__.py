"""Domain-parallel op families. Importing this package registers their rules in
the dispatch table (``domainpar.tensor.dispatch``)."""
from . import (  # noqa: F401  # noqa: F401  # noqa: F401  # noqa: F401
    attention,  # noqa: F401
    conv,
    conv_transpose,
    dropout,
    einsum,
    fft,
    index,
    interop,  # noqa: F401
    linear,
    loss,
    norm,
    pad,
    pointwise,
    pool,  # noqa: F401
    reduce,
    resample,  # noqa: F401
    shape,
)
