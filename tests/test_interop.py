"""Libraries that pick their backend from the tensor's type (domainpar.ops.interop):
opt_einsum (backend detected from the first operand, "domainpar" for a DomainTensor),
tensorly (its pytorch backend, and the opt_einsum plugin that neuraloperator's
SpectralConv turns on) and einops, on DomainTensors against one process in float64
(complex128 for the spectral layers): outputs, input gradients and parameter
gradients. Also torch.tensordot's rule (what opt_einsum's pairwise products and
tensorly's tensordot/dot call) on 1-, 2- and 3-D grids with even, uneven and
zero-size blocks, and the ops these libraries reach that domainpar refuses:
refused on every rank, naming the op. Each library's tests skip, naming it, when
it is not installed (`make setup` installs all three as test dependencies)."""
import pytest
import torch
import torch.nn as nn

import domainpar as dp
from domainpar.tensor.dispatch import has_rule
from domainpar.testing import assert_matches_single_process, raises_on_every_rank, shard_like
from tensor_cases import CASES, COMM, global_tensor, layout

pytestmark = pytest.mark.mpi


def need(name):
    """The module ``name``, or skip: a missing test dependency, named."""
    return pytest.importorskip(name, reason=f"needs {name} (a test dependency: `make setup` "
                                            f"installs it)")


def cplx(shape, seed=0):
    return torch.complex(global_tensor(shape, seed=seed), global_tensor(shape, seed=seed + 1))


def real_view(fn):
    """``fn`` with a real output: the oracle's loss is sum(out * w) with a real w."""
    def run(*xs):
        y = fn(*xs)
        return torch.view_as_real(y) if y.is_complex() else y
    return run


class Contract(nn.Module):
    """``contract(equation, x, *weights)`` with parameter weights; ``first`` puts a
    weight before x (opt_einsum then detects its backend from a plain tensor)."""

    def __init__(self, contract, equation, wshapes, dtype=torch.float64, first=False):
        super().__init__()
        self.contract, self.equation, self.first = contract, equation, first
        ws = [cplx(s, 5 + 2 * i) if dtype.is_complex else global_tensor(s, seed=5 + i)
              for i, s in enumerate(wshapes)]
        self.ws = nn.ParameterList([nn.Parameter(w) for w in ws])

    def forward(self, x):
        ws = list(self.ws)
        operands = ws[:1] + [x] + ws[1:] if self.first else [x] + ws
        y = self.contract(self.equation, *operands)
        return torch.view_as_real(y) if y.is_complex() else y


def matches_or_refused(op, model, x, grid, shard, sizes=None):
    """The oracle, unless domainpar refuses the call on every rank naming ``op``
    (a gap of another rule, not of the library's dispatch)."""
    try:
        assert_matches_single_process(model, x, grid, shard, sizes=sizes)
        refused = None
    except dp.UnsupportedOpError as exc:
        refused = str(exc)
    stories = COMM.allgather(refused)
    assert len(set(s is None for s in stories)) == 1, f"refused on some ranks only: {stories}"
    assert stories[0] is None or op in stories[0], stories[0]


# -- opt_einsum ------------------------------------------------------------------------------------
OE_CASES = [  # (equation with x first, x shape, weight shapes, x's sharded dims by grid axis)
    ("bixy,io->boxy", (3, 4, 6, 5), [(4, 2)], (0, 2, 3)),             # batch, then spatial
    ("bixy,io->boxy", (3, 4, 6, 5), [(4, 2)], (2, 3, 0)),             # spatial first
    ("bixy,ir,ro,xy->boxy", (3, 4, 6, 5), [(4, 3), (3, 2), (6, 5)], (2, 3, 0)),  # a 4-way path
    ("bixy,ixy->bi", (3, 4, 6, 5), [(4, 6, 5)], (2, 3, 0)),           # sharded labels summed
    ("bixy,io,oxy->bx", (3, 4, 6, 5), [(4, 2), (2, 6, 5)], (3, 0, 2)),
]
BACKENDS = ("auto", "torch", "domainpar", "expression")


