"""`domainpar bench step`'s launcher and report: one job per rank count
(``python -m domainpar.bench.step --worker``, which measures), the tables, the
JSON and the stacked-bar PNG. What is measured and how: ``bench.step``."""
from __future__ import annotations

import os
import platform
import tempfile
from collections.abc import Mapping
from pathlib import Path

from .step import DEFAULT_MODELS, DEFAULT_RANKS, PARTS, SHARDED_DIM


def run(ranks=DEFAULT_RANKS, models=DEFAULT_MODELS, unet_side: int = 64, field_side: int = 128,
        levels: int = 4, repeats: int = 3, out: str = "bench-out/step.json", log=print,
        compare=None, inference: bool = False) -> dict:
    """Local (launches one job per rank count and configuration, alternating A
    and B). The step breakdown per model and rank count (a training step, or
    with ``inference`` a no_grad forward) and the dispatch overhead table;
    prints them, writes JSON and PNG."""
    from ..launch import mpiexec_env
    from ..progress import Progress
    from .jobs import launch
    from .output import write_json
    from .settings import configurations, describe
    cpus = os.cpu_count() or 1
    counts = sorted(set(ranks))
    configs = {"A": None, **({"B": compare} if compare else {})}
    what = "an inference forward's" if inference else "a training step's"
    log(f"domainpar bench step: where {what} time goes ({', '.join(models)}) on "
        f"{', '.join(map(str, counts))} ranks, {repeats} instrumented steps each; "
        f"{cpus} cores here", flush=True)
    if compare:
        log(f"compared, jobs alternating: {describe(compare, mpiexec_env())}", flush=True)
    worker = ["--worker", "--models", *models, "--unet-side", str(unet_side), "--field-side",
              str(field_side), "--levels", str(levels), "--repeats", str(repeats)] \
        + (["--inference"] if inference else [])
    load = [os.getloadavg()]
    results: dict = {name: {} for name in configs}
    bar = Progress(len(counts) * len(configs), "bench step jobs")
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            for name, values in configs.items():
                extra = ["--dispatch"] if n == counts[0] else []
                results[name][n] = launch("domainpar.bench.step", n, worker + extra,
                                          Path(tmp) / "result.json", values)
                bar.update(job=f"{n} ranks ({name})")
    bar.close()
    load.append(os.getloadavg())
    report = {"benchmark": "step", "rank_counts": counts, "ranks": max(counts),
              "host": platform.node(), "cpus": cpus, "loadavg_start_end": load,
              "oversubscribed_rank_counts": [n for n in counts if n > cpus],
              "torch_threads_per_rank": 1, "repeats": repeats, "parts": list(PARTS),
              "step": "inference forward (eval, no_grad)" if inference else
                      "training step (forward, MSE loss, backward, SGD)",
              "sharded_dim": SHARDED_DIM, "unet_side": unet_side, "field_side": field_side,
              "levels": levels, "configurations": configurations(compare, mpiexec_env()),
              **_figures(results["A"], models, counts)}
    if compare:
        report["B"] = _figures(results["B"], models, counts)
        report["ratio_B_over_A"] = {
            m: {n: _mean_step(report["B"]["models"][m][n]) / _mean_step(p)
                for n, p in report["models"][m].items()} for m in models}
    _print(report, log)
    write_json(report, out, log)
    return report


def _figures(results: dict, models, counts) -> dict:
    """One configuration's figures: per model and rank count, and the dispatch table."""
    return {"models": {m: {str(n): results[n]["models"][m] for n in counts} for m in models},
            "instrumentation_costs_s": {str(n): results[n]["instrumentation_costs_s"]
                                        for n in counts},
            "dispatch_overhead": results[counts[0]]["dispatch_overhead"]}


def _mean_step(point: dict) -> float:
    """The instrumented step, mean over the ranks."""
    return sum(r["step_s"] for r in point["per_rank"]) / len(point["per_rank"])


