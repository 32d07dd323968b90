"""The time model (`domainpar model`, issue 20 item 3): its communication
counts against what the ops really exchange, and its arithmetic.

Timings are not asserted (they depend on the machine and its load); the
counts are: ``comms.traffic`` re-counts every event of a step from its layout
alone, and must give the bytes and messages that ``comms.record`` read off the
exchanges' own plans on this rank, on 1 to 4 ranks (the MPI tests), on even,
uneven, zero-size and periodic layouts and widths wider than a neighbour's
block. The serial tests check hand-counted cases and the prediction's sums.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import domainpar as dp
from domainpar.plan.comms import Event, Where, record, traffic
from domainpar.plan.timeattn import attention_seconds, counting, target_work, work_of
from domainpar.plan.timemodel import (
    Compute,
    Machine,
    Network,
    category,
    event_seconds,
    limiting,
    predict,
    ring_hops,
)
from domainpar.plan.timereport import (
    VALIDATION_MODELS,
    _cubic,
    load_warning,
    others_running,
    validation_models,
    validation_table,
)
from domainpar.plan.timerun import fit_compute
from domainpar.testing import layout, shard_like
from domainpar.testing.models import FNO2d, UNet3d
from tensor_cases import SIZE

F32 = 4


def halo_event(shape, shard, lo, hi, wraps=None, sizes=None) -> Event:
    ndim = len(shape)
    return Event("halo", "fill", F32, tuple(shape), dict(shard), lo=tuple(lo), hi=tuple(hi),
                 wraps=tuple(wraps or (False,) * ndim), sizes=dict(sizes or {}))


# -- serial: hand-counted ----------------------------------------------------------------------
def test_halo_counts_one_round_by_hand():
    e = halo_event((4, 12), {1: 0}, (0, 1), (0, 2))
    # 3 ranks of 4 columns: the middle one gets 1 + 2 columns of 4 rows from 2 neighbours.
    assert traffic(e, Where((3,), (1,))) == ((1 + 2) * 4 * F32, 2)
    assert traffic(e, Where((3,), (0,))) == (2 * 4 * F32, 1)    # no lo neighbour
    assert traffic(e, Where((3,), (2,))) == (1 * 4 * F32, 1)
    assert traffic(e, Where((1,), (0,))) == (0, 0)


def test_halo_counts_corners_through_the_second_round():
    e = halo_event((6, 6), {0: 0, 1: 1}, (1, 1), (1, 1))
    # 3x3 ranks of 2x2: round 0 brings 2 rows of 2; round 1 two columns of 2 + 2 ghosts.
    assert traffic(e, Where((3, 3), (1, 1))) == ((2 * 2 + 2 * 4) * F32, 4)


def test_halo_counts_reach_two_hops_and_wrap():
    e = halo_event((8,), {0: 0}, (3,), (0,), wraps=(True,))
    # 4 ranks of 2 cells, periodic: 3 ghosts below come from two ranks.
    assert traffic(e, Where((4,), (0,))) == (3 * F32, 2)
    # One periodic rank fills its ghosts from itself: nothing on the network.
    assert traffic(e, Where((1,), (0,))) == (0, 0)


def test_halo_counts_follow_recorded_sizes_and_scale():
    e = halo_event((1, 10), {1: 0}, (0, 1), (0, 1), sizes={1: [7, 3]})
    assert traffic(e, Where((2,), (1,))) == (1 * F32, 1)
    # Scaled 4x, the recorded sizes no longer fit: balanced blocks of 20.
    assert traffic(e, Where((3,), (1,), (1.0, 4.0))) == (2 * F32, 2)


def test_repartition_counts_by_hand():
    e = Event("repartition", "repartition", F32, (8, 8), {0: 0}, {1: 0})
    # 4 ranks: a destination block of 8x2 holds 2x2 of its own, the rest from 3 peers.
    assert traffic(e, Where((4,), (1,))) == ((16 - 4) * F32, 3)
    assert traffic(e, Where((1,), (0,))) == (0, 0)


def test_allreduce_time_and_categories():
    net = Network("n", 1e-6, 1e9, 5e-6)
    grads = Event("allreduce", "iallreduce", F32, (1000,), ranks=2, nbytes=4000)
    stats = Event("allreduce", "allreduce", 8, (4,), ranks=2, nbytes=32)
    assert category(grads) == "gradient allreduce" and category(stats) == "small allreduces"
    assert event_seconds(grads, Where((8,), (4,)), net) == pytest.approx(
        3 * 5e-6 + 2 * 7 / 8 * 4000 / 1e9)
    assert event_seconds(grads, Where((1,), (0,)), net) == 0.0


def test_predict_sums_compute_and_events_and_shares_cores():
    events = [halo_event((1, 1, 16), {2: 0}, (0, 0, 1), (0, 0, 1)),
              Event("allreduce", "iallreduce", F32, (10,), ranks=2, nbytes=40)]
    compute = Compute((0.01, 1e-3), (2,))
    net = Network("n", 1e-3, 1e6)
    machine = Machine("m", net, rate=0.5, cores=2)
    r = predict(events, (1, 1, 16), (1, 1, 16), (4,), (2,), compute, machine)
    halo = 2 * 1e-3 + 2 * F32 / 1e6
    allreduce = 2 * 2e-3 + 2 * 3 / 4 * 40 / 1e6
    compute_s = 0.01 + 1e-3 * 4 * 0.5  # the fixed part runs at the host's rate
    assert r["block"] == [1, 1, 4]
    assert r["step"] == pytest.approx(2 * (compute_s + halo + allreduce))  # 4 ranks, 2 cores
    assert r["halo"] == pytest.approx(2 * halo)


def test_limiting_names_the_largest_part_where_efficiency_halves():
    rows = [{"ranks": p, "step": s, "compute": c, "attention": 0.0, "halo": h,
             "gradient allreduce": 0.0,
             "small allreduces": a, "transposes": 0.0, "ring shifts": 0.0, "gathers": 0.0,
             "fixed": 0.0}
            for p, s, c, h, a in ((1, 8.0, 8.0, 0, 0), (2, 4.2, 4, 0.1, 0.1),
                                  (4, 4.5, 2, 0.5, 2.0))]
    lim = limiting(rows)
    assert lim["ranks"] == 4 and lim["op"] == "small allreduces"


def test_cubic_grids():
    assert _cubic(1) == (1, 1, 1) and _cubic(8) == (2, 2, 2) and _cubic(32) == (4, 4, 2)
    assert math.prod(_cubic(1024)) == 1024


# -- serial: attention, ring passes, per-step agreements, the validation's report ----------------
def test_attention_work_is_queries_times_global_keys_and_scales_as_n2_over_p():
    assert work_of((2, 4, 10, 8), (2, 4, 30, 8)) == 2 * 4 * 10 * 30 * 8
    e = Event("attention", "kernels", ranks=2, work=1000, seconds=0.01)
    # Twice the tokens (cells) on 4 ranks: 4x the pairs over twice the ranks.
    where = Where((4,), (2,), (1.0, 1.0, 2.0))
    assert target_work(e, where) == pytest.approx(1000 * 4 * 2 / 4)
    assert attention_seconds(e, where, rate=0.5) == pytest.approx(0.01 * 2 * 0.5)
    assert attention_seconds(e, Where((1,), (0,))) == pytest.approx(0.02)  # N^2 on one rank
    r = predict([e], (1, 1, 8), (1, 1, 8), (4,), (2,), Compute((0.0, 0.0), (2,)),
                Machine("m", Network("n", 1e-6, 1e9)))
    assert r["attention"] == pytest.approx(0.005) and category(e) == "attention"


def test_counting_reads_the_flash_kernels_forward_and_backward():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 10, 4, requires_grad=True)
    k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    with counting() as tally:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert tally.calls == 2 and tally.work == 2 * (1 * 2 * 10 * 6 * 4)
    with counting() as tally:
        torch.randn(3, 4) @ torch.randn(4, 5)
    assert tally.calls == 0 and tally.work == 0


def test_ring_passes_scale_with_the_ring():
    kv = Event("ring", "ring_shift", ranks=2, nbytes=64, messages=2, hops=-1)
    grads = Event("ring", "ring_shift", ranks=2, nbytes=64, messages=2, hops=0)
    # Over P ranks: k/v blocks P - 1 hops a pass, gradient accumulators P.
    assert [ring_hops(kv, p) for p in (1, 2, 4, 8)] == [0, 1, 3, 7]
    assert [ring_hops(grads, p) for p in (1, 2, 4, 8)] == [0.5, 1, 2, 4]
    assert ring_hops(Event("ring", "mirror_exchange", ranks=2), 8) == 1
    net = Network("n", 1e-6, 1e9)
    kv.seconds = 1e-3
    one = event_seconds(kv, Where((2,), (1,)), net, Where((2,), (0,)), net)
    assert event_seconds(kv, Where((4,), (2,)), net, Where((2,), (0,)), net) == pytest.approx(
        3 * (2e-6 + 32 / 1e9 + 1e-3 - (2e-6 + 64 / 1e9)))
    assert one == pytest.approx(1e-3)


def test_the_per_step_agreement_costs_only_past_one_rank():
    net = Network("n", 1e-6, 1e9, 4e-6)
    step = Event("agree", "completes_within", ranks=2, seconds=1.2e-3)
    traced = Where((2,), (0,))
    assert category(step) == "small allreduces"
    assert event_seconds(step, Where((1,), (0,)), net, traced, net) == 0.0
    assert event_seconds(step, Where((8,), (4,)), net, traced, net) == pytest.approx(
        3 * 4e-6 + 1.2e-3 - 4e-6)


def test_the_compute_fit_leaves_the_attention_kernels_out():
    # Attention grows as cells^2; what is left is a + b cells + c faces exactly.
    points = [{"block": [1, 1, n, n], "seconds": 1e-3 + 1e-5 * n * n + 1e-6 * 2 * n
               + 1e-9 * n ** 4, "attention_s": 1e-9 * n ** 4} for n in (8, 16, 32, 64)]
    compute, _ = fit_compute(points, (2, 3))
    assert compute.coef == pytest.approx((1e-3, 1e-5, 1e-6))


def test_validation_reports_load_median_and_fastest():
    warning = load_warning("5.36 3.1 2.0 4/120", cores=2)
    assert warning.startswith("warning: load average 5.36 > 2 cores, 3 other threads runnable")
    assert load_warning("1.5 3.1 2.0 1/99", cores=2) is None and load_warning("n/a", 2) is None
    assert others_running("1.5 3.1 2.0 1/99") == 0 and others_running("n/a") is None
    row = {"model": "ViT", "ranks": 2, "transport": "default", "predicted_s": 0.012,
           "measured_s": 0.016, "error": -0.25, "fastest_s": 0.010, "error_fastest": 0.2,
           "load": 3.5, "others_running": 7}
    table = validation_table([row])
    assert "| ViT   | 2     | shm" in table and "12 ms" in table and "+20%" in table
    assert "| 3.5  | 7 " in table
    assert [m["name"] for m in validation_models(["FNO"])] == ["FNO"]
    with pytest.raises(ValueError, match="choose from"):
        validation_models(["GPT"])


def test_validate_cli_offers_every_validation_model():
    import argparse

    from domainpar.plan import timecli
    top = argparse.ArgumentParser().add_subparsers()
    timecli.add_parser(top)
    model = top.choices["model"]
    validate = model._subparsers._group_actions[0].choices["validate"]  # type: ignore[union-attr]
    choices = next(a.choices for a in validate._actions if a.dest == "models")
    assert list(choices) == [m["name"] for m in VALIDATION_MODELS]


def test_clock_observers_may_take_the_calls_arguments():
    from domainpar.comm import clock

    @clock.blocking
    def exchange(a, *, tag=0):
        return a + tag
    seen: list = []

    def observer(*call):
        seen.append(call)
        return contextlib.nullcontext()
    with clock.observing(observer, arguments=True), clock.observing(observer):
        assert exchange(2, tag=3) == 5
    name = exchange.__qualname__
    assert seen == [(name, (2,), {"tag": 3}), (name,)]
    exchange(1)
    assert len(seen) == 2  # outside the blocks: not observed


# -- MPI: the model's counts against the exchanges' own --------------------------------------
def assert_counts_match(events, grid):
    """Every event over more than one rank: the model's count is the exchange's."""
    grid_events = [e for e in events if e.ranks > 1]
    assert grid_events or SIZE == 1
    where = Where(tuple(grid.dims), tuple(grid.coords))
    for e in grid_events:
        assert traffic(e, where) == (e.nbytes, e.messages), e


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["even", "uneven", "zero", "periodic"])
@pytest.mark.parametrize("grid_ndim", [1, 2, 3])
def test_halo_counts_match_the_exchange(kind, grid_ndim):
    shape = (2, 9, 7, 5)
    grid, shard, sizes = layout(shape, (1, 2, 3), grid_ndim, kind, seed=grid_ndim)
    dec = dp.Decomposition(shape, grid, shard, sizes=sizes)
    for width in ({1: 1, 2: (0, 2)}, {1: (4, 3), 2: 1, 3: (2, 0)}):  # 4: past some blocks
        width = {d: w for d, w in width.items() if d in shard}
        try:
            halo = dp.HaloExchange(dec, width)
        except dp.LayoutError:
            continue  # wider than the layout allows: refused on every rank
        a = np.zeros(halo.padded_shape, np.float32)
        with record() as events:
            halo.fill(a)
            halo.accumulate(a)
        assert [e.name for e in events] == ["fill", "accumulate"]
        assert_counts_match(events, grid)


@pytest.mark.mpi
@pytest.mark.parametrize("which", ["unet", "fno"])
def test_a_training_steps_counts_match_the_ops(which):
    """Every halo exchange, allreduce, transpose and gather of one step."""
    torch.manual_seed(0)
    if which == "unet":
        model, shape, dims = UNet3d(width=2, levels=2), (1, 2, 8, 7, 6), (2, 3, 4)
    else:
        model, shape, dims = FNO2d(width=4, modes=2, layers=2), (1, 1, 12, 10), (2, 3)
    grid_ndim = min(len(dims), 2)
    grid, shard, sizes = layout(shape, dims, grid_ndim, "uneven")
    x = shard_like(torch.randn(shape), grid, shard, sizes)
    wrapped = dp.DomainParallel(model, grid)
    with record() as events:
        wrapped(x).pow(2).mean().backward()
    kinds = {e.kind for e in events if e.ranks > 1}
    if SIZE > 1:
        assert "allreduce" in kinds and ("halo" in kinds or "repartition" in kinds)
        assert "agree" in kinds  # DomainParallel's per-step agreement
    assert_counts_match(events, grid)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["even", "uneven"])
def test_ring_attention_counts_match_the_ring(kind):
    """One sdpa forward and backward on tokens sharded over SIZE ranks: the
    kernels' work is this rank's queries x all keys, and the ring shifts are
    the passes ``ring_hops`` scales (2 of the k/v blocks, 1 of their gradients)."""
    torch.manual_seed(0)
    shape = (1, 2, 13, 4)
    grid, shard, sizes = layout(shape, (2,), 1, kind)
    q, k, v = (shard_like(torch.randn(shape), grid, shard, sizes, requires_grad=True)
               for _ in range(3))
    with record() as events, counting() as tally:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    nq = q._local.shape[2]
    assert tally.work == 2 * (1 * 2 * nq * 13 * 4)   # forward and backward
    e = tally.event(SIZE)
    assert target_work(e, Where((SIZE,), (0,))) == e.work
    shifts = [e for e in events if e.kind == "ring"]
    if SIZE == 1:
        assert not shifts
        return
    assert sorted(e.hops for e in shifts) == [-1] * 2 * (SIZE - 1) + [0] * SIZE
    for p in (2, 3, 4, 8):  # what the model makes of this trace at p ranks
        assert sum(ring_hops(e, p) for e in shifts) == pytest.approx(2 * (p - 1) + p)
    assert_counts_match(events, grid)


def test_a_calls_recorded_time_beyond_the_network_is_its_software_cost():
    net = Network("n", 1e-5, 1e8)
    e = Event("repartition", "repartition", F32, (8, 8), {0: 0}, {1: 0}, seconds=0.002)
    traced = Where((2,), (0,))
    on_trace = 1e-5 + 4 * 4 * F32 / 1e8       # one peer sends a 4x4 quarter there
    here = event_seconds(e, Where((4,), (1,)), net, traced, net)
    assert here == pytest.approx(3 * 1e-5 + 12 * F32 / 1e8 + 0.002 - on_trace)
    assert event_seconds(e, Where((1,), (0,)), net, traced, net) == 0.0  # nothing sent
    # A halo fill's software cost is in the compute fit already: none added.
    halo = halo_event((1, 1, 16), {2: 0}, (0, 0, 1), (0, 0, 1))
    halo.seconds = 0.5
    assert event_seconds(halo, Where((2,), (0,)), net, traced, net) == pytest.approx(
        1e-5 + F32 / 1e8)


def test_model_predict_command_end_to_end(tmp_path):
    """`domainpar model predict` on a tiny UNet3d: a 2-rank trace, the compute
    fit, a cluster profile; the rows' layouts and which parts are nonzero (no
    timing is asserted)."""
    import json
    import subprocess
    import sys

    from domainpar.launch import mpiexec_env
    out = tmp_path / "predict.json"
    proc = subprocess.run(
        [sys.executable, "-m", "domainpar.cli", "model", "predict",
         "domainpar.testing.models:UNet3d", "--kwargs", '{"width": 2, "levels": 2}',
         "--shape", "1", "2", "8", "8", "8", "--ranks", "1", "2", "8",
         "--profile", "cpu-cluster", "--time-budget", "1", "--json", str(out)],
        env=mpiexec_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["ranks"] for r in rows] == [1, 2, 8]
    assert rows[0]["halo"] == 0 and rows[0]["gradient allreduce"] == 0
    grid = rows[2]["grid"]
    assert math.prod(grid) == 8
    assert rows[2]["block"] == [1, 2] + [-(-8 // p) for p in grid]
    assert rows[2]["halo"] > 0 and rows[2]["small allreduces"] > 0
    assert "| ranks | grid" in proc.stdout
