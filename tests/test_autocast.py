"""Mixed precision: torch.autocast("cpu", dtype=torch.bfloat16) through every op
family on DomainTensors, against one process under the same autocast
(issue 17, item 8).

For each model the outputs' dtypes must equal one process's, and every output,
input gradient and parameter gradient must be as close to the float64 truth as
one process's under autocast is, judged the way one process is judged: with
e_s and e_1 the largest absolute errors of the sharded run and of one process
against float64, and s the float64 truth's largest magnitude,

    e_s <= C * e_1 + K * eps * s,     eps = 2**-8 (bfloat16's machine epsilon).

The sharded run sums in other orders and rounds blocks where one process rounds
the whole, so it need not reproduce one process's bits. A gradient that is zero
in float64 (a conv bias before a norm) is, in bf16, rounding noise of the terms
that cancel in it: its s is 4x the largest gradient's. Measured (UNet, 2
ranks, 9 layouts): e_s reaches 17 eps s on a signal quantity and 43 eps x the
largest gradient on a noise one; so C = 4 and K = 32 hold with room when one
process's own error happens to be small (the K term alone covers e_s), on any
CPU. A wrong answer is off by a large part of s: a block-local conv is off by
156 eps s in its output (212 e_1); test_autocast_oracle_can_fail checks that the
rule catches it."""
import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import domainpar as dp
from domainpar.testing import shard_like
from domainpar.testing.models import UNet3d, ViT2d
from tensor_cases import CASES, global_tensor, layout

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD
LOW = torch.bfloat16
EPS = 2.0 ** -8
C, K = 4.0, 32.0


def _full(v):
    return v.full_tensor() if isinstance(v, dp.DomainTensor) else v


def _run(model, x, cast: bool, shard=None, grid=None, sizes=None, weight_seed=3):
    """(outputs, input gradient, {name: parameter gradient}) of sum(out * w)."""
    xin = shard_like(x, grid, shard, sizes, requires_grad=True) if shard is not None else \
        x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=LOW, enabled=cast):
        out = model(xin)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(weight_seed)
    loss = 0
    for o in outs:
        w = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(x.dtype)
        loss = loss + (o.to(x.dtype) * w).sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return [_full(o).detach() for o in outs], _full(xin.grad), grads


def _error(got, truth) -> tuple[float, float]:
    got, truth = got.detach().double(), truth.detach().double()
    return float((got - truth).abs().max()) if truth.numel() else 0.0, \
        float(truth.abs().max()) if truth.numel() else 0.0


def compare_under_autocast(model: nn.Module, x: torch.Tensor, grid, shard, sizes=None):
    """Collective. The rule of the module docstring for outputs, input gradient and
    parameter gradients; the outputs' dtypes must equal one process's. Raises
    AssertionError on every rank alike; returns {quantity: (e_s, e_1, s)}."""
    truth = _run(copy.deepcopy(model).double(), x.double(), cast=False)
    one = _run(copy.deepcopy(model), x, cast=True)
    try:
        sharded = _run(copy.deepcopy(model), x, cast=True, shard=shard, grid=grid, sizes=sizes)
        problem = None
    except Exception as exc:  # noqa: BLE001 - any failure is reported on every rank
        sharded, problem = None, f"{type(exc).__name__}: {exc}"
    problems, report = [], {}
    if problem is not None:
        problems.append(problem)
    else:
        for i, (s_out, o_out) in enumerate(zip(sharded[0], one[0])):
            if s_out.dtype != o_out.dtype:
                problems.append(f"output {i} dtype {s_out.dtype}, one process {o_out.dtype}")
        pairs = [(f"output {i}", s, o, t) for i, (s, o, t) in
                 enumerate(zip(sharded[0], one[0], truth[0]))]
        pairs.append(("input gradient", sharded[1], one[1], truth[1]))
        pairs += [(f"gradient of {n}", sharded[2][n], one[2][n], truth[2][n]) for n in truth[2]]
        # A gradient that is zero in float64 (a conv bias before a norm) is, in bf16,
        # rounding noise of the terms that cancel in it: its scale is theirs (4x
        # the largest gradient's), not its own ~1e-17.
        top = max((_error(t, t)[1] for what, _, _, t in pairs
                   if t is not None and "gradient" in what), default=0.0)
        for what, s, o, t in pairs:
            if (s is None) != (t is None):
                problems.append(f"{what}: None on one side")
                continue
            if t is None:
                continue
            (e_s, scale), (e_1, _) = _error(s, t), _error(o, t)
            if what.startswith("gradient") and scale < 1e-6 * top:
                scale = 4 * top
            report[what] = (e_s, e_1, scale)
            if not e_s <= C * e_1 + K * EPS * scale:
                problems.append(f"{what}: sharded error {e_s:.3e} > {C:g} x one-process "
                                f"{e_1:.3e} + {K:g} eps x scale {scale:.3e}")
    stories = COMM.allgather(problems)
    failed = [f"rank {r}: {p}" for r, ps in enumerate(stories) for p in ps]
    assert not failed, "under autocast: " + "; ".join(failed[:10])
    return report


