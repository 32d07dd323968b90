"""MPI runtime: init, abort on uncaught exceptions, node-local device binding,
glibc's malloc thresholds, and the capability report behind ``domainpar info``."""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from types import TracebackType

from mpi4py import MPI

_initialised = False
_abort_hook_installed = False


def init(bind_device: bool = True) -> MPI.Comm:
    """Collective on first call (over ``MPI.COMM_WORLD``); idempotent.

    Starts MPI if needed (also fine without ``mpiexec``: a world of one), makes
    an uncaught exception on any rank abort the whole job instead of leaving the
    other ranks waiting in their next collective, and binds this rank to a GPU
    chosen by its node-local rank when CuPy sees one.

    Parameters
    ----------
    bind_device : bool, default True
        Make GPU ``node_local_rank % count`` this rank's current device (for
        CuPy, and for torch when it is loaded) when CuPy sees a GPU; False
        leaves the device choice to the caller.

    Returns
    -------
    mpi4py.MPI.Comm
        ``MPI.COMM_WORLD``.
    """
    global _initialised
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    if not _initialised:
        install_abort_hook()
        if bind_device:
            bind_gpu()
        _initialised = True
    return MPI.COMM_WORLD


def install_abort_hook() -> None:
    """Local; idempotent. Make an uncaught exception (KeyboardInterrupt from a
    Ctrl-C too) on this rank print its traceback and then abort the whole MPI
    job, instead of leaving the other ranks waiting in their next collective.

    Installed by ``init()``, on import of ``domainpar.comm`` when MPI already
    runs with more than one process, and when a ProcessGrid is made: a script
    that never calls ``dp.init()`` is covered too. Does nothing in a world of one.
    """
    global _abort_hook_installed
    if _abort_hook_installed:
        return
    _abort_hook_installed = True
    previous = sys.excepthook

    def abort_on_uncaught(kind: type[BaseException], value: BaseException,
                          tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            sys.stderr.write(f"domainpar: uncaught {kind.__name__} on rank "
                             f"{MPI.COMM_WORLD.Get_rank()}; aborting the job\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_on_uncaught


def install_abort_hook_under_mpi() -> None:
    """Local. ``install_abort_hook()`` when MPI runs with more than one process."""
    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        install_abort_hook()


install_abort_hook_under_mpi()  # on import: domainpar used under mpiexec without dp.init()


def switch(name: str) -> tuple[str, str | None]:
    """Local. The on/off setting ``name`` as the environment gives it ("" unset,
    "0" or "1") and, for any other value, the problem naming the valid ones (for
    the caller to raise, or to ``agree`` on where ranks may differ)."""
    value = os.environ.get(name, "")
    if value in ("", "0", "1"):
        return value, None
    return value, f"{name}={value!r}: use 1, 0 or leave it unset"


# -- glibc's malloc ---------------------------------------------------------------------------
# glibc serves a block past its mmap threshold with fresh pages, faulted in (and zeroed)
# at first touch and returned at free; the threshold starts at 128 KiB and rises, as
# such blocks are freed, to at most 32 MiB, and free heap memory past twice it is
# trimmed back to the kernel. A training step allocates and frees the same sizes every
# step, so under those defaults it faults its activations in again every step: 2,700-
# 5,000 page faults (11-20 MiB) per rank in a UNet3d step at 64^3 on 2 ranks, 400,000
# (1.6 GiB) in one at 128^3 on 1 rank (docs/benchmarks.md, "The allocator"). Fixed
# thresholds keep blocks under 2 GiB in the heap, never trimmed: each step reuses the
# last one's pages (7-220 faults a step at 64^3), and resident memory stays at its
# peak instead of following the live tensors.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_FIXED_THRESHOLD = 2**31 - 1  # mallopt takes a C int
# The user's own choice, which domainpar leaves as it is.
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
               "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


@functools.cache
def malloc_thresholds() -> str:
    """Local; once per process, on import of ``domainpar.comm``. Fix glibc's mmap
    and trim thresholds at 2 GiB (``mallopt``) and say what the allocator does now.

    ``DOMAINPAR_MALLOC=0`` leaves glibc's own thresholds, as do thresholds the
    environment sets (``MALLOC_*_`` variables, ``glibc.malloc`` tunables) and a
    preloaded allocator (jemalloc, tcmalloc, mimalloc). Raises ValueError for a
    value other than 0 or 1.
    """
    setting = os.environ.get("DOMAINPAR_MALLOC", "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"DOMAINPAR_MALLOC={setting!r}: use 1 (fixed malloc thresholds, the "
                         f"default) or 0 (glibc's own), or unset it")
    if setting == "0":
        return "glibc's own thresholds (DOMAINPAR_MALLOC=0)"
    users = [k for k in _MALLOC_ENV if k in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        users.append("GLIBC_TUNABLES")
    if users:
        return f"thresholds as the environment sets them ({', '.join(users)})"
    preload = os.environ.get("LD_PRELOAD", "")
    other = [name for name in _OTHER_ALLOCATORS if name in preload]
    if other:
        return f"{other[0]} (preloaded): left as it is"
    done = set_malloc_thresholds(_FIXED_THRESHOLD, _FIXED_THRESHOLD)
    if done is None:
        return "not glibc: left as it is"
    if not done:
        return "glibc refused fixed thresholds: its own"
    return ("fixed by domainpar: blocks under 2 GiB stay in the heap, never trimmed "
            "(DOMAINPAR_MALLOC=0: glibc's own)")


def set_malloc_thresholds(mmap_threshold: int, trim_threshold: int) -> bool | None:
    """Local. glibc's ``mallopt``: blocks from ``mmap_threshold`` bytes get fresh
    pages (returned at free), free heap memory past ``trim_threshold`` goes back
    to the kernel; either fixed turns off glibc's own rising thresholds. True if
    glibc took both, False if it refused one, None without glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (present in glibc only)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
                and mallopt(_M_TRIM_THRESHOLD, trim_threshold))


malloc_thresholds()  # on import, before the first large tensor


@functools.cache
def node_comm() -> MPI.Comm:
    """Collective on first call. The processes of this node (shared memory)."""
    return MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)


def local_rank() -> int:
    """Collective on first call. This process's rank among those on its node."""
    return node_comm().Get_rank()


def gpu_count() -> int:
    """GPUs this process sees through CuPy (0 without CuPy or without a GPU)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def bind_gpu() -> int | None:
    """Collective on first call. Make GPU ``local_rank % count`` this process's
    current device (several ranks may share one), for CuPy and, when it is
    loaded, for torch; returns its index or None."""
    count = gpu_count()
    if count == 0:
        return None
    device = local_rank() % count
    import cupy
    cupy.cuda.Device(device).use()
    # torch keeps a current device of its own ("cuda" means it): left at 0, every
    # rank's tensors would land on GPU 0 while CuPy works on another one. Only
    # set if torch is already loaded: this layer never imports it.
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(device)
    return device


@functools.cache
def cuda_aware_mpi() -> tuple[bool | None, str]:
    """(yes/no/unknown, how that was decided) for passing device buffers to MPI.

    ``DOMAINPAR_CUDA_AWARE=1`` or ``0`` forces the answer (to force staging, or
    for an MPI that is CUDA-aware but cannot say so); otherwise the library is
    asked through ``MPIX_Query_cuda_support`` where it has that call.
    """
    forced = os.environ.get("DOMAINPAR_CUDA_AWARE", "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"forced by DOMAINPAR_CUDA_AWARE={forced}"
    if forced:  # a typo must not silently pick the other path
        raise ValueError(f"DOMAINPAR_CUDA_AWARE={forced!r}: use 1 (pass device buffers to "
                         "MPI) or 0 (stage them through pinned host memory), or unset it")
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None, "the MPI library has no MPIX_Query_cuda_support; set DOMAINPAR_CUDA_AWARE"
    query.restype = ctypes.c_int
    return bool(query()), "MPIX_Query_cuda_support()"


# How device (CuPy, torch CUDA) arrays meet MPI, by whether MPI is CUDA-aware.
DEVICE_PATHS = {True: "direct: device memory handed to MPI (CUDA-aware)",
                False: "staged: through pinned host buffers (MPI not known to be CUDA-aware)"}


def stages_device_buffers() -> bool:
    """Local. Whether device arrays go to MPI through pinned host memory (MPI
    not known to be CUDA-aware) rather than as they are; see ``cuda_aware_mpi``."""
    return not cuda_aware_mpi()[0]


def capabilities() -> dict[str, object]:
    """Local. What this process's MPI, GPU and I/O stack can do (no torch here;
    the CLI adds torch's view)."""
    from . import native, packing
    try:
        aware, how = cuda_aware_mpi()
    except ValueError as exc:  # reported, so that `domainpar info` shows the mistake
        aware, how = None, str(exc)
    vendor, version = MPI.get_vendor()
    report = {
        # Open MPI ends the string with a NUL, which would reach the terminal
        "mpi_library": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
        "mpi_vendor": f"{vendor} {'.'.join(map(str, version))}",
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "world_size": MPI.COMM_WORLD.Get_size(),
        "cuda_aware_mpi": {True: "yes", False: "no", None: "unknown"}[aware],
        "cuda_aware_mpi_how": how,
        "device_buffers": DEVICE_PATHS[bool(aware)],
        "cupy": _cupy_report(),
        "h5py": _h5py_report(),
        "malloc": malloc_thresholds(),
    }
    report["native_kernels"] = native.libraries()
    report["cuda_kernels"] = packing.cuda_kernels()
    return report


def _cupy_report() -> str:
    try:
        import cupy
    except Exception as exc:
        return f"not installed ({type(exc).__name__})"
    count = gpu_count()
    return f"{cupy.__version__}, {count} GPU(s) visible"


def _h5py_report() -> str:
    try:
        import h5py
    except Exception as exc:
        return f"not installed ({type(exc).__name__})"
    mpi = "with MPI (parallel HDF5)" if h5py.get_config().mpi else "without MPI (serial HDF5)"
    return f"{h5py.__version__} {mpi}, HDF5 {h5py.version.hdf5_version}"

