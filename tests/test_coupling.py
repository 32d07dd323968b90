"""libdomainpar from C and Fortran: the heat2d examples and the error-path drivers,
built by CMake and run under mpiexec.

Serial (not marked mpi): each test launches its own mpiexec. The build is the
project's CMake build in build/ (configured here if `make kernels` has not run
yet); `cmake --build` brings the coupling targets up to date first.

Checked for heat2d_c and heat2d_f on 1, 2 and 4 ranks:
- dp_halo_fill leaves exactly what the program's own exchange leaves (ghosts and
  corners included);
- the online-training losses equal plain torch in one process running the same
  simulation and training (so the domain-parallel run learns what one process
  would), fall at least 10x, and the surrogate's error relative to the solver's
  step falls too (learning, not a decaying field);
- the prediction handed back into the simulation's array at the end equals the
  dumped checkpoint's model applied in one process to the gathered field (fp64,
  1e-10).
The drivers check bad input: each case's code and message on every rank.
"""
import importlib.util
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from domainpar import launch
from domainpar.coupling import errors
from native import BUILD, ROOT, cmake_build

SURROGATE_FILE = ROOT / "examples" / "coupling" / "heat_surrogate.py"
SURROGATE = f"{SURROGATE_FILE}:make_surrogate"
EXECUTABLES = {"heat2d_c": "examples/coupling/heat2d_c", "heat2d_f": "examples/coupling/heat2d_f",
               "coupling_errors_c": "kernels/coupling/coupling_errors_c",
               "coupling_errors_f": "kernels/coupling/coupling_errors_f"}
STEPS = 40                       # 20 online training steps
N, ALPHA, EVERY, KICK = 32, 0.2, 2, 3  # as in heat2d.c / heat2d.f90


@pytest.fixture(scope="module")
def built():
    """Paths of the coupling executables, brought up to date by CMake."""
    cmake_build(*EXECUTABLES)
    paths = {name: BUILD / rel for name, rel in EXECUTABLES.items()}
    missing = [str(p) for p in paths.values() if not p.exists()]
    assert not missing, f"CMake did not build {missing} (no Fortran compiler or MPI?)"
    return paths


