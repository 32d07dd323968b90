"""The reference models on CUDA against one process on the CPU: UNet3d (convs,
norms, strided and transposed convs, up-sampling), ViT2d (ring attention) and
FNO2d (distributed FFT) trained a few steps sharded on the GPU end with the
parameters one CPU process gets (float64, rtol 1e-10), with the same cases and
reference runs as tests/test_unet.py and tests/test_seq_models.py; and ring
attention itself (F.scaled_dot_product_attention) against the oracle on the
unmasked cases of tests/test_attention.py."""
import pytest
import torch
from gpu_env import TORCH_CUDA_MISSING, assert_matches_on_device
from mpi4py import MPI

import domainpar as dp
from domainpar.testing import shard_like

if TORCH_CUDA_MISSING:  # one skip for the module, none of its cases built
    pytest.skip(TORCH_CUDA_MISSING, allow_module_level=True)
from test_attention import CASES as SDPA_CASES  # noqa: E402
from test_attention import _sdpa_case
from test_seq_models import (  # noqa: E402
    FNO_CASES,
    FNO_SHAPE,
    VIT_CASES,
    _field,
    _fno,
    _fno_reference,
    _vit,
    _vit_reference,
)
from test_seq_models import STEPS as SEQ_STEPS
from test_unet import CASES as UNET_CASES  # noqa: E402
from test_unet import STEPS as UNET_STEPS
from test_unet import _data, _model, _reference
from training import assert_same_state, train  # noqa: E402

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD
SIZE = COMM.Get_size()


def _train_on_gpu(make_model, x, target, grid, shard, sizes, wrapped, steps):
    """``make_model()`` trained ``steps`` steps on the GPU on ``x`` sharded by
    ``shard``; returns the model (back on the CPU) and its losses."""
    xs = shard_like(x, grid, shard, sizes).cuda()
    ts = shard_like(target, grid, shard, sizes).cuda()
    model = make_model().cuda()
    trained = dp.DomainParallel(model, grid) if wrapped else model
    losses = train(trained, xs, ts, trained.parameters(), steps)
    return model.cpu(), losses


@pytest.mark.parametrize("case", UNET_CASES.get(SIZE, []), ids=lambda c: "-".join(map(str, c)))
def test_unet_on_the_gpu_matches_one_process(case):
    n, dims, spatial, wrapped = case
    shard = {d: axis for axis, d in enumerate(spatial)}
    model, losses = _train_on_gpu(_model, *_data(n), dp.ProcessGrid(dims), shard, None, wrapped,
                                  UNET_STEPS)
    assert_same_state(model, losses, _reference(n))
    bn = model.bottleneck[0]  # BatchNorm running statistics agree on every rank, bit for bit
    for buf in (bn.running_mean, bn.running_var):
        assert all(torch.equal(buf, other) for other in COMM.allgather(buf))


@pytest.mark.parametrize("case", VIT_CASES.get(SIZE, []), ids=lambda c: "-".join(map(str, c)))
def test_vit_on_the_gpu_matches_one_process(case):
    b, h, w, dims, shard, hsizes, wrapped = case
    model, losses = _train_on_gpu(lambda: _vit(h, w), *_field((b, 1, h, w), h),
                                  dp.ProcessGrid(dims), shard, {2: hsizes} if hsizes else None,
                                  wrapped, SEQ_STEPS)
    assert_same_state(model, losses, _vit_reference(b, h, w))


@pytest.mark.parametrize("case", FNO_CASES.get(SIZE, []), ids=lambda c: "-".join(map(str, c)))
def test_fno_on_the_gpu_matches_one_process(case):
    dims, shard, sizes, wrapped = case
    model, losses = _train_on_gpu(_fno, *_field(FNO_SHAPE, 7), dp.ProcessGrid(dims), shard,
                                  sizes, wrapped, SEQ_STEPS)
    assert_same_state(model, losses, _fno_reference())


UNMASKED = [c for c in SDPA_CASES if c[6] is None]  # a mask is a CPU tensor in the closure


@pytest.mark.parametrize("case", UNMASKED, ids=[f"c{SDPA_CASES.index(c)}" for c in UNMASKED])
def test_ring_attention_on_the_gpu(case):
    fn, inputs, grid, shard, sizes = _sdpa_case(case)
    assert_matches_on_device(fn, inputs, grid, shard, sizes=sizes)
