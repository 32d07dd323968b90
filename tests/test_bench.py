"""`domainpar bench`: every subcommand end to end at tiny sizes with --compare
(JSON with both configurations and the B/A ratios, a PNG beside it, progress
on stderr, the table on stdout) and --compare's checks. tests/test_runtime.py
runs `bench halo` without --compare.

Serial (not marked mpi): the commands launch their own mpiexec jobs. No
timing is asserted.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from domainpar import cli, launch

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env():
    """The environment the CLI gives its own mpiexec jobs, with this checkout importable."""
    return dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT))


def _bench(tmp_path, name: str, *args: str):
    """Run ``domainpar bench NAME ARGS``; its report, stdout and stderr, after
    checking the exit code and the PNG beside the JSON."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "domainpar.cli", "bench", name, *args,
                           "--out", str(out)],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == name
    _check_png(out.with_suffix(".png"))
    assert f"PNG: {out.with_suffix('.png')}" in proc.stdout
    return report, proc.stdout, proc.stderr


def _check_png(path: Path) -> None:
    image = pytest.importorskip("matplotlib.image",
                                reason="matplotlib is needed for the benchmarks' PNGs")
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    pixels = image.imread(path)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 300, pixels.shape


def _measured(values: dict, what: str) -> None:
    """Every reported figure in ``values`` (nested) was measured: positive."""
    for key, v in values.items():
        if isinstance(v, dict):
            _measured(v, f"{what}.{key}")
        else:
            assert v > 0, f"{what}.{key} = {v!r} was not measured"


def _conv_parts_measured(case: dict) -> None:
    """Each part `bench conv` reports measures something: the steps, the halo
    exchanges of the N-rank step (timed through comm.clock.observing, a fill in
    forward and an accumulate in backward at least), the profile's kinds (none
    of one process's time is halo exchange) and the split probe."""
    _measured({k: case[k] for k in ("median_step_s", "median_cpu_s", "halo_exposed_s")}, "conv")
    assert case["halo_exchanges_per_step"] >= 2, case["halo_exchanges_per_step"]
    _measured({k: case["split_probe"][k] for k in ("whole_forward", "split_forward",
                                                   "whole_step", "split_step")}, "split_probe")
    ranks, one = (case["profile"][p]["self_ms_by_kind"] for p in ("ranks", "one_process"))
    _measured({k: ranks[k] for k in ("conv forward", "conv backward", "halo exchange")},
              "profile.ranks")
    _measured({k: one[k] for k in ("conv forward", "conv backward")}, "profile.one_process")
    assert one["halo exchange"] == 0, one


def _compared(report: dict, settings: dict) -> None:
    assert report["configurations"]["B"] == settings
    assert set(report["configurations"]["A"]) == set(settings)


def test_halo_compare_forces_the_way_in_b_only(tmp_path):
    report, stdout, stderr = _bench(
        tmp_path, "halo", "-n", "2", "--dims", "3", "--faces", "0.0625", "--repeats", "2",
        "--compare", "DOMAINPAR_HALO_WAY=pack", "DOMAINPAR_NATIVE=0")
    _compared(report, {"DOMAINPAR_HALO_WAY": "pack", "DOMAINPAR_NATIVE": "0"})
    assert len(report["cases"]) == 3
    for case in report["cases"]:
        _measured(case["median_s"], "A median_s")
        _measured(case["B"]["median_s"], "B median_s")
        assert set(case["B"]["median_s"]) == set(case["median_s"])
        assert set(case["ratio_B_over_A"]) == set(case["median_s"])
        assert all(r > 0 for r in case["ratio_B_over_A"].values())
        if case["strided"]:  # B's exchange was planned under DOMAINPAR_HALO_WAY=pack
            assert case["B"]["fill_way"] == "pack", case
            assert not any(case["B"]["fill_tuning_s"].values())  # forced: nothing tuned
    assert "bench halo [" in stderr  # progress on stderr ...
    assert " B   3-D" in stdout and " A   3-D" in stdout  # ... both rows of the table on stdout
    assert "bench halo [" not in stdout


