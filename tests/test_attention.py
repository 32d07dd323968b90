"""Ring attention (F.scaled_dot_product_attention, nn.MultiheadAttention) on
DomainTensors sharded along the sequence dim, against one process: output and
q, k, v gradients (and the projections' parameter gradients).

The option matrix is sampled: every case below crosses a set of options
(causal, bool / additive / broadcast masks with fully masked rows, GQA, scale,
L != S, 2-, 3-, 4- and 5-D operands) with a layout (even, uneven, zero-size
blocks; k/v on q's blocks, on their own blocks, on another grid axis, plain;
the batch dim sharded on a second grid axis) and a kernel (torch's CPU flash
kernel, the tiled math kernel with tiny tiles). Also: the RingShift adjoint,
what backward keeps (only local blocks), and the refusals.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

import domainpar as dp
from domainpar import autograd as ag
from domainpar.ops import attention as A
from domainpar.testing import adjoint_test, assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import SIZE, global_tensor, sizes_for

pytestmark = pytest.mark.mpi

F64, F32 = torch.float64, torch.float32


def _grid(ndim: int):
    return dp.ProcessGrid(MPI.Compute_dims(SIZE, ndim))


def _layout(grid, shape, dims: dict, kind: str, seed: int = 0):
    """(shard, sizes) for ``shape`` with ``dims`` = {tensor dim: grid axis}."""
    if dims is None:
        return None, None
    sizes = {}
    for d, axis in dims.items():
        s = sizes_for(shape[d], grid.dims[axis], kind, seed)
        if s is not None:
            sizes[d] = s
    return dict(dims), sizes or None


@pytest.fixture(params=["flash", "math"])
def kernel(request, monkeypatch):
    """Both block kernels; the math one with tiles of a few rows, the flash one
    cut into several calls, so that the tiling is exercised too."""
    if request.param == "math":
        monkeypatch.setattr(A, "KERNEL", "math")
        monkeypatch.setattr(A, "MATH_TILE", 24)
    else:
        monkeypatch.setattr(A, "FLASH_TILE", 40)
    return request.param


# -- F.scaled_dot_product_attention --------------------------------------------------------------
# (lead, L, S, E, Ev, causal, mask, gqa, scale, kv, grid_ndim, kind, dtype)
#   mask: None | bool | float | bool-row / float-row (a query row fully masked) | bcast (1, L, S)
#         | keys (a (1, S) key mask) | heads (a (H, 1, S) mask)
#   kv:   same (q's blocks) | own (own block sizes) | axis1 (seq on grid axis 1) | plain (case B)
#         | mixed (k sharded, v plain) | qplain (q plain: case C) | qplain-b (case C, batch on
#         axis 1 too) | conflict (q cut on batch, k/v on the sequence, same axis: k/v whole)
CASES = [
    ((2, 3), 11, 11, 4, 4, False, None, 1, None, "same", 1, "even", F64),
    ((2, 3), 11, 11, 4, 4, True, None, 1, None, "same", 1, "uneven", F64),
    ((2, 3), 9, 13, 4, 4, True, None, 1, None, "own", 1, "zero", F64),
    ((2, 3), 13, 7, 4, 4, True, None, 1, 0.3, "own", 1, "uneven", F32),
    ((2, 2), 10, 12, 4, 4, False, "bool", 1, None, "own", 1, "zero", F64),
    ((2, 2), 10, 12, 4, 4, False, "float-row", 1, None, "same", 1, "uneven", F64),
    ((2, 2), 12, 10, 4, 4, False, "bool-row", 1, None, "own", 1, "even", F32),
    ((3, 2), 9, 9, 4, 4, False, "bcast", 1, 0.5, "same", 2, "uneven", F64),
    ((2, 4), 10, 11, 4, 4, True, None, 2, None, "same", 2, "zero", F64),
    ((2, 4), 10, 11, 4, 4, False, "heads", 2, None, "own", 1, "uneven", F32),
    ((2, 6), 8, 12, 4, 4, False, "keys", 3, None, "axis1", 2, "even", F64),
    ((2, 2), 11, 9, 4, 6, True, None, 1, None, "same", 1, "uneven", F64),
    ((4,), 12, 12, 4, 4, False, "float", 1, None, "same", 1, "zero", F64),
    ((), 13, 11, 4, 4, False, "float", 1, None, "own", 1, "uneven", F32),
    ((2, 2, 2), 9, 10, 4, 4, True, None, 1, None, "same", 2, "uneven", F64),
    ((2, 3), 10, 12, 4, 4, True, None, 1, None, "plain", 2, "uneven", F64),
    ((2, 3), 10, 12, 4, 4, False, "bool-row", 1, None, "mixed", 1, "zero", F64),
    ((2, 3), 10, 12, 4, 4, True, None, 1, None, "qplain", 1, "uneven", F64),
    ((2, 4), 10, 12, 4, 4, False, "float-row", 2, None, "qplain-b", 2, "zero", F32),
    ((5, 2), 10, 12, 4, 4, True, None, 1, None, "conflict", 1, "uneven", F64),
]


def _mask(kind, lead, L, S, seed):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind in ("bool", "bool-row"):
        m = torch.rand(*lead, L, S, generator=g) > 0.3
        if kind == "bool-row":
            m[..., 2, :] = False  # every key of query row 2 masked: torch gives 0
        return m
    if kind in ("float", "float-row"):
        m = torch.randn(*lead, L, S, generator=g, dtype=F64)
        m[torch.rand(m.shape, generator=g) < 0.2] = -math.inf
        if kind == "float-row":
            m[..., 3, :] = -math.inf
        return m
    if kind == "bcast":
        return torch.rand(1, L, S, generator=g) > 0.2
    if kind == "keys":
        return torch.rand(1, S, generator=g) > 0.3
    if kind == "heads":
        return torch.randn(lead[-1], 1, S, generator=g, dtype=F64)
    raise ValueError(kind)


def _sdpa_case(case, seed=0):
    lead, L, S, E, Ev, causal, mkind, groups, scale, kv, grid_ndim, kind, dtype = case
    n = len(lead) + 2
    kv_lead = lead[:-1] + (lead[-1] // groups,) if groups > 1 else lead
    q = global_tensor(lead + (L, E), dtype, seed + 1)
    k = global_tensor(kv_lead + (S, E), dtype, seed + 2)
    v = global_tensor(kv_lead + (S, Ev), dtype, seed + 3)
    mask = _mask(mkind, lead, L, S, seed + 4)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    grid = _grid(grid_ndim)
    seq = n - 2
    batch = {0: 1} if grid_ndim == 2 and n > 2 else {}
    q_dims = {0: 0} if kv == "conflict" else {seq: 0, **batch}
    kv_dims = {"same": q_dims, "own": q_dims, "plain": None, "mixed": q_dims,
               "qplain": {seq: 0}, "qplain-b": {seq: 0, **batch},
               "axis1": {seq: 1}, "conflict": {seq: 0}}[kv]
    q_shard, q_sizes = _layout(grid, q.shape, q_dims, kind)
    k_shard, k_sizes = _layout(grid, k.shape, kv_dims, kind, seed=0 if kv == "same" else 7)
    v_shard, v_sizes = k_shard, k_sizes
    if kv == "mixed":
        v_shard = v_sizes = None
    if kv.startswith("qplain"):
        q_shard = q_sizes = None
    kwargs = dict(is_causal=causal, scale=scale, enable_gqa=groups > 1)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    return fn, (q, k, v), grid, [q_shard, k_shard, v_shard], [q_sizes, k_sizes, v_sizes]


@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_sdpa_matches_one_process(case, kernel):
    fn, inputs, grid, shard, sizes = _sdpa_case(case)
    assert_matches_single_process(fn, inputs, grid, shard, sizes=sizes)


def test_sdpa_output_layouts():
    """Case A and B keep q's layout; case C returns a plain tensor, replicated."""
    grid = _grid(1)
    q, k = global_tensor((2, 9, 4), F64, 1), global_tensor((2, 11, 4), F64, 2)
    qd, kd = shard_like(q, grid, {1: 0}), shard_like(k, grid, {1: 0})
    ring = F.scaled_dot_product_attention(qd, kd, kd)
    local = F.scaled_dot_product_attention(qd, k, k)
    partial = F.scaled_dot_product_attention(q, kd, kd)
    assert isinstance(ring, dp.DomainTensor) and ring._dec.shard == {1: 0}
    assert isinstance(local, dp.DomainTensor) and local._dec.shard == {1: 0}
    assert type(partial) is torch.Tensor
    want = F.scaled_dot_product_attention(q, k, k)
    for got in (ring.full_tensor(), local.full_tensor(), partial):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_backward_keeps_only_local_blocks(kernel):
    """Per-rank memory O(N/P): the ring's backward node holds this rank's q, k,
    v blocks, its output block and lse, nothing bigger (no k/v of other ranks,
    no scores)."""
    grid = _grid(1)
    lead, L, S, E = (2, 3), 23, 19, 4
    q, k, v = (global_tensor(lead + (n, E), F64, s) for s, n in ((1, L), (2, S), (3, S)))
    qd, kd, vd = (shard_like(t, grid, {2: 0}, requires_grad=True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    nodes, seen, stack = [], set(), [out._local.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "RingAttention" in type(node).__name__:
            nodes.append(node)
        stack.extend(f for f, _ in node.next_functions)
    assert len(nodes) == 1
    saved = nodes[0].saved_tensors
    local = [qd._local, kd._local, vd._local, out._local]
    shapes = sorted(tuple(t.shape) for t in saved)
    lse = tuple(qd._local.shape[:-1])
    assert shapes == sorted([tuple(t.shape) for t in local] + [lse]), shapes
    limit = max(t.numel() for t in local)
    assert all(t.numel() <= limit for t in saved)
    # nothing else hangs on the node but the spec (the user's mask, here none)
    extra = [v for v in vars(nodes[0]).values() if isinstance(v, torch.Tensor)]
    assert not extra and not nodes[0].spec.masks


# -- nn.MultiheadAttention -------------------------------------------------------------------
class SelfAttention(nn.Module):
    def __init__(self, mha, **call):
        super().__init__()
        self.mha, self.call = mha, call

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False, **self.call)[0]


class CrossAttention(SelfAttention):
    def forward(self, x, y):
        return self.mha(x, y, y, need_weights=False, **self.call)[0]


# (batch_first (None: unbatched), kdim (separate weights), bias, masks, cross, grid_ndim, kind,
#  dtype)
MHA_CASES = [
    (True, None, True, None, False, 1, "uneven", F64),
    (False, None, True, "causal", False, 2, "zero", F64),
    (True, 6, False, "kpm-bool", True, 1, "zero", F64),
    (False, None, True, "kpm-float+mask", True, 2, "uneven", F32),
    (True, None, True, "mask3d", False, 1, "even", F64),
    (None, 6, True, "kpm-bool", True, 1, "uneven", F64),
]


def _mha_case(case):
    batch_first, kdim, bias, masks, cross, grid_ndim, kind, dtype = case
    B, L, S, E, H = 2, 10, 12 if cross else 10, 8, 2
    unbatched = batch_first is None
    if unbatched:
        B, batch_first, grid_ndim = 1, False, 1
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first, kdim=kdim,
                                vdim=kdim).to(dtype)
    g = torch.Generator().manual_seed(3)
    call = {}
    if masks == "causal":
        call = dict(attn_mask=nn.Transformer.generate_square_subsequent_mask(L, dtype=dtype),
                    is_causal=True)
    if masks and masks.startswith("kpm"):
        kpm = torch.rand(B, S, generator=g) < 0.3
        kpm[-1, :] = True
        kpm[-1, 0] = False  # one key left for the last batch
        call["key_padding_mask"] = kpm if masks == "kpm-bool" else \
            torch.zeros(B, S, dtype=dtype).masked_fill(kpm, -math.inf)
    if masks and masks.endswith("mask"):
        call["attn_mask"] = torch.rand(L, S, generator=g) < 0.2
        call["attn_mask"] = torch.zeros(L, S, dtype=dtype).masked_fill(call["attn_mask"],
                                                                       -1e4)
    if masks == "mask3d":
        call["attn_mask"] = torch.rand(B * H, L, S, generator=g) < 0.3
    if unbatched:
        call = {n: m[0] if n == "key_padding_mask" else m for n, m in call.items()}
        if masks == "mask3d":
            call["attn_mask"] = call["attn_mask"][:H]
    x = global_tensor((B, L, E) if batch_first else (L, B, E), dtype, 1)
    if unbatched:
        x = x[:, 0]
    seq, bd = (1, 0) if batch_first else (0, 1)
    grid = _grid(grid_ndim)
    dims = {seq: 0, **({bd: 1} if grid_ndim == 2 else {})}
    shard, sizes = _layout(grid, x.shape, dims, kind)
    if not cross:
        return SelfAttention(mha, **call), (x,), grid, shard, sizes
    y_shape = list(x.shape)
    y_shape[seq], y_shape[-1] = S, kdim or E
    y = global_tensor(tuple(y_shape), dtype, 2)
    y_shard, y_sizes = _layout(grid, y.shape, dims, kind, seed=7)
    return CrossAttention(mha, **call), (x, y), grid, [shard, y_shard], [sizes, y_sizes]


@pytest.mark.parametrize("case", MHA_CASES, ids=[f"m{i}" for i in range(len(MHA_CASES))])
def test_multihead_attention_matches_one_process(case):
    model, inputs, grid, shard, sizes = _mha_case(case)
    assert_matches_single_process(model, inputs, grid, shard, sizes=sizes)


def test_multihead_attention_in_domain_parallel():
    model, inputs, grid, shard, sizes = _mha_case(MHA_CASES[1])
    assert_matches_single_process(model, inputs, grid, shard, sizes=sizes,
                                  wrap=lambda m: dp.DomainParallel(m, grid))


# -- refusals ----------------------------------------------------------------------------------
def test_refusals():
    grid = _grid(1)
    q = shard_like(global_tensor((2, 2, 8, 4)), grid, {2: 0})
    k = shard_like(global_tensor((2, 2, 8, 4), seed=2), grid, {2: 0})
    sdpa = F.scaled_dot_product_attention
    raises_on_every_rank(dp.UnsupportedOpError, ["dropout_p=0.1"],
                         lambda: sdpa(q, k, k, dropout_p=0.1))
    raises_on_every_rank(dp.UnsupportedOpError, ["attn_mask", "plain"],
                         lambda: sdpa(q, k, k, attn_mask=q))
    raises_on_every_rank(dp.UnsupportedOpError, ["requires grad"],
                         lambda: sdpa(q, k, k, attn_mask=torch.zeros(8, 8, dtype=F64,
                                                                     requires_grad=True)))
    kb = shard_like(global_tensor((1, 2, 8, 4), seed=2), grid, {2: 0})
    raises_on_every_rank(dp.UnsupportedOpError, ["leading dims"], lambda: sdpa(q, kb, kb))
    if grid.dims[0] > 1:  # heads cut into blocks that split a GQA group
        qh = shard_like(global_tensor((1, 6, 5, 4)), dp.ProcessGrid((SIZE,)), {1: 0},
                        sizes={1: [1] + [5 // (SIZE - 1) + (i < 5 % (SIZE - 1))
                                         for i in range(SIZE - 1)]})
        kh = global_tensor((1, 3, 5, 4), seed=2)
        raises_on_every_rank(dp.UnsupportedOpError, ["whole groups"],
                             lambda: sdpa(qh, kh, kh, enable_gqa=True))

    x = shard_like(global_tensor((8, 2, 4)), grid, {0: 0})
    mha = nn.MultiheadAttention(4, 2).double()
    raises_on_every_rank(dp.UnsupportedOpError, "need_weights=False", lambda: mha(x, x, x))
    raises_on_every_rank(dp.UnsupportedOpError, ["dropout=0.5"],
                         lambda: nn.MultiheadAttention(4, 2, dropout=0.5).double()(
                             x, x, x, need_weights=False))
    raises_on_every_rank(dp.UnsupportedOpError, "add_bias_kv",
                         lambda: nn.MultiheadAttention(4, 2, add_bias_kv=True).double()(
                             x, x, x, need_weights=False))
    raises_on_every_rank(dp.UnsupportedOpError, "add_zero_attn",
                         lambda: nn.MultiheadAttention(4, 2, add_zero_attn=True).double()(
                             x, x, x, need_weights=False))
    xe = shard_like(global_tensor((3, 2, 4 * SIZE)), grid, {2: 0})
    raises_on_every_rank(dp.UnsupportedOpError, ["embedding dim"],
                         lambda: nn.MultiheadAttention(4 * SIZE, 2).double()(
                             xe, xe, xe, need_weights=False))


def test_torch_errors_come_first():
    """Bad shapes get torch's own error (from the global shapes), on every rank."""
    grid = _grid(1)
    q = shard_like(global_tensor((2, 8, 4)), grid, {1: 0})
    k = shard_like(global_tensor((2, 8, 3), seed=2), grid, {1: 0})
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, k)
    with pytest.raises(RuntimeError, match="is_causal"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool),
                                       is_causal=True)


# -- the ring shift primitive ------------------------------------------------------------------
@pytest.mark.parametrize("shift", [1, -1, 2])
@pytest.mark.parametrize("kind", ["uneven", "zero"])
def test_ring_shift_adjoint(shift, kind):
    """<S x, y> == <x, S* y> with S* from backward (the shift the other way), on
    blocks of different sizes; and the shift moves the right block."""
    grid = _grid(1)
    comm = grid.sub((0,))
    n, p, c = 11, comm.Get_size(), comm.Get_rank()
    sizes = sizes_for(n, p, kind) or [n // p + (i < n % p) for i in range(p)]
    g = torch.Generator().manual_seed(17 + c)
    x = torch.randn(2, sizes[c], 3, generator=g, dtype=F64)
    recv = (2, sizes[(c - shift) % p], 3)
    adjoint_test(lambda t: ag.ring_shift(t, comm, recv, shift), x, x_space=comm, y_space=comm)
    got = ag.ring_shift(x, comm, recv, shift)
    want = torch.randn(2, sizes[(c - shift) % p], 3,
                       generator=torch.Generator().manual_seed(17 + (c - shift) % p),
                       dtype=F64)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
