"""Explicit attention on token-sharded q, k, v (domainpar/ops/einsum.py, the gather
rule): scores as a product of two DomainTensors whose free dims (the query and the
key sequences) are sharded over one grid axis, softmax over the key dim, and the
product with v, against one process on the whole tensors: the output and the
gradients of q, k and v, float64 to 1e-10 and float32, even, uneven (on a periodic
grid) and zero-size blocks, 1-, 2- and 3-D grids (the sequence alone, or with the
batch and the heads on the other axes).

The rule gathers the smaller operand (by global element count; ties: the second)
along the shared grid axis, so that a rank holds (T_q / P) x T_k scores; the local
scores block's shape is checked below, and ``domainpar bench attention
--explicit`` measures the per-rank peak memory.
"""
import pytest
import torch

from domainpar.testing import adjoint_test, shard_like
from tensor_cases import DTYPES, KINDS, global_tensor, sizes_for
from test_products import check, grid_of

pytestmark = pytest.mark.mpi

# (batch, heads, tokens, head_dim); dims cut on grid axes 0, 1, 2 in this order: the
# sequence first, so that 2 and 3 ranks cut it on every grid; (0, 2): batch first.
B, H, T, D = 2, 3, 9, 4
LAYOUTS = [(1, (2,)), (2, (2, 0)), (2, (0, 2)), (3, (2, 0, 1))]
COMBOS = [(g, dims, k, d) for g, dims in LAYOUTS for k in KINDS for d in DTYPES]
IDS = [f"grid{g}-{''.join(map(str, dims))}-{k}-{str(d)[6:]}" for g, dims, k, d in COMBOS]


def sablock(q, k, v):
    """MONAI's SABlock (monai.networks.blocks.selfattention), its einsum spelling."""
    att = torch.einsum("blxd,blyd->blxy", q, k) * D ** -0.5
    att = att.softmax(dim=-1)
    return torch.einsum("bhxy,bhyd->bhxd", att, v)


def matmul_attention(q, k, v):
    """The same attention as matmul / @ / transpose (timm's and most ViTs' spelling)."""
    att = (q @ k.transpose(-2, -1) + torch.matmul(q, k.mT)) * (0.5 * D ** -0.5)
    return torch.matmul(att.softmax(dim=-1), v)


def bmm_attention(q, k, v):
    """bmm on (batch * heads, tokens, head_dim), as attention with heads merged."""
    q, k, v = (t.flatten(0, 1) for t in (q, k, v))
    return torch.bmm(torch.bmm(q, k.transpose(1, 2)).softmax(-1), v)


def qkv(tq: int, tk: int):
    return (B, H, tq, D), (B, H, tk, D), (B, H, tk, D + 1)


@pytest.mark.parametrize("fn", [sablock, matmul_attention], ids=["einsum", "matmul"])
@pytest.mark.parametrize("grid_ndim,dims,kind,dtype", COMBOS, ids=IDS)
def test_self_attention_on_sharded_tokens(fn, grid_ndim, dims, kind, dtype):
    check(fn, qkv(T, T), (dims,) * 3, grid_ndim, kind, dtype)