def test_grads_compare(tmp_path):
    report, stdout, _ = _bench(tmp_path, "grads", "-n", "1", "--layers", "2", "--width", "16",
                               "--side", "4", "--repeats", "2", "--compare", "OMP_NUM_THREADS=2")
    _compared(report, {"OMP_NUM_THREADS": "2"})
    variants = {"per_op", "domain_parallel", "domain_parallel_blocking"}
    assert set(report["median_step_s"]) == variants
    assert set(report["B"]["median_step_s"]) == variants
    _measured(report["median_step_s"], "A")
    _measured(report["B"]["median_step_s"], "B")
    assert all(len(v) == 2 for v in report["B"]["samples_s"].values())
    assert set(report["ratio_B_over_A"]) == variants
    assert "B/A step:" in stdout


def test_attention_compare(tmp_path):
    report, _, _ = _bench(tmp_path, "attention", "-n", "1", "--tokens", "64", "--repeats", "1",
                          "--compare", "OMP_NUM_THREADS=2")
    _compared(report, {"OMP_NUM_THREADS": "2"})
    case = report["cases"]["64"]
    assert set(case["B"]["median_step_s"]) == {"ranks", "one_process"}
    _measured(case["median_step_s"], "A")
    _measured(case["B"]["median_step_s"], "B")
    assert case["B"]["speedup"] > 0 and case["B"]["memory_ratio"] > 0
    assert set(case["ratio_B_over_A"]) >= {"step_ranks", "step_one_process", "speedup"}


def test_io_compare_switches_the_driver_in_b(tmp_path):
    report, _, _ = _bench(tmp_path, "io", "-n", "1", "--samples", "2", "--side", "32",
                          "--repeats", "1", "--compare", "DOMAINPAR_IO=serial")
    _compared(report, {"DOMAINPAR_IO": "serial"})
    assert report["B"]["compute_epochs_driver"] == "serial"
    assert report["compute_epochs_driver"] == ("mpio" if report["h5py_mpi"] else "serial")
    assert set(report["B"]["aggregate_read_mib_per_s"]) == set(report["aggregate_read_mib_per_s"])
    for part in (report, report["B"]):
        _measured(part["aggregate_read_mib_per_s"], "aggregate_read_mib_per_s")
        _measured(part["median_epoch_s"], "median_epoch_s")
    assert set(report["ratio_B_over_A"]) == set(report["median_epoch_s"])


def test_conv_compare_jobs(tmp_path):
    report, stdout, _ = _bench(tmp_path, "conv", "-n", "2", "--cases", "conv2d",
                               "--scale", "0.0625", "--repeats", "1", "--probe-repeats", "1",
                               "--memory-repeats", "0", "--compare", "DOMAINPAR_HALO_WAY=pack")
    _compared(report, {"DOMAINPAR_HALO_WAY": "pack"})
    for part in (report, report["B"]):
        case = part["cases"]["conv2d"]
        assert case["shape"] == [1, 8, 64, 64]
        assert case["speedup"] > 0 and len(case["samples"]["ranks"]) == 1
        _conv_parts_measured(case)
        assert part["memory"] == {}
    assert set(report["ratio_B_over_A"]["conv2d"]) == {"step_ranks", "step_one_process",
                                                      "speedup"}
    assert "memory not measured" in stdout


def test_scaling_compare_jobs(tmp_path):
    report, stdout, stderr = _bench(
        tmp_path, "scaling", "--ranks", "2", "--strong-shape", "1", "1", "8", "8", "8",
        "--weak-block", "1", "1", "4", "8", "8", "--levels", "2", "--repeats", "1",
        "--compare", "OMP_NUM_THREADS=2")
    _compared(report, {"OMP_NUM_THREADS": "2"})
    assert report["rank_counts"] == [2]
    for part in (report, report["B"]):
        strong, weak = part["strong"]["points"], part["weak"]["points"]
        assert strong["2"]["local_shape"] == [1, 1, 4, 8, 8]
        assert weak["2"]["global_shape"] == [1, 1, 8, 8, 8]
        for points in (strong, weak):  # the smallest rank count is the reference
            assert points["2"]["efficiency"] == pytest.approx(1.0)
            assert len(points["2"]["samples_s"]) == 1
            assert points["2"]["median_step_s"] > 0
    assert set(report["ratio_B_over_A"]["strong"]) == {"2"}
    assert f"this machine has {report['cpus']} cores" in stdout
    assert "scaling jobs [" in stderr


