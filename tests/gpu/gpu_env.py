"""What the GPU suite needs, probed once per process, and the helpers its tests
share: moving test data between numpy and the device, and the oracle with the
sharded side on the GPU.

Every probe gives the same answer on every rank of a job (same machine, same
libraries), so all ranks select and skip the same tests.
"""
from __future__ import annotations

import numpy as np
import pytest


def _probe_gpu() -> str | None:
    """None when CuPy sees a CUDA GPU, else why the GPU tests cannot run."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no CuPy, no driver, no device: all mean "not here"
        return f"needs CuPy and a CUDA GPU (CuPy: {type(exc).__name__}: {exc})"
    if count == 0:
        return "needs CuPy and a CUDA GPU (CuPy sees no GPU)"
    return None


def _probe_torch() -> str | None:
    try:
        import torch
    except ImportError as exc:
        return f"needs torch built with CUDA ({exc})"
    if not torch.cuda.is_available():
        return f"needs torch built with CUDA and a GPU (torch {torch.__version__} sees none)"
    return None


GPU_MISSING = _probe_gpu()
TORCH_CUDA_MISSING = GPU_MISSING or _probe_torch()
needs_torch_cuda = pytest.mark.skipif(TORCH_CUDA_MISSING is not None,
                                      reason=TORCH_CUDA_MISSING or "")


# Device array kinds: CuPy arrays and torch CUDA tensors.
KINDS = ["cupy", pytest.param("torch", marks=needs_torch_cuda)]


def to_device(host: np.ndarray, kind: str):
    """A copy of ``host`` on the current GPU, as a CuPy array or a torch tensor."""
    if kind == "cupy":
        import cupy
        return cupy.asarray(host)
    import torch
    return torch.from_numpy(np.ascontiguousarray(host)).cuda()


def to_host(a) -> np.ndarray:
    """A numpy copy of a CuPy array or a torch tensor (waits for the device)."""
    if type(a).__module__.startswith("torch"):
        return a.detach().cpu().numpy()
    import cupy
    return cupy.asnumpy(a)


# -- the oracle with the sharded run on the GPU ---------------------------------------------------
def on_device(model, device="cuda"):
    """``model`` (a module or a function) made to run on ``device``: its inputs
    are moved there and its output back to the CPU, both differentiably, so that
    ``domainpar.testing.assert_matches_single_process`` compares a GPU run with
    its one-process CPU run (outputs, input and parameter gradients). A module
    keeps its parameter names (the oracle matches gradients by name)."""
    def moved(call):
        def run(*xs):
            out = call(*(x.to(device) for x in xs))
            if out.device.type != device:  # the test would pass without touching the GPU
                raise AssertionError(f"the sharded run's output is on {out.device}, not {device}")
            return out.cpu()
        return run

    import torch
    if isinstance(model, torch.nn.Module):
        model.to(device)
        model.forward = moved(model.forward)
        return model
    return moved(model)


def assert_matches_on_device(model, inputs, grid, shard, *, wrap=None, device="cuda", **kw):
    """Collective. ``assert_matches_single_process`` with the sharded copy of
    ``model`` (and ``wrap``, e.g. DomainParallel, around it) run on ``device``."""
    from domainpar.testing import assert_matches_single_process

    def on(m):
        m = on_device(m, device)
        return wrap(m) if wrap is not None else m
    return assert_matches_single_process(model, inputs, grid, shard, wrap=on, **kw)
