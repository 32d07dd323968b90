"""`domainpar bench conv`'s report side: the timing and memory jobs' results
summarised per configuration (medians, ratios to one process, the targets),
B over A when compared, and the printed summary. Local, no MPI: the launcher
(``bench/conv.py``) calls it on the results it collected."""
from __future__ import annotations

import statistics

from . import settings

TARGET_SPEEDUP = 1.9     # 3-D case
TARGET_MEMORY = 0.55     # UNet training step, per rank over one process


def _median(values):
    return statistics.median(values)


def figures(timing: dict, memory_runs: dict, nprocs: int, scale: float) -> dict:
    """One configuration's summaries: its timing job's cases, its memory jobs'
    peaks per allocator setting (none when no memory jobs ran), the targets met."""
    out = {"cases": {name: _timing_summary(t) for name, t in timing.items()},
           "memory": {alloc: {w: _memory_summary(runs, nprocs) for w, runs in by_what.items()}
                      for alloc, by_what in memory_runs.items()
                      if all(runs["1"] for runs in by_what.values())}}
    if "conv3d" in out["cases"] and scale == 1.0:
        out["meets_speedup_target"] = out["cases"]["conv3d"]["speedup"] >= TARGET_SPEEDUP
    if out["memory"]:
        out["meets_memory_target"] = {a: m["unet"]["ratio"] <= TARGET_MEMORY
                                      for a, m in out["memory"].items()}
    return out


def ratios(b: dict, a: dict) -> dict:
    """B over A: each case's step medians and speedup, each memory ratio."""
    out = {name: {"step_ranks": b["cases"][name]["median_step_s"]["ranks"]
                  / c["median_step_s"]["ranks"],
                  "step_one_process": b["cases"][name]["median_step_s"]["one_process"]
                  / c["median_step_s"]["one_process"],
                  "speedup": b["cases"][name]["speedup"] / c["speedup"]}
           for name, c in a["cases"].items()}
    if a["memory"]:
        out["memory_ratio"] = {alloc: {w: b["memory"][alloc][w]["ratio"] / m["ratio"]
                                       for w, m in by_what.items()}
                               for alloc, by_what in a["memory"].items()}
    return out


def _timing_summary(t: dict) -> dict:
    ranks, single = t["samples"]["ranks"], t["samples"]["one_process"]
    wall = _median([s["wall"] for s in ranks])
    wall1 = _median([s["wall"] for s in single])
    cpu, cpu1 = _median([s["cpu"] for s in ranks]), _median([s["cpu"] for s in single])
    # Exposed: the most any rank spent in exchanges (its waits for neighbours
    # included); cost: per exchange, the least any rank spent (see _time_ranks).
    exchange = _median([max(s["halo_exchange"]) for s in ranks])
    exchange_min = _median([s["halo_exchange_cost"] for s in ranks])
    probe = t["split_probe"]["median_s"]
    return {
        "shape": t["shape"], "local_shape": t["local_shape"],
        "median_step_s": {"ranks": wall, "one_process": wall1},
        "speedup": wall1 / wall,
        "median_cpu_s": {"ranks": cpu, "one_process": cpu1}, "cpu_speedup": cpu1 / cpu,
        "halo_exposed_s": {"exchange": exchange, "exchange_cost": exchange_min},
        "halo_exposed_fraction": {"exchange": exchange / wall,
                                  "exchange_cost": exchange_min / wall},
        "halo_exchanges_per_step": max(ranks[-1]["halo_exchanges"]),
        "split_probe": {**probe,
                        "forward_overhead_s": probe["split_forward"] - probe["whole_forward"],
                        "step_overhead_s": probe["split_step"] - probe["whole_step"],
                        # overlap hides the exchange's own cost, not a wait for a
                        # late neighbour (that rank's delay ends the step anyway)
                        "exchange_it_could_hide_s": exchange_min},
        "profile": t["profile"], "samples": t["samples"],
        "split_probe_samples_s": t["split_probe"]["samples_s"],
    }