def test_scaling_efficiency_definitions():
    from domainpar.bench.scaling import _efficiencies, default_rank_counts, weak_shape
    points = {str(n): {"ranks": n, "median_step_s": t} for n, t in ((1, 8.0), (2, 5.0), (4, 4.0))}
    _efficiencies(points, "strong")  # T1 / (n Tn)
    assert [points[n]["efficiency"] for n in ("1", "2", "4")] == [1.0, 0.8, 0.5]
    _efficiencies(points, "weak")  # T1 / Tn
    assert [points[n]["efficiency"] for n in ("1", "2", "4")] == [1.0, 1.6, 2.0]
    assert default_rank_counts(6) == [1, 2, 4, 6] and default_rank_counts(1) == [1]
    assert weak_shape((1, 2, 16, 8, 8), 3) == (1, 2, 48, 8, 8)


def test_scaling_efficiency_round_by_round():
    """With several rounds, each point's efficiency per round pairs its job with the
    base's job of the same round; the pooled efficiency stays the medians'. One
    round, or rounds that do not pair up, give none."""
    from domainpar.bench.scaling import _efficiencies, _rounds_line
    points = {"1": {"ranks": 1, "median_step_s": 8.0, "job_medians_s": [8.0, 12.0, 6.0]},
              "2": {"ranks": 2, "median_step_s": 5.0, "job_medians_s": [5.0, 5.0, 6.0]},
              "4": {"ranks": 4, "median_step_s": 4.0, "job_medians_s": [4.0]}}
    _efficiencies(points, "strong")
    assert points["2"]["efficiency"] == 0.8
    assert points["2"]["round_efficiencies"] == [0.8, 1.2, 0.5]
    assert "round_efficiencies" not in points["1"] and "round_efficiencies" not in points["4"]
    line = _rounds_line("", "strong", "2", points["2"])
    assert "efficiency round by round 0.50-1.20, median 0.80 (3 rounds" in line
    _efficiencies(points, "weak")
    assert points["2"]["round_efficiencies"] == [1.6, 2.4, 1.0]


def test_scaling_model_inference_rounds(tmp_path):
    """--model, --inference and --rounds: the JSON names the model, the mode and
    the machine; each rank count pools one job's samples per round."""
    report, stdout, _ = _bench(tmp_path, "scaling", "--model", "vit2d", "--inference",
                               "--side", "16", "--ranks", "1", "2", "--repeats", "1",
                               "--rounds", "2")
    assert (report["model"], report["mode"], report["rounds"]) == ("vit2d", "inference", 2)
    assert report["model_config"].startswith("ViT2d(") and "no_grad" in report["step"]
    machine = report["machine"]
    assert machine["cores"] == report["cpus"] > 0 and machine["host"] == report["host"]
    assert len(machine["loadavg_start"]) == len(machine["loadavg_end"]) == 3
    assert report["strong"]["global_shape"] == [1, 1, 16, 16]
    assert report["weak"]["block_shape"] == [1, 1, 8, 16]
    strong, weak = report["strong"]["points"], report["weak"]["points"]
    assert strong["2"]["local_shape"] == [1, 1, 8, 16]
    assert weak["2"]["global_shape"] == [1, 1, 16, 16]
    for points in (strong, weak):
        for n in ("1", "2"):
            p = points[n]
            assert len(p["samples_s"]) == len(p["job_medians_s"]) == 2  # one per round
            assert min(p["samples_s"]) <= p["median_step_s"] <= max(p["samples_s"])
            assert p["speedup"] > 0
        assert points["1"]["efficiency"] == pytest.approx(1.0)
        assert len(points["2"]["round_efficiencies"]) == 2
    assert "ViT2d(patch=4" in stdout and "inference forward (eval, no_grad)" in stdout
    assert "2 rounds alternating" in stdout
    assert "strong, 2 ranks: efficiency round by round" in stdout


def test_scaling_one_mode_plots(tmp_path):
    """--modes strong alone: the report has no weak part and the PNG is still drawn
    (it once failed looking for the weak part)."""
    report, _, _ = _bench(tmp_path, "scaling", "--model", "fno2d", "--side", "16",
                          "--ranks", "1", "--repeats", "1", "--modes", "strong")
    assert "strong" in report and "weak" not in report


