"""Parameters and training: per-op gradient reductions and DomainParallel's
deferred, bucketed ones both give the single-process gradients and, after
5 steps of SGD with momentum, the single-process parameters, on batch x domain
grids with even, uneven and zero-size blocks."""
import copy

import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.testing import assert_matches_single_process, shard_like
from tensor_cases import SIZE, global_tensor, sizes_for

pytestmark = pytest.mark.mpi


class ChannelMLP(torch.nn.Module):
    """Pointwise in space, mixing channels, with a reduction over the sharded dims."""

    def __init__(self, c_in=3, hidden=6, c_out=2):
        super().__init__()
        self.fc1 = torch.nn.Linear(c_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, c_out)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, c_out).view(c_out, 1, 1))

    def forward(self, x):  # (B, C, H, W)
        h = torch.tanh(self.fc1(x.movedim(1, -1)))
        y = self.fc2(h).movedim(-1, 1)
        return y * self.scale + 0.5 * y.mean(dim=(2, 3), keepdim=True)


def batch_domain_grid(kind):
    """A 2-D grid: batch dim 0 over axis 0, spatial dim 2 over axis 1."""
    dims = MPI.Compute_dims(SIZE, 2)
    grid = dp.ProcessGrid(dims)
    sizes = {}
    for dim, n, parts in ((0, 4, dims[0]), (2, 9, dims[1])):
        s = sizes_for(n, parts, kind)
        if s is not None:
            sizes[dim] = s
    return grid, {0: 0, 2: 1}, sizes or None


def train(model, x, target, steps=5, extra=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - target) ** 2).mean()
        if extra is not None:
            loss = loss + extra(model)
        loss.backward()
        opt.step()
    return model


