"""libdomainpar under misuse and faults (issue 17, items 4 and 7): each case runs
kernels/coupling/tests/faults.c on 2 ranks (serial tests: each launches its own
mpiexec) with DOMAINPAR_FAULT_TIMEOUT=3, and must end within the subprocess
timeout (a hang fails the test) with the same code and message on every rank,
or, where no rank can be told, with the documented end.

- a parameter used on one rank only, through dp_train_step (item 4): was
  MPI_ERR_TRUNCATE, a step on one rank with a garbage gradient, replicas that
  differ silently and a hang; now every step is OK and the replicas equal one
  process's model after the same steps;
- dp_init with MPI_COMM_NULL or another communicator on one rank: every rank
  returns DP_ERR_ARGUMENT (the others after the fault timeout; the job then
  aborts, as documented: the communicator may be unusable);
- DOMAINPAR_PYTHON broken on one rank: DP_ERR_PYTHON on every rank, naming it;
- dp_finalize on one rank only: the others' call meets it and fails alike, and
  their next call fails at once (no hang);
- a model that raises on one rank before its first message: the others cannot
  be told (they wait in the model's halo exchange); the failing rank aborts the
  job with its error after the fault timeout;
- optimizer options or field handles that differ between ranks: DP_ERR_ARGUMENT
  on every rank before any use.
"""
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from domainpar.coupling import errors
from domainpar.launch import mpiexec_env
from native import BUILD, ROOT, cmake_build

MODELS = ROOT / "kernels" / "coupling" / "tests" / "fault_models.py"
ENTRY = f"{MODELS}:make_boundary"
NX, NY = 4, 3
TIMEOUT = 60  # a hang ends here and fails the test


@pytest.fixture(scope="module")
def driver():
    """The fault driver, brought up to date by CMake."""
    cmake_build("coupling_faults_c")
    return BUILD / "kernels" / "coupling" / "coupling_faults_c"


def launch(driver, tmp_path, case, n=2):
    env = dict(mpiexec_env(), DOMAINPAR_PYTHON=sys.executable, DOMAINPAR_FAULT_TIMEOUT="3")
    try:
        return subprocess.run(["mpiexec", "-n", str(n), str(driver), str(tmp_path), case, ENTRY],
                              env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"case {case}: still running after {TIMEOUT} s (a hang)")


def rank_lines(tmp_path, n=2):
    """Per rank: ({case: (code, message)}, {value: float}, finished)."""
    out = []
    for r in range(n):
        path = tmp_path / f"rank{r}.txt"
        lines = path.read_text().splitlines() if path.exists() else []
        cases, values = {}, {}
        for line in lines:
            m = re.fullmatch(r"case (\S+) code (-?\d+) message ?(.*)", line.rstrip())
            if m:
                cases[m.group(1)] = (int(m.group(2)), m.group(3))
            m = re.fullmatch(r"value (\S+) (\S+)", line)
            if m:
                values[m.group(1)] = float(m.group(2))
        out.append((cases, values, bool(lines) and lines[-1] == "done"))
    return out


def body(message):
    """A message without its own call's name ("dp_infer: ...")."""
    return message.split(": ", 1)[1] if ": " in message else message


def assert_everywhere(ranks, case, code, *words):
    got = [cases[case] for cases, _, _ in ranks]
    assert all(c == code for c, _ in got), f"{case}: {got}"
    assert len({body(m) for _, m in got}) == 1, f"{case}: messages differ: {got}"
    for w in words:
        assert w in got[0][1], f"{case}: {w!r} not in {got[0][1]!r}"


