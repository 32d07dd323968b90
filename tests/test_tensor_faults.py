"""Faults and misuse at the tensor layer and the runtime (issue 17, items 1, 3, 6, 9):
each is one process's answer or the same clear error on every rank, never a
silent wrong answer or a hang.

- user ``torch.autograd.Function``s (and module full backward hooks, built on
  one) keep the graph on DomainTensors: output, input and every parameter
  gradient equal one process's (item 1; checkpointing: test_checkpointing.py);
- ``DomainTensor.from_local`` agrees the shard map, dtype, ndim and unsharded
  sizes across ranks (item 3);
- an uncaught exception or SIGINT on one rank ends the job even when the
  script never called ``dp.init()`` (item 6, serial: runs its own mpiexec);
- ``torch.compile`` on DomainTensors (item 9).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from mpi4py import MPI

import domainpar as dp
from domainpar import launch
from domainpar.testing import assert_matches_single_process, raises_on_every_rank

COMM = MPI.COMM_WORLD
SIZE, RANK = COMM.Get_size(), COMM.Get_rank()
ROOT = Path(__file__).resolve().parent.parent


# -- item 1: user autograd.Functions ------------------------------------------------------------
class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Centred(torch.autograd.Function):
    """Ops that communicate inside forward and backward (a mean over sharded dims)."""

    @staticmethod
    def forward(ctx, x):
        return x - x.mean(dim=(2, 3), keepdim=True)

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(dim=(2, 3), keepdim=True)


class TanhGate(torch.autograd.Function):
    """Saves its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.tanh(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(x)
        return g * (t + x * (1 - t * t))


class Exp(torch.autograd.Function):
    """Saves its output."""

    @staticmethod
    def forward(ctx, x):
        y = torch.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class Scale(torch.autograd.Function):
    """setup_context style, with a replicated parameter as a second input."""

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum().reshape(w.shape)


class WithFunction(nn.Module):
    """conv -> a user Function -> conv: the first conv's gradients flow through it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.before = nn.Conv2d(2, 3, 3, padding=1)
        self.after = nn.Conv2d(3, 2, 3, padding=1)
        self.w = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x):
        h = torch.tanh(self.before(x))
        h = self.fn.apply(h, self.w) if self.fn is Scale else self.fn.apply(h)
        return self.after(h)


def _grid_and_shard():
    if SIZE == 4:
        return dp.ProcessGrid((2, 2)), {2: 0, 3: 1}
    return dp.ProcessGrid((SIZE,)), {2: 0}


@pytest.mark.parametrize("fn", [Twice, Centred, TanhGate, Exp, Scale], ids=lambda f: f.__name__)
@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_user_autograd_function_matches_one_process(fn):
    grid, shard = _grid_and_shard()
    torch.manual_seed(0)
    model = WithFunction(fn).double()
    x = torch.randn((2, 2, 9, 7), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    errors = assert_matches_single_process(model, x, grid, shard)
    checked = {"input 0 gradient", "gradient of before.weight"} | ({"gradient of w"} if fn is Scale
                                                                  else set())
    assert checked <= set(errors)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_user_function_output_is_a_domain_tensor_in_the_graph():
    grid, shard = _grid_and_shard()
    x = dp.scatter(torch.randn(1, 2, 8, 6, dtype=torch.float64), grid, shard,
                   requires_grad=True)
    y = Twice.apply(x)
    assert isinstance(y, dp.DomainTensor) and y.requires_grad
    assert y.grad_fn is not None and y.grad_fn.name() == "TwiceBackward"
    y.sum().backward()
    assert torch.equal(x.grad.to_local(), torch.full_like(x.to_local(), 2.0))


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_module_full_backward_hook_sees_domain_tensors():
    grid, shard = _grid_and_shard()
    torch.manual_seed(0)
    model = WithFunction(Twice).double()
    seen = []
    model.after.register_full_backward_hook(
        lambda m, grad_in, grad_out: seen.append((grad_in[0], grad_out[0])))
    x = torch.randn((1, 2, 8, 6), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    errors = assert_matches_single_process(model, x, grid, shard)
    assert "gradient of before.weight" in errors
    # The hook of the deep copy run on DomainTensors saw whole-tensor gradients.
    dts = [g for pair in seen for g in pair if isinstance(g, dp.DomainTensor)]
    assert len(dts) == 2 and tuple(dts[0].shape) == (1, 3, 8, 6)


# -- item 3: from_local agrees the layout across ranks --------------------------------------------
@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sizes", [False, True], ids=["learned", "given"])
def test_from_local_shard_maps_that_differ_between_ranks(sizes):
    if SIZE < 2:
        pytest.skip("needs 2 ranks (one rank passes another shard map)")
    grid = dp.ProcessGrid((SIZE,))
    block = torch.zeros(1, 2, 4, 4, dtype=torch.float64)
    shard = {3: 0} if RANK == SIZE - 1 else {2: 0}
    given = {d: [4] * SIZE for d in shard} if sizes else None
    raises_on_every_rank(dp.MismatchError, "shard",
                         lambda: dp.DomainTensor.from_local(block, grid, shard, given))


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_from_local_grid_axes_that_differ_between_ranks():
    if SIZE < 2:
        pytest.skip("needs 2 ranks (one rank names another grid axis)")
    grid = dp.ProcessGrid((SIZE, 1))
    block = torch.zeros(1, 2, 4, 4, dtype=torch.float64)
    shard = {2: 1} if RANK == SIZE - 1 else {2: 0}
    raises_on_every_rank(dp.MismatchError, "shard",
                         lambda: dp.DomainTensor.from_local(block, grid, shard))


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_from_local_same_shard_map_spelled_differently_is_fine():
    grid = dp.ProcessGrid((SIZE,))
    shard = {-1: -1} if RANK == SIZE - 1 else {3: 0}
    x = dp.DomainTensor.from_local(torch.zeros(1, 2, 4, 3, dtype=torch.float64), grid, shard)
    assert tuple(x.shape) == (1, 2, 4, 3 * SIZE) and x.decomposition.shard == {3: 0}


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_from_local_dims_that_differ_raise_mismatch():
    if SIZE < 2:
        pytest.skip("needs 2 ranks (one rank passes another block)")
    grid = dp.ProcessGrid((SIZE,))
    odd = RANK == SIZE - 1
    cases = [(torch.zeros(2, 3, dtype=torch.float32 if odd else torch.float64), "dtype"),
             (torch.zeros((2, 3, 1) if odd else (2, 3), dtype=torch.float64), "dims"),
             (torch.zeros(2, 4 if odd else 3, dtype=torch.float64), "dim 1 is not sharded")]
    for block, match in cases:
        raises_on_every_rank(dp.MismatchError, match,
                             lambda block=block: dp.DomainTensor.from_local(block, grid, {0: 0}))


# -- item 6: one rank failing ends the job without dp.init() ---------------------------------------
ONE_RANK_FAILS = """
import os, signal, sys
import domainpar as dp          # never calls dp.init(), as the README's tensor example
grid = dp.ProcessGrid()
if grid.rank == 1:
    if sys.argv[1] == "raise":
        raise RuntimeError("rank 1 fails alone")
    os.kill(os.getpid(), signal.SIGINT)   # Ctrl-C reaching one rank only
grid.comm.Barrier()  # rank 0 would wait here forever without the abort
"""


def _run_job(script, *args, timeout=60):
    """(exit status, stderr) of a 2-rank mpiexec job; a hang kills the job's process
    group and fails the test."""
    proc = subprocess.Popen(["mpiexec", "-n", "2", sys.executable, str(script), *args],
                            env=dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the job hung: still running after {timeout} s")
    return proc.returncode, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise", "sigint"])
def test_one_rank_failing_without_init_ends_the_job(tmp_path, how):
    script = tmp_path / "one_rank_fails.py"
    script.write_text(textwrap.dedent(ONE_RANK_FAILS))
    code, err = _run_job(script, how)
    assert code != 0, err
    assert ("rank 1 fails alone" if how == "raise" else "KeyboardInterrupt") in err, err
    assert "Traceback" in err and "aborting the job" in err, err


# -- item 9: torch.compile ---------------------------------------------------------------------
class SmallConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.norm = nn.GroupNorm(1, 3)
        self.conv2 = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        h = nn.functional.gelu(self.norm(self.conv1(x)))
        if x.requires_grad:  # autograd state read in compiled code: the block's, as eager
            h = h * 2
        return self.conv2(h) + x.mean(dim=(2, 3), keepdim=True)


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_on_domain_tensors_matches_one_process(backend):
    """The compiled model (``Module.compile``, names kept) on DomainTensors gives the
    eager one-process model's output and gradients: DomainTensor ops run eagerly
    between the compiled pieces (graph breaks), communication included."""
    torch._dynamo.reset()
    grid, shard = _grid_and_shard()
    torch.manual_seed(0)
    model = SmallConvNet().double()
    x = torch.randn((1, 2, 9, 7), generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def compiled(m):
        m.compile(backend=backend)
        return m

    errors = assert_matches_single_process(model, x, grid, shard, wrap=compiled)
    assert {"input 0 gradient", "gradient of conv1.weight"} <= set(errors)


def test_domainpar_loads_dynamo_only_for_torch_compile():
    """A job that never compiles does not pay for torch._dynamo (+70 MiB per rank
    and over a second of start-up, torch 2.13.0); once torch.compile loads it,
    DomainTensor ops become graph breaks and give eager numbers."""
    script = textwrap.dedent("""
        import sys, torch, torch.nn.functional as F
        import domainpar as dp
        from mpi4py import MPI
        grid = dp.ProcessGrid((1,), comm=MPI.COMM_SELF)
        w = torch.randn(3, 2, 3, 3, dtype=torch.float64)
        t = torch.randn(1, 2, 8, 8, dtype=torch.float64)
        x = dp.scatter(t, grid, shard={2: 0})
        eager = F.conv2d(x, w, padding=1).sum()
        assert "torch._dynamo" not in sys.modules, "torch._dynamo loaded without compile"
        step = torch.compile(lambda x: F.conv2d(x, w, padding=1).relu().sum(), backend="eager")
        got = step(x)
        assert "torch._dynamo" in sys.modules
        want = F.conv2d(t, w, padding=1).relu().sum()
        assert abs(float(got) - float(want)) < 1e-10, (float(got), float(want))
        print("ok", float(eager))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