def test_scaling_contention(tmp_path):
    """--contention: beside each multi-rank step, the blocks' one-rank steps run all at
    once ("together"); the report keeps their samples and the efficiency against them,
    and a 1-rank point has none."""
    report, stdout, _ = _bench(tmp_path, "scaling", "--model", "fno2d", "--side", "16",
                               "--ranks", "1", "2", "--repeats", "2", "--contention")
    assert report["contention"] is True
    for mode in ("strong", "weak"):
        one, two = report[mode]["points"]["1"], report[mode]["points"]["2"]
        assert "together_step_s" not in one
        assert len(two["together_samples_s"]) == 2
        assert min(two["together_samples_s"]) <= two["together_step_s"]
        assert two["efficiency_vs_together"] == pytest.approx(
            two["together_step_s"] / two["median_step_s"])
    assert "eff. vs together" in stdout


def test_scaling_shapes_per_model(capsys):
    from domainpar.bench import scaling
    assert scaling.shapes("unet3d") == ((1, 2, 64, 64, 64), (1, 2, 32, 64, 64))
    assert scaling.shapes("fno2d", 128) == ((1, 1, 128, 128), (1, 1, 64, 128))
    assert scaling.shapes("vit2d", 64, weak=(1, 1, 16, 64)) == ((1, 1, 64, 64), (1, 1, 16, 64))
    with pytest.raises(ValueError, match="fno2d takes 4 extents"):
        scaling.shapes("fno2d", strong=(1, 2, 8, 8, 8))
    args = cli.build_parser().parse_args(["bench", "scaling", "--model", "vit2d",
                                          "--weak-block", "1", "2", "8", "8", "8"])
    with pytest.raises(SystemExit, match="--weak-block 1 2 8 8 8: vit2d takes 4 extents"):
        args.run(args)


@pytest.mark.parametrize("model,shape", [("unet3d", (1, 2, 8, 8, 8)), ("vit2d", (1, 1, 8, 8)),
                                         ("fno2d", (1, 1, 8, 8)), ("resnet3d", (1, 2, 8, 8, 8))])
def test_scaling_steps_train_or_only_infer(model, shape):
    """A training step moves the parameters; an inference step (eval, no_grad)
    neither moves them nor leaves gradients, and keeps BatchNorm's running stats."""
    import torch
    from mpi4py import MPI

    import domainpar as dp
    from domainpar.bench import step as bench_step
    grid = dp.ProcessGrid((1,), comm=MPI.COMM_SELF)
    factory = bench_step.model_factory(model, shape, levels=2)
    for inference in (True, False):
        made = factory()  # DomainParallel wraps this module: its parameters are the model's
        build = bench_step.inference_step if inference else bench_step.training_step
        step, local = build(grid, lambda m=made: m, shape)
        before = [t.detach().clone() for t in made.state_dict().values()]
        step()
        after = list(made.state_dict().values())
        moved = any(not torch.equal(a, b) for a, b in zip(before, after))
        assert local == shape and moved is not inference
        if inference:
            assert all(p.grad is None for p in made.parameters())


def test_scaling_ceiling_comes_from_the_lone_block():
    """Strong scaling's ceiling at n ranks is T1(field) / (n T1(block)), from the
    weak run's 1-rank job on the same block; none where no 1-rank job ran it."""
    from domainpar.bench import scaling

    def job(shape, t):
        return {"ranks": 0, "local_shape": list(shape), "median_step_s": t}

    def jobs():  # _figures adds to the points it is given: a fresh set per call
        return {1: {"strong": {**job((1, 2, 8, 8), 1.0), "ranks": 1},
                    "weak": {**job((1, 2, 4, 8), 0.6), "ranks": 1}},
                2: {"strong": {**job((1, 2, 4, 8), 0.625), "ranks": 2},
                    "weak": {**job((1, 2, 4, 8), 0.7), "ranks": 2}},
                4: {"strong": {**job((1, 2, 2, 8), 0.5), "ranks": 4},
                    "weak": {**job((1, 2, 4, 8), 0.8), "ranks": 4}}}
    figures = scaling._figures(jobs(), ("strong", "weak"))
    two = figures["strong"]["points"]["2"]
    assert two["efficiency"] == pytest.approx(0.8)
    assert two["ceiling"] == pytest.approx(1.0 / (2 * 0.6))
    assert two["efficiency_vs_ceiling"] == pytest.approx(0.8 * 1.2)
    assert "ceiling" not in figures["strong"]["points"]["4"]
    assert "ceiling" not in scaling._figures(jobs(), ("strong",))["strong"]["points"]["2"]


