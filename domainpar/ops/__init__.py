"""Domain-parallel op families. Importing this package registers their rules in
the dispatch table (``domainpar.tensor.dispatch``)."""
from . import index, pointwise, reduce  # noqa: F401
from . import conv, linear, loss, pad, shape  # noqa: F401
from . import resample  # noqa: F401
from . import pool  # noqa: F401
from . import dropout, norm  # noqa: F401
from . import einsum, fft  # noqa: F401
from . import attention  # noqa: F401
from . import interop  # noqa: F401