def test_parameter_used_on_one_rank_trains_like_one_process(driver, tmp_path):
    proc = launch(driver, tmp_path, "rank_only_param")
    ranks = rank_lines(tmp_path)
    assert all(done for _, _, done in ranks), (proc.stdout, proc.stderr, ranks)
    for name in ("load", "train0", "train1", "train2", "infer"):
        assert_everywhere(ranks, name, errors.OK)
    digests = [values["digest"] for _, values, _ in ranks]
    assert digests[0] == digests[1], f"the replicas differ: {digests}"

    # One process: the same model, field and three SGD steps.
    sys.path.insert(0, str(MODELS.parent))
    try:
        import fault_models
    finally:
        sys.path.pop(0)
    x, y = np.meshgrid(np.arange(2 * NX), np.arange(NY), indexing="ij")  # dims (2, 1)
    u = torch.from_numpy(np.sin(0.3 * x + 0.7 * y))[None, None]
    v = torch.from_numpy(np.cos(0.5 * x - 0.2 * y))[None, None]
    torch.manual_seed(0)
    model = fault_models.make_boundary().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(u), v)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    want = sum(float(p.detach().sum()) for p in model.parameters())
    np.testing.assert_allclose(digests[0], want, rtol=1e-10)
    np.testing.assert_allclose([ranks[0][1][f"loss{s}"] for s in range(3)], losses, rtol=1e-10)


@pytest.mark.parametrize("case", ["comm_null", "other_comm"])
def test_init_with_another_communicator_on_one_rank(driver, tmp_path, case):
    launch(driver, tmp_path, case)  # ends by MPI_Abort (documented): the exit code says so
    ranks = rank_lines(tmp_path)
    assert all(done for _, _, done in ranks), ranks
    for cases, _, _ in ranks:
        assert cases["init"][0] == errors.ARGUMENT, cases
        assert cases["infer_after"][0] == errors.STATE, cases
    assert "did not call dp_init" in ranks[0][0]["init"][1]
    if case == "comm_null":
        assert "MPI_COMM_NULL on this rank" in ranks[1][0]["init"][1]


def test_python_broken_on_one_rank(driver, tmp_path):
    proc = launch(driver, tmp_path, "python_broken")
    ranks = rank_lines(tmp_path)
    assert all(done for _, _, done in ranks), (proc.stderr, ranks)
    assert_everywhere(ranks, "init", errors.PYTHON, "rank 1:", "/no/such/python")
    assert "rank 0:" not in ranks[0][0]["init"][1]
    for cases, _, _ in ranks:
        assert cases["infer_after"][0] == errors.STATE


def test_finalize_on_one_rank_only(driver, tmp_path):
    proc = launch(driver, tmp_path, "finalize_one")
    ranks = rank_lines(tmp_path)
    assert all(done for _, _, done in ranks), (proc.stderr, ranks)
    assert proc.returncode == 0, proc.stderr
    assert_everywhere(ranks, "finalize", errors.STATE, "rank 0: dp_finalize()",
                      "rank 1: dp_infer(")
    cases = ranks[1][0]
    assert cases["next_call"][0] == errors.STATE and "finalized on another rank" in \
        cases["next_call"][1], cases
    assert cases["own_finalize"][0] == errors.OK, cases


def test_model_raising_before_its_first_message_aborts_the_job(driver, tmp_path):
    proc = launch(driver, tmp_path, "raise_first")
    assert proc.returncode != 0
    assert "fault model: raising before the first message" in proc.stderr, proc.stderr
    assert "aborting the job" in proc.stderr, proc.stderr


def test_options_differing_between_ranks(driver, tmp_path):
    proc = launch(driver, tmp_path, "options_differ")
    ranks = rank_lines(tmp_path)
    assert all(done for _, _, done in ranks), (proc.stderr, ranks)
    assert_everywhere(ranks, "load", errors.ARGUMENT, "options", "differ between ranks",
                      "0.1", "0.2")


def test_field_handles_differing_between_ranks(driver, tmp_path):
    proc = launch(driver, tmp_path, "handles_differ")
    ranks = rank_lines(tmp_path)
    assert all(done for _, _, done in ranks), (proc.stderr, ranks)
    assert_everywhere(ranks, "infer", errors.ARGUMENT, "differ between ranks",
                      "rank 0: dp_infer(4, 1, 3)", "rank 1: dp_infer(4, 2, 3)")
    assert_everywhere(ranks, "infer_ok", errors.OK)