def test_compare_rejects_unknown_keys_and_values(capsys):
    parser = cli.build_parser()
    for words, says in ((["FOO=1"], "valid keys: DOMAINPAR_HALO_WAY"),
                        (["DOMAINPAR_NATIVE=2"], "DOMAINPAR_NATIVE='2': use 0, 1"),
                        (["DOMAINPAR_IO"], "expected KEY=VALUE"),
                        (["OMP_NUM_THREADS="], "OMP_NUM_THREADS needs a value"),
                        (["DOMAINPAR_IO=serial", "DOMAINPAR_IO=mpio"], "given twice")):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["bench", "grads", "--compare", *words])
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err
    args = parser.parse_args(["bench", "scaling", "--compare", "DOMAINPAR_HALO_WAY=",
                              "OMP_NUM_THREADS=3"])
    assert args.compare == {"DOMAINPAR_HALO_WAY": "", "OMP_NUM_THREADS": "3"}


def test_applied_sets_and_restores_the_settings(monkeypatch):
    from domainpar.bench import settings
    from domainpar.comm import halo, packing
    monkeypatch.delenv("DOMAINPAR_HALO_WAY", raising=False)
    monkeypatch.setenv("DOMAINPAR_IO", "mpio")
    before = (halo.FORCED_WAY, packing.use_native)
    with settings.applied({"DOMAINPAR_HALO_WAY": "datatype", "DOMAINPAR_NATIVE": "0",
                           "DOMAINPAR_IO": ""}):
        assert halo.FORCED_WAY == "datatype" and packing.use_native is False
        assert "DOMAINPAR_IO" not in settings.os.environ
    assert (halo.FORCED_WAY, packing.use_native) == before
    assert settings.os.environ["DOMAINPAR_IO"] == "mpio"
    assert "DOMAINPAR_HALO_WAY" not in settings.os.environ


@pytest.mark.parametrize("key,values", [("MALLOC_MMAP_THRESHOLD_", ("12345", "54321")),
                                        ("DOMAINPAR_MALLOC", ("0", "1"))])
def test_malloc_settings_are_refused_in_a_running_process(monkeypatch, key, values):
    """glibc reads its tunables at start, domainpar sets its thresholds on import:
    applying another value in-process (a benchmark that does not launch jobs)
    raises; a job started with the value (B's job re-applying its own settings)
    passes."""
    from domainpar.bench import settings
    started = settings._STARTED_WITH[key]
    other = values[0] if started != values[0] else values[1]
    with pytest.raises(ValueError, match="launch their own jobs"):
        with settings.applied({key: other}):
            pass
    assert settings.os.environ.get(key) == started  # restored
    monkeypatch.setitem(settings._STARTED_WITH, key, other)  # as in B's job
    monkeypatch.setenv(key, other)
    with settings.applied({key: other}):
        assert settings.os.environ[key] == other


def test_clock_observing_sees_each_outermost_exchange_once():
    """The benches' one hook into communication: every outermost call, by name,
    only inside the block (one process: a grid of size one still exchanges)."""
    import contextlib

    import numpy as np

    import domainpar as dp
    from domainpar.comm import clock
    grid = dp.ProcessGrid((1,), periodic=True)
    halo = dp.HaloExchange(dp.Decomposition((8,), grid, {0: 0}), {0: 1})
    seen = []

    @contextlib.contextmanager
    def observer(name):
        seen.append(name)
        yield
    a = np.arange(halo.padded_shape[0], dtype=np.float64)
    with clock.observing(observer):
        halo.fill(a)
        halo.accumulate(a)
    halo.fill(a)
    assert seen == ["HaloExchange.fill", "HaloExchange.accumulate"]
    # fill wrapped 8 and 1 into the ghosts, accumulate added them back, fill again
    assert (a[0], a[1], a[8], a[9]) == (16, 2, 16, 2), a
    halo.settle(np.zeros(halo.padded_shape))
    assert all(t["settled"] for t in halo.tuning()) and len(halo.rounds) == 1