# -- the op families -------------------------------------------------------------------------------
class Convs(nn.Module):
    """conv, strided conv, conv transpose, 1x1 conv: bf16 activations feed bf16 convs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1, bias=True)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(4, 3, 2, stride=2)
        self.head = nn.Conv2d(3, 2, 1)

    def forward(self, x):
        return self.head(self.up(self.down(self.b(self.a(x)))))


class Pools(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        return (F.max_pool2d(h, 2) + F.avg_pool2d(h, 2), F.adaptive_avg_pool2d(h, 1),
                F.adaptive_max_pool2d(h, 1), F.lp_pool2d(h, 2, 2))


class Resample(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        return (F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False),
                F.interpolate(h, scale_factor=2, mode="nearest"),
                F.interpolate(h, size=(5, 7), mode="bicubic", align_corners=True))


class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.group, self.batch = nn.GroupNorm(2, 4), nn.BatchNorm2d(4)
        self.inst = nn.InstanceNorm2d(4, affine=True)
        self.conv2 = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        h = self.conv(x)
        h = self.conv2(self.group(h)) + self.batch(h) + self.inst(h)
        return h, F.normalize(h, dim=2), F.layer_norm(h, h.shape[-1:])


class LinearMatmul(nn.Module):
    """Linear over channels (channels last), matmul and einsum over an unsharded dim."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 5)
        self.mix = nn.Parameter(torch.randn(5, 3) / 3)

    def forward(self, x):
        h = self.lin(x.permute(0, 2, 3, 1))
        return (h @ self.mix, torch.einsum("nhwc,cd->ndhw", h, self.mix),
                F.linear(h, self.mix.t()), torch.matmul(h, self.mix[:, :1]).squeeze(-1))


class Attention(nn.Module):
    """SDPA with the sequence (H) sharded, and softmax attention written out."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(20, 24)

    def forward(self, x):
        t = x.permute(0, 2, 3, 1).flatten(2)           # (N, H, C*W): tokens along H
        q, k, v = self.qkv(t).unsqueeze(1).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v)
        b = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a, b


class Losses(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        target = torch.tanh(x[:, :1]).expand_as(h)
        labels = (x[:, 0] > 0).long()
        return (F.mse_loss(h, target), F.l1_loss(h, target, reduction="sum"),
                F.cross_entropy(h, labels), F.smooth_l1_loss(h, target),
                F.huber_loss(h, target, delta=0.5), F.mse_loss(h, target, reduction="none"))


class Reductions(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        return (h.sum(dim=(2, 3)), h.mean(), h.amax(dim=2), h.max(dim=3).values,
                h.norm(dim=(2, 3)), h.var(dim=2), torch.logsumexp(h, dim=2),
                torch.softmax(h, dim=3), h.std())


class Pointwise(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.scale = nn.Parameter(torch.randn(3, 1, 1))

    def forward(self, x):
        h = self.conv(x)
        return (F.gelu(h) * self.scale + torch.sigmoid(h) - torch.tanh(h) * x[:, :1],
                F.silu(h).exp() / (1 + h * h), torch.where(h > 0, h, 0.1 * h) ** 2)


SHAPE = (2, 2, 9, 10)     # N, C, H, W
SHARD_DIMS = (2, 3, 0)
FAMILIES = {"conv": Convs, "pool": Pools, "resample": Resample, "norm": Norms,
            "linear": LinearMatmul, "attention": Attention, "loss": Losses,
            "reduce": Reductions, "pointwise": Pointwise}


def _model(name):
    torch.manual_seed(7)
    return FAMILIES[name]()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("grid_ndim,kind", [c for c in CASES if c[0] < 3])
def test_op_families_under_autocast(family, grid_ndim, kind):
    shape = (2, 2, 8, 10) if family in ("pool", "resample") else SHAPE
    shard_dims = (2, 0) if family == "attention" else SHARD_DIMS
    grid, shard, sizes = layout(shape, shard_dims, grid_ndim, kind)
    x = global_tensor(shape, torch.float32, seed=4)
    compare_under_autocast(_model(family), x, grid, shard, sizes)


@pytest.mark.parametrize("grid_ndim,kind", CASES)
def test_unet_under_autocast(grid_ndim, kind):
    """The small UNet (domainpar.testing.models) under bf16 autocast."""
    shape = (1, 2, 12, 10, 9)
    grid, shard, sizes = layout(shape, (2, 3, 4), grid_ndim, kind)
    torch.manual_seed(0)
    model = UNet3d(in_channels=2, out_channels=2, width=2, levels=3)
    compare_under_autocast(model, global_tensor(shape, torch.float32, seed=5), grid, shard, sizes)


def test_vit_under_autocast():
    """Patches, tokens, LayerNorm, hand-written attention and nn.MultiheadAttention."""
    shape = (1, 1, 16, 16)
    grid, shard, sizes = layout(shape, (2,), 1, "even")
    torch.manual_seed(0)
    model = ViT2d((16, 16), patch=4, dim=8, heads=2, depth=2)
    compare_under_autocast(model, global_tensor(shape, torch.float32, seed=6), grid, shard, sizes)


class BlockLocal(nn.Module):
    """A conv that never sees its neighbours' cells: wrong across block edges."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        if isinstance(x, dp.DomainTensor):
            return dp.DomainTensor(self.conv(x.to_local()), x.decomposition)
        return self.conv(x)


def test_autocast_oracle_can_fail():
    grid, shard, sizes = layout(SHAPE, SHARD_DIMS, 1, "even")
    if grid.size == 1:
        pytest.skip("needs 2 or more ranks: one block has no edges")
    torch.manual_seed(1)
    with pytest.raises(AssertionError, match="sharded error"):
        compare_under_autocast(BlockLocal(), global_tensor(SHAPE, torch.float32, seed=8),
                               grid, shard, sizes)
