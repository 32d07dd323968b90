"""`domainpar bench step`'s launcher and report: one job per rank count
(``python -m domainpar.bench.step --worker``, which measures), the tables, the
JSON and the stacked-bar PNG. What is measured and how: ``bench.step``."""
from __future__ import annotations

import os
import platform
import tempfile
from pathlib import Path

from .step import DEFAULT_RANKS, MODELS, PARTS, SHARDED_DIM


def run(ranks=DEFAULT_RANKS, models=MODELS, unet_side: int = 64, field_side: int = 128,
        levels: int = 4, repeats: int = 3, out: str = "bench-out/step.json", log=print) -> dict:
    """Local (launches one job per rank count). The step breakdown per model and
    rank count and the dispatch overhead table; prints them, writes JSON and PNG."""
    from ..progress import Progress
    from .jobs import launch
    from .output import write_json
    cpus = os.cpu_count() or 1
    counts = sorted(set(ranks))
    log(f"domainpar bench step: where a training step's time goes ({', '.join(models)}) on "
        f"{', '.join(map(str, counts))} ranks, {repeats} instrumented steps each; "
        f"{cpus} cores here", flush=True)
    worker = ["--worker", "--models", *models, "--unet-side", str(unet_side), "--field-side",
              str(field_side), "--levels", str(levels), "--repeats", str(repeats)]
    load, results = [os.getloadavg()], {}
    bar = Progress(len(counts), "bench step jobs")
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            extra = ["--dispatch"] if n == counts[0] else []
            results[n] = launch("domainpar.bench.step", n, worker + extra,
                                Path(tmp) / "result.json")
            bar.update(job=f"{n} ranks")
    bar.close()
    load.append(os.getloadavg())
    report = {"benchmark": "step", "rank_counts": counts, "ranks": max(counts),
              "host": platform.node(), "cpus": cpus, "loadavg_start_end": load,
              "oversubscribed_rank_counts": [n for n in counts if n > cpus],
              "torch_threads_per_rank": 1, "repeats": repeats, "parts": list(PARTS),
              "sharded_dim": SHARDED_DIM, "unet_side": unet_side, "field_side": field_side,
              "levels": levels,
              "models": {m: {str(n): results[n]["models"][m] for n in counts} for m in models},
              "instrumentation_costs_s": {str(n): results[n]["instrumentation_costs_s"]
                                          for n in counts},
              "dispatch_overhead": results[counts[0]]["dispatch_overhead"]}
    _print(report, log)
    write_json(report, out, log)
    return report


def _print(report: dict, log) -> None:
    short = {"compute": "compute", "dispatch": "dispatch", "agreement": "agree",
             "halo": "halo", "allreduce": "allred", "other_comm": "other", "waiting": "wait",
             "instrumentation": "instr"}
    log(f"\n{'model':<7} {'ranks':>5} {'step s':>7} {'cpu s':>6} {'plain s':>7}  "
        + " ".join(f"{short[p]:>8}" for p in PARTS) + f" {'us/op':>6}"
        + "   (s per step, mean over ranks; us/op: dispatch per DomainTensor call)")
    for model, points in report["models"].items():
        for n, p in points.items():
            step, cpu = (sum(r[k] for r in p["per_rank"]) / int(n) for k in ("step_s",
                                                                             "step_cpu_s"))
            log(f"{model:<7} {n:>5} {step:7.3f} {cpu:6.3f} {p['plain_step_s']:7.3f}  "
                + " ".join(f"{p['mean_parts_s'][k]:8.4f}" for k in PARTS)
                + f" {sum(r['dispatch_us_per_op'] for r in p['per_rank']) / int(n):6.0f}")
    _print_by_op(report, log)
    log(f"\n{'op':<5} {'cells':>8} {'torch us':>9} {'DomainTensor us':>16} "
        f"{'overhead us':>12} {'ratio':>6}   (one-rank grid)")
    for row in report["dispatch_overhead"]:
        log(f"{row['op']:<5} {row['cells']:>8} {row['torch_us']:9.1f} "
            f"{row['domaintensor_us']:16.1f} {row['overhead_us']:12.1f} {row['ratio']:6.2f}")
    log(f"{report['cpus']} cores on {report['host']}, load average "
        f"{report['loadavg_start_end'][0][0]:.1f} at the start: on a loaded machine the "
        f"waiting and compute parts grow, the figures are not final.")


def _print_by_op(report: dict, log, most: int = 5) -> None:
    """The DomainTensor calls with the most dispatch time, rank 0 at the most ranks."""
    for model, points in report["models"].items():
        n = max(points, key=int)
        ops = list(points[n]["per_rank"][0]["dispatch_by_op"].items())[:most]
        log(f"{model} dispatch by op, rank 0 of {n}: " + "; ".join(
            f"{name} {1e3 * row['dispatch_s']:.1f} ms ({row['calls']:g} calls)"
            for name, row in ops))

def plot(report: dict, plt):
    """Local. Stacked bars of the parts (mean over ranks), one panel per model."""
    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models) + 1, 5), squeeze=False)
    for ax, model in zip(axes[0], models):
        points = report["models"][model]
        ranks = list(points)
        bottom = [0.0] * len(ranks)
        for i, part in enumerate(PARTS):
            values = [points[n]["mean_parts_s"][part] for n in ranks]
            ax.bar(range(len(ranks)), values, 0.6, bottom=bottom, label=part, color=f"C{i}",
                   edgecolor="black", linewidth=0.4)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.plot(range(len(ranks)), [points[n]["plain_step_s"] for n in ranks], "k_",
                markersize=22, label="plain step (slowest rank)")
        ax.set_xticks(range(len(ranks)))
        ax.set_xticklabels([n + ("\n(> cores)" if int(n) > report["cpus"] else "")
                            for n in ranks])
        ax.set_xlabel("ranks")
        ax.set_ylabel("seconds per step (mean over ranks)")
        ax.set_title(model, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Training step (forward, loss, backward, SGD), DomainParallel, sharded along "
                 f"dim {report['sharded_dim']}: where each rank's time goes")
    return fig
