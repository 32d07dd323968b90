"""DomainTensor ops on CUDA: the CPU suite's own equality tests, run again here
with the sharded side on the GPU and the one-process oracle on the CPU.

Each test below is a CPU test (same parametrization, same cases) whose module's
oracle is swapped, while it runs, for ``gpu_env.assert_matches_on_device``:
output, input gradients and parameter gradients computed on the GPU (halo fill
and accumulate, collectives and repartition on device tensors) against plain
torch on the whole tensor, float64 tight and float32 at rtol 1e-5 with TF32
off. Only tests that reach the oracle alone are taken: tests that compare extra
values themselves, or that close over CPU tensors (masks, fields), would fail
on devices, not on domainpar.
"""
import inspect
import sys

import pytest
from gpu_env import TORCH_CUDA_MISSING, assert_matches_on_device

if TORCH_CUDA_MISSING:  # one skip for the module, none of its cases built
    pytest.skip(TORCH_CUDA_MISSING, allow_module_level=True)
import test_conv  # noqa: E402
import test_fft  # noqa: E402
import test_norm  # noqa: E402
import test_pool  # noqa: E402
import test_reductions  # noqa: E402
import test_resample  # noqa: E402

pytestmark = pytest.mark.mpi


def _on_the_gpu(test):
    """``test`` with its module's oracle running the sharded side on the GPU.
    A function of this module (so pytest reports it here), with ``test``'s
    signature and parametrization."""
    module = sys.modules[test.__module__]

    def run(**kwargs):
        saved = module.assert_matches_single_process
        module.assert_matches_single_process = assert_matches_on_device
        try:
            return test(**kwargs)
        finally:
            module.assert_matches_single_process = saved

    run.__signature__ = inspect.signature(test)
    run.pytestmark = list(getattr(test, "pytestmark", []))
    run.__doc__ = test.__doc__
    return run


test_conv_matches_one_process = _on_the_gpu(test_conv.test_conv_matches_one_process)
test_conv_float32 = _on_the_gpu(test_conv.test_conv_float32)
backward_in_pieces = test_conv.backward_in_pieces  # the fixture the next test asks for
test_conv_backward_in_pieces_matches_one_process = _on_the_gpu(
    test_conv.test_conv_backward_in_pieces_matches_one_process)
test_conv_transpose_matches_one_process = _on_the_gpu(
    test_conv.test_conv_transpose_matches_one_process)
test_conv_transpose_float32 = _on_the_gpu(test_conv.test_conv_transpose_float32)
test_pad_matches_one_process = _on_the_gpu(test_conv.test_pad_matches_one_process)
test_avg_pool = _on_the_gpu(test_pool.test_avg_pool)
test_norm_module_matches_one_process = _on_the_gpu(test_norm.test_module_matches_one_process)
test_norm_under_domain_parallel = _on_the_gpu(test_norm.test_under_domain_parallel)
test_interpolate_matches_one_process = _on_the_gpu(
    test_resample.test_interpolate_matches_one_process)
test_upsample_module = _on_the_gpu(test_resample.test_upsample_module)
test_fft_matches_one_process = _on_the_gpu(test_fft.test_transform_matches_one_process)
test_reductions_match_one_process = _on_the_gpu(test_reductions.test_reductions_match_one_process)
test_whole_tensor_reductions = _on_the_gpu(test_reductions.test_whole_tensor_reductions)
test_normalize_matches_one_process = _on_the_gpu(
    test_reductions.test_normalize_matches_one_process)
