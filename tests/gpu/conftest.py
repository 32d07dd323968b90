"""Fixtures of the GPU suite (tests/gpu/README.md says how to run it). Off a GPU
machine every test here skips at collection, naming what it needs, and none of
these fixtures runs."""
import pytest
from gpu_env import GPU_MISSING, TORCH_CUDA_MISSING

if TORCH_CUDA_MISSING is None:
    import torch
    # The oracle compares float32 with rtol 1e-5 against the CPU: TF32 matrix
    # units (about 3e-4) would fail it for a reason that is not domainpar's.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="session", autouse=True)
def bound_gpu():
    """Collective (first GPU test). ``dp.init()``: each rank binds GPU
    ``node-local rank % GPUs`` for CuPy and torch, as an application would."""
    if GPU_MISSING is not None:  # only reached by a test that needs no GPU
        return None
    import domainpar as dp
    from domainpar.comm import runtime
    dp.init()
    return runtime.bind_gpu()


def _library_says():
    """(CUDA-aware?, how decided) under the caller's own environment."""
    from domainpar.comm import runtime
    runtime.cuda_aware_mpi.cache_clear()
    try:
        return runtime.cuda_aware_mpi()
    finally:
        runtime.cuda_aware_mpi.cache_clear()


@pytest.fixture(params=["staged", "direct"])
def path(request, monkeypatch):
    """How device buffers meet MPI, forced through DOMAINPAR_CUDA_AWARE:
    'staged' (pinned host buffers) always; 'direct' (device memory handed to
    MPI) only where the MPI library is CUDA-aware, since any other MPI would
    read device pointers as host memory and crash."""
    from domainpar.comm import runtime
    if request.param == "direct":
        aware, how = _library_says()
        if not aware:
            answer = "no" if aware is False else "cannot tell"
            pytest.skip(f"needs a CUDA-aware MPI for the direct path ({how}: {answer}); "
                        "for one that is but cannot say so, run with DOMAINPAR_CUDA_AWARE=1")
    monkeypatch.setenv("DOMAINPAR_CUDA_AWARE", "1" if request.param == "direct" else "0")
    runtime.cuda_aware_mpi.cache_clear()
    yield request.param
    runtime.cuda_aware_mpi.cache_clear()  # the environment is restored after this