@pytest.mark.parametrize("tq,tk", [(5, 11), (11, 5)], ids=["q-smaller", "k-smaller"])
@pytest.mark.parametrize("grid_ndim,dims,kind,dtype", COMBOS, ids=IDS)
def test_cross_attention_on_sharded_tokens(tq, tk, grid_ndim, dims, kind, dtype):
    """Query and key sequences of different lengths: the smaller operand is gathered,
    q (scores sharded on the keys: softmax and the product with v reduce over the
    sharded dim) or k (scores sharded on the queries)."""
    check(sablock, qkv(tq, tk), (dims,) * 3, grid_ndim, kind, dtype)
    check(matmul_attention, qkv(tq, tk), (dims,) * 3, grid_ndim, kind, dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_bmm_attention_and_mixed_operands(kind):
    """bmm after merging batch and heads (the sequence on axis 0); v plain (replicated)
    or sharded on another layout than q and k (balanced against uneven)."""
    shapes = qkv(T, T)
    check(bmm_attention, shapes, ((2,),) * 3, 1, kind, torch.float64)
    check(sablock, shapes, ((2,), (2,), None), 1, kind, torch.float64)
    check(sablock, shapes, ((2,),) * 3, 1, kind, torch.float64, kinds=[kind, kind, "even"])


def _scores(q, k):
    return {"einsum": torch.einsum("blxd,blyd->blxy", q, k), "matmul": q @ k.transpose(-2, -1),
            "bmm": torch.bmm(q.flatten(0, 1), k.flatten(0, 1).mT).unflatten(0, (B, H))}


@pytest.mark.parametrize("tq,tk", [(T, T), (5, 11), (11, 5)])
@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_holds_its_rows_of_scores_by_whole_rows(tq, tk, kind):
    """The memory bound, by shape: the local scores block is (T_q local x T_k) when k
    is gathered (T_k <= T_q) and (T_q x T_k local) when q is (T_q < T_k), on the
    sequence's blocks; with P > 1 and even blocks, T_q / P rows (a gather of both, or
    of the larger operand, would give more)."""
    grid = grid_of(1, kind == "uneven")
    parts = grid.dims[0]
    qz, kz = (sizes_for(n, parts, kind) for n in (tq, tk))
    q = shard_like(global_tensor((B, H, tq, D)), grid, {2: 0}, qz and {2: qz})
    k = shard_like(global_tensor((B, H, tk, D), seed=1), grid, {2: 0}, kz and {2: kz})
    keep, dim, whole = (q, 2, tk) if tk <= tq else (k, 3, tq)
    for name, s in _scores(q, k).items():
        local = s.to_local().shape
        rows = keep.to_local().shape[2]
        expected = (B, H, rows, whole) if dim == 2 else (B, H, whole, rows)
        assert tuple(local) == expected, (name, tuple(local), expected)
        if parts > 1:
            assert s.decomposition.shard == {dim: 0}, name
            assert s.decomposition.block_sizes(dim) == keep.decomposition.block_sizes(2)
        if kind == "even":  # at most ceil(T_kept / P) x T_gathered
            assert rows * whole <= -(-max(tq, tk) // parts) * min(tq, tk), name
        torch.testing.assert_close(s.full_tensor(), global_tensor((B, H, tq, D)) @
                                   global_tensor((B, H, tk, D), seed=1).mT)


def test_the_product_with_v_keeps_the_query_blocks():
    """softmax(scores) @ v: v is gathered (its sequence is the contracted dim), so the
    output stays sharded on the queries like q, with no allreduce of the output."""
    grid = grid_of(1, False)
    q, k, v = (shard_like(global_tensor(s, seed=i), grid, {2: 0})
               for i, s in enumerate(qkv(T, T)))
    out = sablock(q, k, v)
    if grid.dims[0] > 1:
        assert out.decomposition.shard == {2: 0}
        assert out.decomposition.block_sizes(2) == q.decomposition.block_sizes(2)
    assert tuple(out.to_local().shape) == (B, H, q.to_local().shape[2], D + 1)


def test_the_gathered_product_is_linear_in_each_operand_and_its_adjoint_holds():
    """<F x, y> == <x, F* y> for the scores as a function of k (gathered) and of q (kept),
    the adjoint of the gather being the sum of the ranks' gradients back to the owners."""
    grid = grid_of(1, True)
    z = sizes_for(T, grid.dims[0], "uneven")
    q, k = (shard_like(global_tensor((B, H, T, D), seed=i), grid, {2: 0}, z and {2: z})
            for i in range(2))
    adjoint_test(lambda t: q.detach() @ t.transpose(-2, -1), k)
    adjoint_test(lambda t: t @ k.detach().mT, q)
    adjoint_test(lambda t: torch.einsum("bhxy,bhyd->bhxd", (q @ k.mT).detach(), t), k)