def mpiexec(exe, n, *args):
    """Run ``exe`` on ``n`` ranks with this interpreter's environment embedded."""
    env = dict(launch.mpiexec_env(), DOMAINPAR_PYTHON=sys.executable, DOMAINPAR_SURROGATE=SURROGATE)
    proc = subprocess.run(["mpiexec", "-n", str(n), str(exe), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def load_surrogate_module():
    spec = importlib.util.spec_from_file_location("heat_surrogate_oracle", SURROGATE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def one_process():
    """The examples' simulation and online training in plain torch, one process:
    the losses of every training step."""
    x, y = np.meshgrid(np.arange(N), np.arange(N), indexing="ij")

    def wave(s):
        kx, ky = 1 + s % 5, 1 + (s // 5) % 4
        return 0.3 * np.sin(2.0 * math.pi * (kx * x + ky * y) / N + 0.7 * s)

    u = sum(wave(s) for s in range(8))
    torch.manual_seed(0)  # the library seeds before calling the factory
    model = load_surrogate_module().make_surrogate(channels=8).double()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = []
    for step in range(1, STEPS + 1):
        if step % KICK == 0:
            u = u + wave(step)
        nxt = u + ALPHA * (np.roll(u, 1, 0) + np.roll(u, -1, 0) + np.roll(u, 1, 1)
                           + np.roll(u, -1, 1) - 4 * u)
        if step % EVERY == 0:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(torch.from_numpy(u)[None, None]),
                                                torch.from_numpy(nxt)[None, None])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        u = nxt
    return losses


def gather_dump(directory, n):
    """The end state u and the prediction from every rank's dump, as global arrays."""
    u, pred = np.full((N, N), np.nan), np.full((N, N), np.nan)
    for r in range(n):
        raw = (directory / f"rank{r}.bin").read_bytes()
        order, x0, y0, nx, ny = np.frombuffer(raw[:20], np.int32)
        blocks = np.frombuffer(raw[20:], np.float64).reshape(2, nx * ny)
        for dst, b in zip((u, pred), blocks):
            dst[x0:x0 + nx, y0:y0 + ny] = b.reshape(nx, ny) if order == 0 else b.reshape(ny, nx).T
    assert not np.isnan(u).any() and not np.isnan(pred).any(), "the blocks do not tile the domain"
    return u, pred


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("example", ["heat2d_c", "heat2d_f"])
def test_heat2d_example(built, one_process, tmp_path, example, n):
    out = mpiexec(built[example], n, tmp_path, STEPS)

    halo = re.search(r"halo check: max \|dp_halo_fill - own exchange\| = (\S+)", out)
    assert halo and float(halo.group(1)) == 0.0, out

    rows = re.findall(r"step\s+(\d+)\s+loss\s+(\S+)\s+err\s+(\S+)\s+change\s+(\S+)\s+rel\s+(\S+)",
                      out)
    assert len(rows) == STEPS // EVERY, out
    losses = [float(r[1]) for r in rows]
    rel = [float(r[4]) for r in rows]
    # The same training as one process (the printed losses carry 7 digits).
    np.testing.assert_allclose(losses, one_process, rtol=2e-6)
    assert losses[0] >= 10 * losses[-1], losses
    assert rel[-1] < rel[0] / 3, rel  # the surrogate's error, relative to the solver's step
    assert "done:" in out, out

    # The prediction handed back equals the checkpoint's model on the gathered field.
    u, pred = gather_dump(tmp_path, n)
    model = load_surrogate_module().make_surrogate(channels=8).double()
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    model.load_state_dict(state["model"])
    assert state["steps"] == STEPS // EVERY
    with torch.no_grad():
        want = model(torch.from_numpy(u)[None, None])[0, 0].numpy()
    np.testing.assert_allclose(pred, want, rtol=0, atol=1e-10)
    assert np.abs(pred - u).max() > 1e-3  # a real step, not the identity


def read_cases(directory, n):
    """{case: (code, message)} per rank; every rank must have reached "done"."""
    ranks = []
    for r in range(n):
        lines = (directory / f"rank{r}.txt").read_text().splitlines()
        assert lines and lines[-1] == "done", f"rank {r} did not finish: {lines[-3:]}"
        cases = {}
        for line in lines[:-1]:
            m = re.fullmatch(r"case (\S+) code (-?\d+) message ?(.*)", line.rstrip())
            assert m, line
            cases[m.group(1)] = (int(m.group(2)), m.group(3))
        ranks.append(cases)
    for r, cases in enumerate(ranks[1:], 1):
        assert cases == ranks[0], f"rank {r} differs from rank 0:\n{cases}\n{ranks[0]}"
    return ranks[0]


def check_cases(cases, expected):
    for name, (code, *words) in expected.items():
        got, message = cases[name]
        assert got == code, f"{name}: code {got} ({message}), expected {code}"
        for w in words:
            assert w in message, f"{name}: {w!r} not in {message!r}"
        assert (message == "") == (code == errors.OK), f"{name}: {message!r}"


def test_bad_input_from_c(built, tmp_path):
    mpiexec(built["coupling_errors_c"], 2, tmp_path, SURROGATE)
    cases = read_cases(tmp_path, 2)
    E = errors
    check_cases(cases, {
        "before_init": (E.STATE, "call dp_init first"),
        "init": (E.OK,), "init_twice": (E.STATE, "already initialised"),
        "field_ok": (E.OK,), "field_ok2": (E.OK,),
        "null_pointer": (E.ARGUMENT, "dp_field_create: rank 1: null pointer"),
        "wrong_shape_blocks": (E.SHAPE, "every rank", "different owned extents",
                               "rank 0: 3, rank 1: 4"),
        "bad_dtype": (E.ARGUMENT, "dtype code 7"),
        "wrong_offset": (E.SHAPE, "global offsets (12345, 0)", "disagree"),
        "import_module": (E.IMPORT, "does not import", "No module named 'no_such_module_xyz'"),
        "import_file": (E.IMPORT, "no file /no/such/dir/model.py"),
        "import_attr": (E.IMPORT, "has no attribute 'no_such_factory'"),
        "bad_json": (E.ARGUMENT, "not valid JSON"),
        "bad_optimizer": (E.ARGUMENT, "optimizer 'adamax9'"),
        "load_failing_model": (E.OK,),
        "model_raises_everywhere": (E.MODEL, "dp_infer: every rank: RuntimeError: heat "
                                    "surrogate: failing on purpose", "heat_surrogate.py"),
        "train_raises_everywhere": (E.MODEL, "dp_train_step: every rank: RuntimeError"),
        "load_failing_model_last": (E.OK,),
        "model_raises_on_last": (E.MODEL, "dp_infer: rank 1: RuntimeError"),
        "load_model": (E.OK,), "field_components": (E.OK,),
        "wrong_shape_output": (E.SHAPE, "global shape (1, 1, 8, 3)", "output field (1, 2, 8, 3)"),
        "no_optimizer": (E.ARGUMENT, "without an optimizer"),
        "unknown_field": (E.ARGUMENT, "no field with handle 999"),
        "float32_model": (E.OK,),
        "dtype_mismatch": (E.ARGUMENT, "torch.float64", "torch.float32"),
        "save_io": (E.IO, "dp_model_save: rank 0:", "/no/such/dir"),
        "load_model_again": (E.OK,), "infer_ok": (E.OK,), "finalize": (E.OK,),
        "after_finalize": (E.STATE, "finalized"),
    })
    assert "rank 0" not in cases["model_raises_on_last"][1]


def test_bad_input_from_fortran(built, tmp_path):
    mpiexec(built["coupling_errors_f"], 2, tmp_path, SURROGATE)
    cases = read_cases(tmp_path, 2)
    E = errors
    check_cases(cases, {
        "init": (E.OK,), "field_ok": (E.OK,), "field_ok2": (E.OK,),
        "not_contiguous": (E.ARGUMENT, "every rank", "not contiguous"),
        "ghost_too_wide": (E.SHAPE, "owned extents (-2, -3)"),
        "ghost_lo_size": (E.ARGUMENT, "ghost_lo has 3 entries"),
        "import_module": (E.IMPORT, "No module named 'no_such_module_xyz'"),
        "load_failing_model_last": (E.OK,),
        "model_raises_on_last": (E.MODEL, "dp_train_step: rank 1: RuntimeError"),
        "load_model": (E.OK,), "field_components": (E.OK,),
        "wrong_shape_output": (E.SHAPE, "output field (1, 2, 8, 3)"),
        "unknown_field": (E.ARGUMENT, "no field with handle 12345"),
        "infer_ok": (E.OK,), "halo_ok": (E.OK,), "finalize": (E.OK,),
    })


def test_error_codes_agree_across_c_fortran_and_python():
    header = (ROOT / "kernels" / "coupling" / "domainpar.h").read_text()
    module = (ROOT / "kernels" / "coupling" / "domainpar.f90").read_text()
    in_c = {name: int(v) for name, v in re.findall(r"(DP_(?:OK|ERR_\w+)) = (\d+)", header)}
    in_f = {name: int(v) for name, v in re.findall(r"(DP_(?:OK|ERR_\w+)) = (\d+)", module)}
    in_py = {name: code for code, name in errors.NAMES.items()}
    assert in_c == in_py == in_f, (in_c, in_f, in_py)


def test_install_serves_pkg_config_consumers(built, tmp_path):
    """`cmake --install` to a prefix; the examples then compile and link with the MPI
    wrappers and pkg-config alone, and every library they need resolves."""
    prefix = tmp_path / "prefix"
    subprocess.run(["cmake", "--install", str(BUILD), "--prefix", str(prefix)], check=True,
                   capture_output=True, timeout=120)
    env = dict(os.environ, PKG_CONFIG_PATH=str(prefix / "lib" / "pkgconfig"))

    def flags(package):
        return subprocess.run(["pkg-config", "--cflags", "--libs", package], env=env, check=True,
                              capture_output=True, text=True).stdout.split()
    config = tmp_path / "heat2d_config.f90"
    config.write_text("module heat2d_config\n  character(len=*), parameter :: default_surrogate"
                      f' = "{SURROGATE}"\nend module heat2d_config\n')
    examples = ROOT / "examples" / "coupling"
    builds = {"hc": ["mpicc", "-D_DEFAULT_SOURCE", str(examples / "heat2d.c"),
                     *flags("domainpar"), "-lm"],
              "hf": ["mpif90", "-J", str(tmp_path), str(config), str(examples / "heat2d.f90"),
                     *flags("domainpar-fortran")]}
    for exe, cmd in builds.items():
        proc = subprocess.run([*cmd, "-o", str(tmp_path / exe)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stderr}"
        ldd = subprocess.run(["ldd", str(tmp_path / exe)], capture_output=True, text=True).stdout
        assert "not found" not in ldd, ldd
        assert str(prefix) in ldd and "libpython" in ldd, ldd