def _oe_contract(oe, backend):
    if backend == "auto":
        return oe.contract  # what libraries call: the backend detected from operand 0
    if backend == "expression":  # tensorly's plugin: shapes first, arrays later
        return lambda eq, *ops: oe.contract_expression(eq, *(o.shape for o in ops))(*ops)
    return lambda eq, *ops: oe.contract(eq, *ops, backend=backend)


@pytest.mark.parametrize("i", range(2 * len(OE_CASES)))
def test_opt_einsum_contract(i):
    """Each equation under each backend choice, on a different layout each time;
    odd cases put a plain weight first (backend detected from it: torch)."""
    oe = need("opt_einsum")
    equation, xshape, wshapes, sharded = OE_CASES[i % len(OE_CASES)]
    grid_ndim, kind = CASES[i % len(CASES)]
    grid, shard, sizes = layout(xshape, sharded, grid_ndim, kind)
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    first = i % 2 == 1
    if first:
        equation = ",".join([terms[1], terms[0]] + terms[2:]) + "->" + out
    model = Contract(_oe_contract(oe, BACKENDS[i % len(BACKENDS)]), equation, wshapes,
                     first=first)
    assert_matches_single_process(model, global_tensor(xshape), grid, shard, sizes=sizes)


def test_opt_einsum_result_is_a_domain_tensor_and_complex_works():
    oe = need("opt_einsum")
    grid, shard, sizes = layout((2, 3, 8, 6), (2, 3), 1, "uneven")
    x = shard_like(cplx((2, 3, 8, 6)), grid, shard, sizes)
    w = cplx((3, 4), seed=3)
    y = oe.contract("bixy,io->boxy", x, w)
    assert isinstance(y, dp.DomainTensor) and tuple(y.shape) == (2, 4, 8, 6)
    assert y.decomposition.shard == ({2: 0} if grid.size > 1 else {})
    model = Contract(oe.contract, "bixy,io,oxy->boxy", [(3, 4), (4, 8, 6)], torch.complex128)
    assert_matches_single_process(model, cplx((2, 3, 8, 6)), grid, shard, sizes=sizes)