@pytest.mark.mpi
def test_time_on_rank0_steps_on_rank0_alone_and_fails_on_every_rank():
    """Other ranks pass None (they have no whole problem); rank 0 without a step,
    or with one that raises, fails on every rank instead of leaving them waiting."""
    from mpi4py import MPI

    from domainpar import DomainparError
    from domainpar.bench.timing import time_on_rank0
    from domainpar.testing import raises_on_every_rank
    comm = MPI.COMM_WORLD
    calls = []
    sample = time_on_rank0(comm, (lambda: calls.append(1)) if comm.Get_rank() == 0 else None)
    assert set(sample) == {"wall", "cpu"} and sample == comm.bcast(sample, root=0)
    assert len(calls) == (comm.Get_rank() == 0)
    raises_on_every_rank(DomainparError, "rank 0 failed: TypeError: time_on_rank0: rank 0 was given "
                         "no step", lambda: time_on_rank0(comm, None), comm)

    def fails():
        raise KeyError("broken step")
    raises_on_every_rank(DomainparError, "rank 0 failed: KeyError: 'broken step'",
                         lambda: time_on_rank0(comm, fails if comm.Get_rank() == 0 else None),
                         comm)


# -- bench swap ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,message", [
    ("domainpar.ops.conv:_PIECE_ROWS", "expected MODULE:NAME=VALUE"),
    ("domainpar.ops.conv=1", "expected MODULE:NAME"),
    ("os:sep=1", "only domainpar's own modules"),
    ("domainpar.nope:x=1", "no module 'domainpar.nope'"),
    ("domainpar.ops.conv:_NOPE=1", "has no attribute '_NOPE'"),
    ("domainpar.ops.conv:_PIECE_ROWS=f(", "a Python literal"),
    ("domainpar.ops.conv:_PIECE_ROWS=@domainpar.ops.conv:_NOPE", "has no attribute '_NOPE'"),
])
def test_swap_refuses_bad_changes(text, message, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "swap", "--set", text])
    assert message in capsys.readouterr().err


def test_swapped_sets_and_restores():
    from domainpar.bench.swap import swapped
    from domainpar.ops import common, conv
    rows, cached = conv._PIECE_ROWS, common._meta_cached
    with swapped(["domainpar.ops.conv:_PIECE_ROWS=3",
                  "domainpar.ops.common:_meta_cached=@domainpar.ops.common:_meta_cached"
                  ".__wrapped__"]):
        assert conv._PIECE_ROWS == 3 and common._meta_cached is cached.__wrapped__
    assert conv._PIECE_ROWS == rows and common._meta_cached is cached
    with pytest.raises(KeyError), swapped(["domainpar.ops.conv:_PIECE_ROWS=None"]):
        raise KeyError("a step that fails under B")
    assert conv._PIECE_ROWS == rows


def test_swap_runs_b_and_only_b_under_the_change(monkeypatch):
    """In-process, one rank: every conv backward of B's steps sees the changed
    constant, every one of A's the code's own; it is restored after."""
    from mpi4py import MPI

    from domainpar.bench import swap
    from domainpar.ops import conv
    seen = []
    row_pieces = conv._row_pieces
    monkeypatch.setattr(conv, "_row_pieces",
                        lambda *a: seen.append(conv._PIECE_ROWS) or row_pieces(*a))
    rows = conv._PIECE_ROWS
    result = swap.measure(MPI.COMM_SELF, "unet3d", (1, 2, 8, 8, 8),
                          [f"domainpar.ops.conv:_PIECE_ROWS={rows + 5}"], repeats=2, levels=2)
    assert len(result["A"]) == len(result["B"]) == 2
    assert sorted(set(seen)) == [rows, rows + 5]
    assert seen.count(rows) == seen.count(rows + 5)  # A and B: the same steps, alternating
    assert conv._PIECE_ROWS == rows


def test_swap_command(tmp_path):
    report, stdout, _ = _bench(tmp_path, "swap", "--model", "fno2d", "--shape", "1", "1", "16",
                               "16", "--ranks", "1", "--repeats", "2", "--set",
                               "domainpar.ops.conv:_PIECE_ROWS=1")
    assert report["changes"] == ["domainpar.ops.conv:_PIECE_ROWS=1"]
    assert report["global_shape"] == [1, 1, 16, 16] and report["ranks"] == 1
    a, b = report["A"], report["B"]
    assert len(a["samples_s"]) == len(b["samples_s"]) == 2
    assert report["ratio_B_over_A"] == pytest.approx(b["median_step_s"] / a["median_step_s"])
    assert "B/A median step" in stdout