def assert_same_parameters(model, reference, rtol, atol):
    got = dict(model.named_parameters())
    for name, want in reference.named_parameters():
        have = got.get(name, got.get("module." + name))
        torch.testing.assert_close(have.detach(), want.detach(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("wrapped", [False, True], ids=["per-op", "DomainParallel"])
@pytest.mark.parametrize("kind", ["even", "uneven", "zero"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_training_matches_one_process(wrapped, kind, dtype):
    torch.manual_seed(0)
    model = ChannelMLP().to(dtype)
    x = global_tensor((4, 3, 9, 5), dtype, seed=1)
    target = global_tensor((4, 2, 9, 5), dtype, seed=2)
    def extra(m):  # a parameter used on replicated values too
        return 0.01 * (m.scale ** 2).sum()
    reference = train(copy.deepcopy(model), x, target, extra=extra)
    grid, shard, sizes = batch_domain_grid(kind)
    sharded = copy.deepcopy(model)
    if wrapped:
        sharded = dp.DomainParallel(sharded, grid, bucket_cap_mb=0.0001)
    train(sharded, shard_like(x, grid, shard, sizes), shard_like(target, grid, shard, sizes),
          extra=lambda m: extra(m.module if wrapped else m))
    rtol, atol = (1e-10, 1e-12) if dtype == torch.float64 else (1e-5, 1e-6)
    assert_same_parameters(sharded, reference, rtol, atol)


@pytest.mark.parametrize("overlap", [True, False], ids=["nonblocking", "blocking"])
@pytest.mark.parametrize("bucket_cap_mb", [1e-5, 25.0])
def test_domain_parallel_gradients_match(bucket_cap_mb, overlap):
    torch.manual_seed(1)
    grid, shard, sizes = batch_domain_grid("uneven")
    x = global_tensor((4, 3, 9, 5), torch.float64, seed=3)
    assert_matches_single_process(
        ChannelMLP().double(), x, grid, shard, sizes=sizes,
        wrap=lambda m: dp.DomainParallel(m, grid, bucket_cap_mb=bucket_cap_mb, overlap=overlap))


def test_gradient_accumulation_over_two_backwards():
    """.grad holding a gradient from an earlier backward is added to, not re-summed."""
    torch.manual_seed(2)
    grid, shard, sizes = batch_domain_grid("even")
    model = ChannelMLP().double()
    x = global_tensor((4, 3, 9, 5), torch.float64, seed=4)
    reference = copy.deepcopy(model)
    for _ in range(2):
        reference(x).pow(2).mean().backward()
    wrapped = dp.DomainParallel(copy.deepcopy(model), grid)
    xs = shard_like(x, grid, shard, sizes)
    for _ in range(2):
        wrapped(xs).pow(2).mean().backward()
    for (name, p), q in zip(wrapped.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_construction_broadcasts_parameters_and_buffers():
    torch.manual_seed(100 + MPI.COMM_WORLD.Get_rank())  # different on every rank
    model = ChannelMLP().double()
    model.register_buffer("stat", torch.full((3,), float(MPI.COMM_WORLD.Get_rank()), dtype=torch.float64))
    grid = dp.ProcessGrid((SIZE,))
    wrapped = dp.DomainParallel(model, grid)
    for t in list(wrapped.parameters()) + list(wrapped.buffers()):
        everyone = MPI.COMM_WORLD.allgather(t.detach().clone())
        for other in everyone:
            assert torch.equal(other, everyone[0])
    assert torch.equal(wrapped.module.stat, torch.zeros(3, dtype=torch.float64))


class ComplexWeights(torch.nn.Module):
    """Complex weights stored as (real, imag) pairs, used through view_as_complex,
    twice (two einsums), on a spectrum sharded on the batch and the mode dims."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 2, 5, 2))

    def forward(self, x):  # (B, 3, H, W) real
        x_ft = torch.fft.rfft(x, dim=2).transpose(2, 3)[..., :5]  # (B, 3, W, 5)
        w = torch.view_as_complex(self.w)
        y = torch.einsum("bixy,ioy->boxy", x_ft, w) + torch.einsum("bixy,ioy->boxy", x_ft * 2j, w)
        return torch.view_as_real(y)


class SlicedWeights(torch.nn.Module):
    """A parameter used through slices of itself (views, as neuraloperator's spectral
    weights are), twice, on a spectrum sharded on the batch and the mode dims."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 2, 7, dtype=torch.complex64))

    def forward(self, x):  # (B, 3, H, W) real
        x_ft = torch.fft.rfft(x, dim=2).transpose(2, 3)[..., :5]  # (B, 3, W, 5)
        y = torch.einsum("bixy,ioy->boxy", x_ft, self.w[..., 1:6]) + \
            torch.einsum("bixy,ioy->boxy", x_ft * 2j, self.w[..., 2:7])
        return torch.view_as_real(y)


# A parameter's view, its model and a penalty that uses the view on replicated values too.
VIEWED = {
    "complex": (lambda: ComplexWeights().double(),
                lambda m: 0.1 * torch.view_as_complex(m.w).abs().sum()),
    "slice": (lambda: SlicedWeights().to(torch.complex128),
              lambda m: 0.1 * m.w[1:].abs().sum()),
}


@pytest.mark.parametrize("view", sorted(VIEWED))
@pytest.mark.parametrize("kind", ["even", "uneven", "zero"])
def test_views_of_parameters_are_reduced_with_them(view, kind, monkeypatch):
    """A view of a parameter (view_as_complex; a slice, cut to the blocks of a
    sharded mode dim) entering per-rank work inside DomainParallel is reduced with
    the parameter, bucketed: no per-op allgather or allreduce of its gradient, and
    its values are checked once, as the parameter's. Gradients and 5 steps of
    training match one process."""
    from domainpar import autograd as dag
    from domainpar.tensor import params
    per_op = []  # parameter gradients an op would reduce itself
    real_shard, real_broadcast = dag.shard, dag.broadcast
    monkeypatch.setattr(dag, "shard", lambda *a: (per_op.append("shard"), real_shard(*a))[1])

    def broadcast(t, comm, defer=None):
        if defer is None:
            per_op.append("broadcast")
        return real_broadcast(t, comm, defer)
    monkeypatch.setattr(dag, "broadcast", broadcast)
    checked = []
    real_agree = params.agree
    monkeypatch.setattr(params, "agree", lambda *a, **k: (checked.append(1), real_agree(*a, **k))[1])
    make, penalty = VIEWED[view]
    torch.manual_seed(5)
    grid, shard, sizes = batch_domain_grid(kind)
    x = global_tensor((4, 3, 9, 5), torch.float64, seed=6)
    model = make()
    assert_matches_single_process(model, x, grid, shard, sizes=sizes,
                                  wrap=lambda m: dp.DomainParallel(m, grid))
    assert per_op == []
    target = global_tensor((4, 2, 5, 5, 2), torch.float64, seed=7)
    target_sizes = {0: sizes[0]} if sizes and 0 in sizes else None  # dim 2 is W's modes now
    reference = train(copy.deepcopy(model), x, target, extra=penalty)
    before = len(checked)
    sharded = train(dp.DomainParallel(copy.deepcopy(model), grid),
                    shard_like(x, grid, shard, sizes),
                    shard_like(target, grid, shard, target_sizes),
                    extra=lambda m: penalty(m.module))
    assert per_op == [] and len(checked) - before == (SIZE > 1)  # once, not per step
    assert_same_parameters(sharded, reference, 1e-10, 1e-12)