def _print(report: dict, log) -> None:
    from .settings import parts, ratio_line
    configs = parts(report)
    for name, part in configs:
        tag = f" ({name})" if len(configs) > 1 else ""
        _print_parts(part, log, tag)
        _print_by_op(part, log, tag)
        log(f"\n{'op':<5} {'cells':>8} {'torch us':>9} {'DomainTensor us':>16} "
            f"{'overhead us':>12} {'ratio':>6}   (one-rank grid{tag})")
        for row in part["dispatch_overhead"]:
            log(f"{row['op']:<5} {row['cells']:>8} {row['torch_us']:9.1f} "
                f"{row['domaintensor_us']:16.1f} {row['overhead_us']:12.1f} "
                f"{row['ratio']:6.2f}")
    for model, ratios in report.get("ratio_B_over_A", {}).items():
        log(ratio_line(f"{model} step (per rank count)", ratios))
    log(f"{report['cpus']} cores on {report['host']}, load average "
        f"{report['loadavg_start_end'][0][0]:.1f} at the start: on a loaded machine the "
        f"waiting and compute parts grow, the figures are not final.")


def _print_parts(part: Mapping, log, tag: str) -> None:
    short = {"compute": "compute", "dispatch": "dispatch", "agreement": "agree",
             "halo": "halo", "allreduce": "allred", "other_comm": "other", "waiting": "wait",
             "instrumentation": "instr"}
    log(f"\n{'model':<7} {'ranks':>5} {'step s':>7} {'cpu s':>6} {'plain s':>7}  "
        + " ".join(f"{short[p]:>8}" for p in PARTS) + f" {'us/op':>6}"
        + f"   (s per step, mean over ranks; us/op: dispatch per DomainTensor call){tag}")
    for model, points in part["models"].items():
        for n, p in points.items():
            cpu = sum(r["step_cpu_s"] for r in p["per_rank"]) / int(n)
            log(f"{model:<7} {n:>5} {_mean_step(p):7.3f} {cpu:6.3f} {p['plain_step_s']:7.3f}  "
                + " ".join(f"{p['mean_parts_s'][k]:8.4f}" for k in PARTS)
                + f" {sum(r['dispatch_us_per_op'] for r in p['per_rank']) / int(n):6.0f}")


def _print_by_op(part: Mapping, log, tag: str, most: int = 5) -> None:
    """The DomainTensor calls with the most dispatch time, rank 0 at the most ranks."""
    for model, points in part["models"].items():
        n = max(points, key=int)
        ops = list(points[n]["per_rank"][0]["dispatch_by_op"].items())[:most]
        log(f"{model} dispatch by op, rank 0 of {n}{tag}: " + "; ".join(
            f"{name} {1e3 * row['dispatch_s']:.1f} ms ({row['calls']:g} calls)"
            for name, row in ops))


def plot(report: dict, plt):
    """Local. Stacked bars of the parts (mean over ranks), one panel per model;
    configuration B's (``--compare``) hatched beside A's."""
    from .settings import parts
    configs = parts(report)
    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models) + 1, 5), squeeze=False)
    width = 0.6 / len(configs)
    for ax, model in zip(axes[0], models):
        ranks = list(report["models"][model])
        for k, (name, part) in enumerate(configs):
            points = part["models"][model]
            xs = [x + (k - (len(configs) - 1) / 2) * width for x in range(len(ranks))]
            bottom = [0.0] * len(ranks)
            for i, what in enumerate(PARTS):
                values = [points[n]["mean_parts_s"][what] for n in ranks]
                ax.bar(xs, values, width, bottom=bottom, color=f"C{i}", edgecolor="black",
                       linewidth=0.4, hatch="//" if name == "B" else None,
                       label=what if name == "A" else None)
                bottom = [b + v for b, v in zip(bottom, values)]
            ax.plot(xs, [points[n]["plain_step_s"] for n in ranks], "k_", markersize=36 * width,
                    label="plain step (slowest rank)" if name == "A" else None)
        ax.set_xticks(range(len(ranks)))
        ax.set_xticklabels([n + ("\n(> cores)" if int(n) > report["cpus"] else "")
                            for n in ranks])
        ax.set_xlabel("ranks" + (" (B hatched, right)" if len(configs) > 1 else ""))
        ax.set_ylabel("seconds per step (mean over ranks)")
        ax.set_title(model, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    what = report.get("step", "training step (forward, MSE loss, backward, SGD)")
    fig.suptitle(f"{what[0].upper()}{what[1:]}, DomainParallel, sharded along "
                 f"dim {report['sharded_dim']}: where each rank's time goes")
    return fig