# -- torch.tensordot (the rule opt_einsum and tensorly reach) --------------------------------------
TD_CASES = [  # (x shape, weight shape, dims, x's sharded dims by grid axis, weight first)
    ((3, 4, 6, 5), (4, 2), ([1], [0]), (0, 2, 3), False),
    ((3, 4, 6, 5), (6, 5, 2), 2, (2, 3, 0), False),                   # sharded dims summed
    ((3, 4, 6, 5), (5, 4, 2), ([-1, 1], [0, 1]), (3, 0, 2), False),    # negative, reordered
    ((3, 4, 6, 5), (2, 3), ([0], [1]), (2, 0, 3), True),               # x second
    ((3, 4, 6, 5), (2, 3), 0, (0, 2, 3), False),                       # outer product
    ((3, 4, 6, 5), (4, 2), torch.tensor([[1], [0]]), (2, 3, 0), False),  # dims as a tensor
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_tensordot(i):
    """Every layout of tensor_cases (1-, 2-, 3-D grids; even, uneven, zero-size blocks),
    each with one of the dims forms in turn."""
    xshape, wshape, dims, sharded, first = TD_CASES[i % len(TD_CASES)]
    grid_ndim, kind = CASES[i]
    grid, shard, sizes = layout(xshape, sharded, grid_ndim, kind)
    if first:
        dims = (dims[1], dims[0])

    def tensordot(_, *ops):
        return torch.tensordot(*ops, dims=dims)
    model = Contract(tensordot, None, [wshape], first=first)
    assert_matches_single_process(model, global_tensor(xshape), grid, shard, sizes=sizes)


def test_tensordot_of_two_domain_tensors_and_refusals():
    grid, shard, sizes = layout((4, 6, 5), (1, 0), 2, "uneven")
    w = global_tensor((5, 4), seed=3)
    assert_matches_single_process(lambda a, b: torch.tensordot(a, b, dims=([2], [0])),
                                  (global_tensor((4, 6, 5)), w), grid, [shard, {}],
                                  sizes=[sizes, None])
    x = shard_like(global_tensor((4, 6, 5)), grid, shard, sizes)
    raises_on_every_rank(dp.UnsupportedOpError, ["torch.tensordot", "out="],
                         lambda: torch.tensordot(x, w, dims=([2], [0]), out=torch.empty(4, 6, 4)))
    raises_on_every_rank(dp.UnsupportedOpError, ["torch.tensordot", "dims=7"],
                         lambda: torch.tensordot(x, w, dims=7))
    if grid.size == 1:
        return
    g1 = dp.ProcessGrid((grid.size,))
    # rows of a and columns of b cut over one axis: b, the smaller, is gathered (ops/einsum.py)
    assert_matches_single_process(lambda a, b: torch.tensordot(a, b, dims=1),
                                  (global_tensor((6, 6)), global_tensor((6, 4), seed=1)), g1,
                                  [{0: 0}, {1: 0}])


# -- tensorly --------------------------------------------------------------------------------------
@pytest.fixture
def tensorly_torch():
    """tensorly as neuraloperator sets it up: the pytorch backend and the opt_einsum
    plugin (``tl.einsum`` -> a cached ``opt_einsum.contract_expression``); restored after."""
    tl = need("tensorly")
    need("opt_einsum")
    from tensorly import plugins
    previous = tl.get_backend()
    tl.set_backend("pytorch")
    plugins.use_opt_einsum("optimal")
    yield tl
    plugins.use_default_einsum()
    tl.set_backend(previous)


# neuraloperator's SpectralConv contractions (layers/spectral_convolution.py) on a 2-D
# field x (b, i, x, y): dense, CP, Tucker and tensor-train weights.
SPECTRAL = {
    "dense": ("abcd,becd->aecd", [(3, 2, 6, 5)]),
    "cp": ("abcd,e,be,fe,ce,de->afcd", [(4,), (3, 4), (2, 4), (6, 4), (5, 4)]),
    "tucker": ("abcd,fghi,bf,eg,ch,di->aecd", [(2, 2, 3, 3), (3, 2), (2, 2), (6, 3), (5, 3)]),
    "tt": ("abcd,fbg,geh,hci,idj->aecd", [(1, 3, 2), (2, 2, 3), (3, 6, 2), (2, 5, 1)]),
}


@pytest.mark.parametrize("i", range(2 * len(SPECTRAL)))
def test_tensorly_einsum_spectral_contractions(tensorly_torch, i):
    """``tl.einsum`` with complex weights, x sharded on the batch dim or a mode dim."""
    tl = tensorly_torch
    name = sorted(SPECTRAL)[i % len(SPECTRAL)]
    equation, wshapes = SPECTRAL[name]
    grid_ndim, kind = CASES[(3 * i) % len(CASES)]
    sharded = (0, 2, 3) if i < len(SPECTRAL) else (2, 3, 0)
    grid, shard, sizes = layout((2, 3, 6, 5), sharded, grid_ndim, kind)
    model = Contract(lambda eq, *ops: tl.einsum(eq, *ops), equation, wshapes, torch.complex128)
    assert_matches_single_process(model, cplx((2, 3, 6, 5)), grid, shard, sizes=sizes)


@pytest.mark.parametrize("tenalg_backend", ["einsum", "core"])
@pytest.mark.parametrize("kind", ["even", "uneven"])
def test_tensorly_tenalg_and_products(tensorly_torch, tenalg_backend, kind):
    """mode_dot / multi_mode_dot / inner / tensordot / dot on a field sharded on a mode.
    The core tenalg backend multiplies unfoldings (``matrix @ unfold(x, mode)``): across
    a sharded mode that is a matmul over a sharded contracted dim, refused (naming
    torch.matmul) until matmul supports it; the einsum backend contracts it."""
    tl = tensorly_torch
    from tensorly import tenalg
    previous = tenalg.get_backend()
    tenalg.set_backend(tenalg_backend)
    try:
        shape = (3, 4, 6, 5)
        grid, shard, sizes = layout(shape, (2,), 1, kind)
        m, v = global_tensor((2, 6), seed=4), global_tensor((6, 5, 2), seed=6)
        free = [lambda x: tenalg.mode_dot(x, m[:, :4], 1),       # an unsharded mode
                lambda x: tl.tensordot(x, m, axes=([2], [1])),
                lambda x: tl.dot(x, m[:, :5].T)]
        for fn in free:
            assert_matches_single_process(fn, global_tensor(shape), grid, shard, sizes=sizes)
        for fn in (lambda x: tenalg.mode_dot(x, m, 2),
                   lambda x: tenalg.multi_mode_dot(x, [m[:, :4], m], modes=[1, 2]),
                   lambda x: tenalg.inner(x, v, n_modes=2)):
            if tenalg_backend == "einsum":
                assert_matches_single_process(fn, global_tensor(shape), grid, shard, sizes=sizes)
            else:
                matches_or_refused("torch.matmul", fn, global_tensor(shape), grid, shard, sizes)
    finally:
        tenalg.set_backend(previous)


# -- einops ----------------------------------------------------------------------------------------
EINOPS = [  # (function name, pattern, options) on x of shape (2, 3, 8, 6)
    ("rearrange", "b c h w -> b h w c", {}),
    ("rearrange", "b c h w -> b c (h w)", {}),
    ("rearrange", "b c h w -> (b c) h w", {}),
    ("rearrange", "b c (h p) (w q) -> b (h w) (p q c)", {"p": 2, "q": 2}),
    ("reduce", "b c h w -> b c", {"reduction": "mean"}),
    ("reduce", "b c h w -> b c w", {"reduction": "max"}),
    ("reduce", "b c (h 2) (w 2) -> b c h w", {"reduction": "sum"}),
    ("repeat", "b c h w -> b c h w k", {"k": 3}),
    ("repeat", "b c h w -> b (c k) h w", {"k": 2}),
    ("repeat", "b c h w -> b c (h k) w", {"k": 2}),
]


@pytest.mark.parametrize("i", range(2 * len(EINOPS)))
def test_einops(i):
    """Each pattern with x sharded on the batch dim then h (1- and 2-D grids; even
    blocks: patterns that split h need blocks aligned to the split, issue 18 item 6)."""
    einops = need("einops")
    fname, pattern, options = EINOPS[i % len(EINOPS)]
    fn = getattr(einops, fname)
    sharded = (0, 2) if i < len(EINOPS) else (2, 0)
    grid_ndim = 1 + i % 2
    grid, shard, sizes = layout((2, 3, 8, 6), sharded, grid_ndim, "even")
    splits = "(h " in pattern.split("->")[0]
    if splits and 2 in shard and 8 % (2 * grid.dims[shard[2]]):
        pytest.skip("needs h's blocks to split by 2 (a rank count dividing 4)")
    assert_matches_single_process(lambda x: fn(x, pattern, **options),
                                  global_tensor((2, 3, 8, 6)), grid, shard, sizes=sizes)


@pytest.mark.parametrize("kind", ["uneven", "zero"])
def test_einops_einsum_pack_and_uneven_blocks(kind):
    einops = need("einops")
    grid, shard, sizes = layout((2, 3, 8, 6), (2, 3), 2, kind)
    x = global_tensor((2, 3, 8, 6))
    model = Contract(lambda eq, x, w: einops.einsum(x, w, eq), "b c h w, k c -> b k h w",
                     [(4, 3)])
    assert_matches_single_process(model, x, grid, shard, sizes=sizes)
    for fn in (lambda x: einops.rearrange(x, "b c h w -> b w h c"),
               lambda x: einops.reduce(x, "b c h w -> b h", "mean"),
               lambda x: einops.repeat(x, "b c h w -> b c h w k", k=2),
               lambda x: einops.pack([x, 2 * x], "b * h w")[0]):
        assert_matches_single_process(fn, x, grid, shard, sizes=sizes)


def test_einops_reduce_prod_refused_or_exact():
    """einops' prod reduction calls Tensor.prod; while domainpar has no rule for it, it is
    refused on every rank naming the op (not a wrong answer, not numpy)."""
    einops = need("einops")
    grid, shard, sizes = layout((2, 3, 8, 6), (2, 0), 1, "uneven")
    x = global_tensor((2, 3, 8, 6))

    def fn(x):
        return einops.reduce(x, "b c h w -> b h w", "prod")
    if has_rule(torch.Tensor.prod):
        assert_matches_single_process(fn, x, grid, shard, sizes=sizes)
    else:
        raises_on_every_rank(dp.UnsupportedOpError, ["Tensor.prod"],
                             lambda: fn(shard_like(x, grid, shard, sizes)))
