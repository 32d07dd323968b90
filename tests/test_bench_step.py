"""`domainpar bench step`: a tiny run on 1 and 2 ranks (and the same beside it
with --compare DOMAINPAR_NATIVE=0) whose JSON has every
part of each step measured, the parts summing to the step, and the dispatch
overhead table; the hook it times DomainTensor calls by
(``tensor.dispatch.observing_ops``); the waiting split of comm calls.

Serial (not marked mpi): the command launches its own mpiexec jobs. No
timing threshold is asserted, only consistency: parts that must be there are
positive, none is negative beyond the stated slack, and they add up to the
step's wall time.
"""
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from domainpar import launch

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The remainder (compute) may come out below zero by at most this much of the
# step: the calibrated instrumentation cost is a median, each step's differs.
SLACK = 0.05


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("step") / "step.json"
    proc = subprocess.run(
        [sys.executable, "-m", "domainpar.cli", "bench", "step", "--ranks", "1", "2",
         "--unet-side", "16", "--field-side", "32", "--levels", "3", "--repeats", "2",
         "--compare", "DOMAINPAR_NATIVE=0", "--out", str(out)],
        env=dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"JSON: {out}" in proc.stdout and "DomainTensor us" in proc.stdout
    return json.loads(out.read_text()), out


def test_png_beside_the_json(report):
    pytest.importorskip("matplotlib", reason="matplotlib is needed for the benchmarks' PNGs")
    assert report[1].with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


def test_parts_sum_to_the_step_and_none_is_negative(report):
    data = report[0]
    assert data["benchmark"] == "step" and data["rank_counts"] == [1, 2]
    assert set(data["models"]) == {"unet3d", "vit2d", "fno2d"}
    for model, points in data["models"].items():
        for n, point in points.items():
            assert len(point["per_rank"]) == int(n)
            assert point["waits_matched"], (model, n)
            for rank in point["per_rank"]:
                parts, step = rank["parts_s"], rank["step_s"]
                assert set(parts) == set(data["parts"])
                assert sum(parts.values()) == pytest.approx(step, rel=1e-9), (model, n)
                assert min(parts.values()) >= -SLACK * step, (model, n, parts)
                for part in ("compute", "dispatch", "instrumentation"):
                    assert parts[part] > 0, (model, n, part, parts)
                assert rank["ops_per_step"] > 0 and rank["block_torch_calls_per_step"] > 0
                assert 0 <= rank["comm_cpu_s"] <= rank["step_cpu_s"] + 1e-3, rank
                by_op = rank["dispatch_by_op"]  # the top of the dispatch part, by op
                assert by_op and all(row["calls"] > 0 for row in by_op.values())
                assert sum(row["dispatch_s"] for row in by_op.values()) <= (
                    parts["dispatch"] + SLACK * step), (model, n, by_op)
                assert rank["dispatch_us_per_op"] == pytest.approx(
                    1e6 * parts["dispatch"] / rank["ops_per_step"])


def test_communication_parts_where_they_must_be(report):
    models = report[0]["models"]
    for model in models:  # the parameter gradients' reduction on 2 ranks
        for rank in models[model]["2"]["per_rank"]:
            assert rank["parts_s"]["allreduce"] + rank["parts_s"]["waiting"] > 0, model
        assert models[model]["2"]["mean_parts_s"]["allreduce"] > 0, model
    unet = models["unet3d"]
    assert all(r["parts_s"]["halo"] > 0 for r in unet["2"]["per_rank"])
    assert all(r["comm_calls_per_step"] > 0 for r in unet["2"]["per_rank"])
    for model in models:  # one rank waits for nobody
        assert models[model]["1"]["mean_parts_s"]["waiting"] == 0, model
    # the FNO's transforms along the sharded dim move blocks (repartitions)
    assert models["fno2d"]["2"]["mean_parts_s"]["other_comm"] > 0


def test_compare_runs_b_beside_a(report):
    data = report[0]
    assert data["configurations"]["B"] == {"DOMAINPAR_NATIVE": "0"}
    assert set(data["configurations"]["A"]) == {"DOMAINPAR_NATIVE"}
    assert set(data["B"]["models"]) == set(data["models"])
    for model, ratios in data["ratio_B_over_A"].items():
        assert set(ratios) == {"1", "2"}
        b = data["B"]["models"][model]["2"]["per_rank"]
        assert all(r > 0 for r in ratios.values()) and len(b) == 2
    assert data["B"]["dispatch_overhead"]


def test_dispatch_overhead_table(report):
    table = report[0]["dispatch_overhead"]
    assert sorted({row["cells"] for row in table}) == [1_000, 10_000, 100_000, 1_000_000]
    assert {row["op"] for row in table} == {"add", "gelu"}
    for row in table:
        assert row["torch_us"] > 0 and row["domaintensor_us"] > 0
        assert row["overhead_us"] == pytest.approx(row["domaintensor_us"] - row["torch_us"])


def test_observing_ops_sees_outermost_calls_only():
    import torch
    from mpi4py import MPI

    import domainpar as dp
    from domainpar.tensor import dispatch
    grid = dp.ProcessGrid((1,), comm=MPI.COMM_SELF)
    x = dp.DomainTensor.from_local(torch.ones(2, 3), grid, shard={0: 0})
    seen = []

    @contextlib.contextmanager
    def observer(func):
        seen.append(dispatch.op_name(func))
        yield

    with dispatch.observing_ops(observer):
        (x + 1).relu().sum()
    (x * 2).sum()  # outside the block: not observed
    assert seen == ["Tensor.add", "Tensor.relu", "Tensor.sum"]
    assert not dispatch._OP_OBSERVERS


def test_waits_from_entry_times():
    from domainpar.bench.step import Recorder, _waits, step_parts
    # rank 1 enters the allreduce 0.3 s after rank 0, the halo fill 0.1 s before
    calls = [[("allreduce", 0.0, 0.5, True), ("HaloExchange.fill", 1.0, 0.2, False)],
             [("allreduce", 0.3, 0.2, True), ("HaloExchange.fill", 0.9, 0.3, False)]]
    assert _waits(calls, 0, 2) == pytest.approx([0.3, 0.0])
    assert _waits(calls, 1, 2) == pytest.approx([0.0, 0.1])
    assert _waits([calls[0], calls[1][:1]], 0, 2) is None  # different sequences
    rec = Recorder()
    rec.calls, rec.op_s, rec.local_s, rec.ops, rec.local_calls = calls[0], 0.9, 0.1, 2, 10
    parts = step_parts(rec, 2.0, [0.3, 0.0], {"per_op_s": 0.01, "per_call_s": 0.001})
    assert parts["allreduce"] == pytest.approx(0.2) and parts["waiting"] == pytest.approx(0.3)
    assert parts["halo"] == pytest.approx(0.2)
    assert parts["instrumentation"] == pytest.approx(0.03)
    assert parts["dispatch"] == pytest.approx(0.9 - 0.1 - 0.5 - 0.03)
    assert sum(parts.values()) == pytest.approx(2.0)


def test_inference_splits_a_no_grad_forward(report, tmp_path):
    """--inference: the same split of a no_grad forward of the same UNet3d as the
    training fixture's, with no loss and no gradient reduction in it."""
    out = tmp_path / "inference.json"
    proc = subprocess.run(
        [sys.executable, "-m", "domainpar.cli", "bench", "step", "--ranks", "1", "2",
         "--models", "unet3d", "--unet-side", "16", "--levels", "3", "--repeats", "1",
         "--inference", "--out", str(out)],
        env=dict(launch.mpiexec_env(), PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "where an inference forward's time goes" in proc.stdout
    data = json.loads(out.read_text())
    assert data["step"].startswith("inference") and report[0]["step"].startswith("training")
    for n, point in data["models"]["unet3d"].items():
        trained = report[0]["models"]["unet3d"][n]["per_rank"]
        for rank, train in zip(point["per_rank"], trained):
            assert sum(rank["parts_s"].values()) == pytest.approx(rank["step_s"], rel=1e-9)
            assert "torch.nn.functional.mse_loss" in train["dispatch_by_op"]
            assert "torch.nn.functional.mse_loss" not in rank["dispatch_by_op"]
            assert 0 < rank["ops_per_step"] < train["ops_per_step"]
    assert all(r["parts_s"]["halo"] > 0 for r in data["models"]["unet3d"]["2"]["per_rank"])