def _memory_summary(runs: dict, nprocs: int) -> dict:
    one = [r["per_rank"][0]["peak_above_baseline_kib"] for r in runs["1"]]
    per_rank = [max(p["peak_above_baseline_kib"] for p in r["per_rank"])
                for r in runs[str(nprocs)]]
    m1, mn = _median(one), _median(per_rank)
    live1 = _median([r["per_rank"][0]["live_tensor_peak_kib"] for r in runs["1"]])
    liven = _median([max(p["live_tensor_peak_kib"] for p in r["per_rank"])
                     for r in runs[str(nprocs)]])
    return {"shape": runs["1"][0]["shape"],
            "peak_above_baseline_mib": {"one_process": m1 / 1024, "per_rank": mn / 1024},
            "ratio": mn / m1 if m1 else float("nan"),
            "baseline_mib": {"one_process": _median([r["per_rank"][0]["baseline_kib"]
                                                     for r in runs["1"]]) / 1024,
                             "per_rank": _median([max(p["baseline_kib"] for p in r["per_rank"])
                                                  for r in runs[str(nprocs)]]) / 1024},
            "live_tensor_peak_mib": {"one_process": live1 / 1024, "per_rank": liven / 1024},
            "live_tensor_ratio": liven / live1 if live1 else float("nan"),
            "method": runs["1"][0]["per_rank"][0]["method"], "runs": runs}


def print_report(report: dict, log) -> None:
    """Local. The summary tables of ``report`` through ``log`` (print-like)."""
    n = report["ranks"]
    parts = settings.parts(report)
    tag = (lambda name: f"{name} ") if len(parts) > 1 else (lambda name: "")
    log(f"\n{'case':<10} {'1 proc s':>9} {f'{n} ranks s':>10} {'speedup':>8} {'cpu speedup':>11} "
        f"{'halo exposed ms':>20} {'split overhead ms':>19}")
    log(f"{'':<52} {'(cost-exposed)':>20} {'(forward/step)':>19}")
    for case in report["cases"]:
        for name, part in parts:
            c = part["cases"][case]
            m, h, p = c["median_step_s"], c["halo_exposed_s"], c["split_probe"]
            log(f"{tag(name) + case:<10} {m['one_process']:9.3f} {m['ranks']:10.3f} "
                f"{c['speedup']:8.2f} {c['cpu_speedup']:11.2f} {h['exchange_cost'] * 1e3:10.2f}-"
                f"{h['exchange'] * 1e3:.2f} ms "
                f"{p['forward_overhead_s'] * 1e3:+10.1f}/{p['step_overhead_s'] * 1e3:+.1f}")
            kinds = c["profile"]["ranks"]["self_ms_by_kind"]
            log("           profile, rank 0 of the N-rank step (self ms): "
                + ", ".join(f"{k} {v:.0f}" for k, v in kinds.items()))
            kinds = c["profile"]["one_process"]["self_ms_by_kind"]
            log("           profile, one process (self ms):              "
                + ", ".join(f"{k} {v:.0f}" for k, v in kinds.items()))
    if report["memory"]:
        log(f"\n{'peak above import baseline':<40} {'1 proc MiB':>10} {'per rank MiB':>12} "
            f"{'ratio':>6}")
        for alloc, by_what in report["memory"].items():
            for what in by_what:
                for name, part in parts:
                    m = part["memory"][alloc][what]
                    v = m["peak_above_baseline_mib"]
                    log(f"{tag(name) + what + ', ' + alloc:<40} {v['one_process']:10.1f} "
                        f"{v['per_rank']:12.1f} {m['ratio']:6.3f}")
        for what in next(iter(report["memory"].values())):
            for name, part in parts:
                m = next(iter(part["memory"].values()))[what]
                v = m["live_tensor_peak_mib"]
                log(f"{tag(name) + what + ', live tensors (profiler)':<40} "
                    f"{v['one_process']:10.1f} {v['per_rank']:12.1f} "
                    f"{m['live_tensor_ratio']:6.3f}")
    if "ratio_B_over_A" in report:
        log(settings.ratio_line(f"step on {n} ranks", {
            case: r["step_ranks"] for case, r in report["ratio_B_over_A"].items()
            if case != "memory_ratio"}))
    targets = []
    for name, part in parts:
        if "meets_speedup_target" in part:
            targets.append(f"{tag(name)}conv3d speedup >= {TARGET_SPEEDUP}: "
                           f"{'met' if part['meets_speedup_target'] else 'MISSED'}")
        if "meets_memory_target" in part:
            targets.append(f"{tag(name)}UNet memory ratio <= {TARGET_MEMORY}: " + ", ".join(
                f"{'met' if ok else 'MISSED'} ({a})"
                for a, ok in part["meets_memory_target"].items()))
    if not report["memory"]:
        targets.append("memory not measured (--memory-repeats 0)")
    log(f"targets: {'; '.join(targets) or 'not applicable at this scale'}. Load average "
        f"{report['loadavg_start_end'][0][0]:.1f} at the start, {report['cpus']} CPUs.")


