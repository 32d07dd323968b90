"""Device binding: each rank works on GPU ``node-local rank % GPUs on the node``,
in CuPy and in torch alike, so several ranks share one GPU (all on GPU 0 where
there is one) and ranks spread one per GPU where there are several."""
import pytest
from gpu_env import GPU_MISSING, needs_torch_cuda
from mpi4py import MPI

from domainpar.comm import runtime

if GPU_MISSING:  # one skip for the module, none of its cases built
    pytest.skip(GPU_MISSING, allow_module_level=True)
pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD


def test_each_rank_binds_its_node_local_gpu(bound_gpu):
    import cupy
    count = runtime.gpu_count()
    want = runtime.local_rank() % count
    assert bound_gpu == want
    assert cupy.cuda.Device().id == want
    assert cupy.zeros(1).device.id == want
    # the whole job's view, for the log: (node, local rank, GPU) per rank
    seen = COMM.allgather((MPI.Get_processor_name(), runtime.local_rank(), bound_gpu))
    per_node = {}
    for node, local, gpu in seen:
        per_node.setdefault(node, []).append((local, gpu))
    for node, pairs in per_node.items():
        assert sorted(local for local, _ in pairs) == list(range(len(pairs))), (node, pairs)
        assert all(gpu == local % count for local, gpu in pairs), (node, pairs)


@needs_torch_cuda
def test_torch_uses_the_bound_gpu(bound_gpu):
    import torch
    assert torch.cuda.current_device() == bound_gpu
    assert torch.zeros(1, device="cuda").device.index == bound_gpu
