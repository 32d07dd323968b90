"""Two small point models trained 3 steps on sharded, spatially partitioned
point clouds end with the parameters one process gets with plain PyTorch on
the whole clouds (float64): a PointNet++-style set-abstraction network with
ball query (dp.points.radius_search, neighbour features by x[idx]), and a
Transolver-style physics-attention layer over mesh points (its per-point
output brought back to the input order by Partition.inverse)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import domainpar as dp
from domainpar.tensor.domain_tensor import DomainTensor
from test_points_cases import F64, LAYOUT_IDS, LAYOUTS, radius_oracle, sharded
from training import assert_same_state

pytestmark = pytest.mark.mpi
STEPS = 3


def cloud(n, seed):
    """Mesh-like points, no exact duplicates (ball query picks by distance)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=g, dtype=F64)
    x[: n // 2] = 0.5 + 0.05 * torch.randn(n // 2, 3, generator=g, dtype=F64)  # clustered half
    return x


def ball(centers, pos, radius, k):
    """Ball query: sharded (dp.points) or one process (plain torch); a missing
    neighbour repeats the nearest (the center itself, a point of ``pos``)."""
    if isinstance(pos, DomainTensor):
        idx, _ = dp.points.radius_search(centers, pos, radius, k)
    else:
        idx, _ = radius_oracle(centers, pos, radius, k)
    return torch.where(idx < 0, idx[:, :1], idx)


class SetAbstraction(nn.Module):
    def __init__(self, cin, cout, radius, k):
        super().__init__()
        self.radius, self.k = radius, k
        self.mlp = nn.Sequential(nn.Linear(cin + 3, 12), nn.ReLU(), nn.Linear(12, cout))

    def forward(self, pos, feat, centers):
        idx = ball(centers, pos, self.radius, self.k)
        rel = pos[idx] - centers[:, None, :]
        return self.mlp(torch.cat([rel, feat[idx]], dim=-1)).amax(dim=1)


class PointNet2(nn.Module):
    def __init__(self):
        super().__init__()
        self.sa1 = SetAbstraction(2, 8, 0.15, 6)
        self.sa2 = SetAbstraction(8, 16, 0.4, 5)
        self.head = nn.Linear(16, 3)

    def forward(self, pos, feat, c1, c2):
        h1 = self.sa1(pos, feat, c1)
        h2 = self.sa2(c1, h1, c2)
        return self.head(h2.amax(dim=0))


class PhysicsAttention(nn.Module):
    """Transolver's slice attention: points -> M slice tokens (softmax weights,
    weighted means over all points), attention among the tokens, back to points."""

    def __init__(self, c=8, slices=4):
        super().__init__()
        self.embed = nn.Linear(5, c)
        self.slice = nn.Linear(c, slices)
        self.value = nn.Linear(c, c)
        self.qkv = nn.Linear(c, 3 * c)
        self.out = nn.Sequential(nn.Linear(c, c), nn.GELU(), nn.Linear(c, 1))

    def forward(self, pos, feat):
        x = self.embed(torch.cat([pos, feat], dim=-1))
        w = torch.softmax(self.slice(x) / 0.5, dim=-1)                       # (N, M)
        tokens = torch.einsum("nm,nc->mc", w, self.value(x)) / (w.sum(0)[:, None] + 1e-5)
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        att = torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1) @ v   # (M, C)
        return self.out(x + w @ att)                                         # (N, 1)


def _train(model, run, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = run(model)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _reference(make, run):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    result = None
    if comm.Get_rank() == 0:
        model = make()
        losses = _train(model, run)
        result = ({k: v.detach().clone() for k, v in model.state_dict().items()}, losses)
    return comm.bcast(result, root=0)


def _make(cls):
    def make():
        torch.manual_seed(0)
        return cls().double()
    return make


# A layout per grid dimension, with and without empty blocks (the models are the slow part).
MODEL_LAYOUTS = [LAYOUTS[i] for i in (0, 3, 5, 7)]
MODEL_IDS = [LAYOUT_IDS[i] for i in (0, 3, 5, 7)]


@pytest.mark.parametrize("case", MODEL_LAYOUTS, ids=MODEL_IDS)
def test_pointnet2_set_abstraction_trains_like_one_process(case):
    pos = cloud(48, 1)
    feat = torch.randn(48, 2, dtype=F64, generator=torch.Generator().manual_seed(2))
    c1, c2 = pos[::3].clone(), pos[::3][::4].clone()
    target = torch.tensor([0.3, -0.2, 0.5], dtype=F64)
    want = _reference(_make(PointNet2), lambda m: F.mse_loss(m(pos, feat, c1, c2), target))
    part = dp.points.partition(sharded(pos, case))
    pos_p, feat_p = part.points, part(sharded(feat, case))
    c1_p = dp.points.partition(sharded(c1, case, seed=3)).points
    c2_p = sharded(c2, case, seed=4)
    model = _make(PointNet2)()
    losses = _train(model, lambda m: F.mse_loss(m(pos_p, feat_p, c1_p, c2_p), target))
    assert_same_state(model, losses, want)


@pytest.mark.parametrize("case", MODEL_LAYOUTS, ids=MODEL_IDS)
def test_transolver_physics_attention_trains_like_one_process(case):
    pos = cloud(40, 5)
    feat = torch.randn(40, 2, dtype=F64, generator=torch.Generator().manual_seed(6))
    target = torch.sin(3 * pos[:, :1]) + feat[:, 1:]
    want = _reference(_make(PhysicsAttention), lambda m: F.mse_loss(m(pos, feat), target))
    part = dp.points.partition(sharded(pos, case), capacity=None)
    feat_p, target_s = part(sharded(feat, case)), sharded(target, case)
    model = _make(PhysicsAttention)()
    losses = _train(model, lambda m: F.mse_loss(part.inverse(m(part.points, feat_p)), target_s))
    assert_same_state(model, losses, want)
