"""`domainpar model validate` and `domainpar model project`: the time model's
validation table here (predicted against measured steps at 1 to 4 ranks over
shared memory and TCP) and its scaling projections to 1,024 ranks, as tables,
JSON and a PNG."""
from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

from ..progress import Progress
from .timemodel import CATEGORIES, PROFILES, best_grid, limiting, predict
from .timerun import fit_compute, job, machine_here, measure_compute, measured_network, spec, traced

# The validation's models: small enough for 4 ranks on 2 cores in a few minutes.
VALIDATION_MODELS = (
    spec("UNet3d", "domainpar.testing.models:UNet3d", {"width": 4, "levels": 3},
         (1, 2, 32, 32, 32), (2, 3, 4)),
    spec("ViT", "domainpar.testing.models:ViT2d",
         {"size": [64, 64], "patch": 4, "dim": 32, "depth": 2}, (1, 1, 64, 64), (2,), "size"),
    spec("FNO", "domainpar.testing.models:FNO2d", {"width": 8, "modes": 8, "layers": 4},
         (1, 1, 64, 64), (2, 3)),
)
# The projection's UNet3d: traced at 32^3, predicted at 256^3 to 1024^3.
PROJECTION_MODEL = spec("UNet3d", "domainpar.testing.models:UNet3d",
                        {"width": 8, "levels": 4}, (1, 2, 32, 32, 32), (2, 3, 4))
SIDES = (256, 512, 1024)
WEAK_BLOCK = 128
MAX_RANKS = 1024


def loadavg() -> str:
    """Local. The 1, 5 and 15 minute load averages and the runnable / all
    threads now (Linux ``/proc/loadavg``), or "n/a"."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:4])
    except OSError:
        return "n/a"


def others_running(avg: str) -> int | None:
    """Local. How many other threads were runnable when ``avg`` was read (less
    the reader itself): between launches this process is our only one, so,
    unlike the load average, it holds none of our earlier launches' ranks."""
    try:
        return max(0, int(avg.split()[3].split("/")[0]) - 1)
    except (ValueError, IndexError):
        return None


def one_minute_load(avg: str) -> float | None:
    """Local. The 1-minute load of a ``loadavg()`` string (None for "n/a")."""
    try:
        return float(avg.split()[0])
    except (ValueError, IndexError):
        return None


def load_warning(avg: str, cores: int | None = None) -> str | None:
    """Local. A warning line when the 1-minute load of ``avg`` exceeds the cores
    (the measured steps then wait on other processes), else None."""
    cores = cores or os.cpu_count() or 1
    load = one_minute_load(avg)
    if load is None or load <= cores:
        return None
    running = others_running(avg)
    now = "" if running is None else f", {running} other threads runnable at the start"
    return (f"warning: load average {load:g} > {cores} cores{now}: other processes held the "
            "cores around this launch (the average includes our previous launches' ranks); "
            "its timings are disturbed")


def validation_models(names=None) -> list[dict]:
    """Local. The validation's models, or those of ``names`` (a ValueError names
    the choices for an unknown one)."""
    known = {m["name"]: m for m in VALIDATION_MODELS}
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise ValueError(f"unknown validation models {unknown}; choose from {sorted(known)}")
    return [known[n] for n in names] if names else list(VALIDATION_MODELS)


def validate(ranks=(1, 2, 3, 4), transports=("default", "tcp"), rounds: int = 2,
             repeats: int = 5, out: str = "bench-out/model-validation.json",
             names=None) -> dict:
    """Local (starts MPI jobs). Predicted against measured step times (median
    and fastest sample), with the machine's load at every launch."""
    models = validation_models(names)
    print("tracing one step of each model on 2 ranks ...", flush=True)
    events = traced(models)
    networks = {t: measured_network(t) for t in transports}
    samples: dict[tuple[str, int, str], list[float]] = {
        (m["name"], p, t): [] for m in models for p in ranks for t in transports}
    points: dict[str, list] = {m["name"]: [] for m in models}
    loads: list[str] = []
    launch_loads: dict[tuple[int, str], list[str]] = {}
    bar = Progress(rounds * (len(ranks) * len(transports) + 1), "measured runs", every_s=10)
    for _ in range(rounds):  # interleaved: every configuration once per round
        for m in models:  # compute on scaled-down blocks, in this process
            blocks = [p["block"] for p in points[m["name"]][:4]] or None
            points[m["name"]] += measure_compute(m, blocks=blocks)[1]
        bar.update()
        for p in ranks:
            for t in transports:
                loads.append(loadavg())
                launch_loads.setdefault((p, t), []).append(loads[-1])
                warning = load_warning(loads[-1])
                if warning:
                    print(f"{p} rank(s), {t}: {warning}", flush=True)
                result = job("steps", p, t, models, repeats)
                for name, times in result.items():
                    samples[(name, p, t)] += times
                bar.update()
    bar.close()
    computes = {name: fit_compute(pts, m["dims"]) for m in models
                for name, pts in [(m["name"], points[m["name"]])]}
    rows = []
    for m in models:
        for p in ranks:
            for t in transports:
                grid = [p] + [1] * (len(m["dims"]) - 1)
                traced_on = ([2] + [1] * (len(m["dims"]) - 1), networks[transports[0]])
                pred = predict(events[m["name"]], m["shape"], m["shape"], grid, m["dims"],
                               computes[m["name"]][0], machine_here(networks[t]), traced_on)
                times = samples[(m["name"], p, t)]
                meas, fastest = statistics.median(times), min(times)
                peak = max((one_minute_load(a) or 0.0 for a in launch_loads[(p, t)]),
                           default=0.0)
                running = max((others_running(a) or 0 for a in launch_loads[(p, t)]), default=0)
                rows.append({"model": m["name"], "ranks": p, "transport": t,
                             "predicted_s": pred["step"], "measured_s": meas,
                             "error": pred["step"] / meas - 1, "fastest_s": fastest,
                             "error_fastest": pred["step"] / fastest - 1, "load": peak,
                             "others_running": running,
                             "breakdown": pred, "samples": times})
    result = {"models": models, "networks": {t: n.as_dict() for t, n in networks.items()},
              "compute": {k: {"coef": list(c.coef), "points": pts}
                          for k, (c, pts) in computes.items()},
              "loadavg": loads, "rows": rows}
    print(validation_table(rows))
    cores = os.cpu_count() or 1
    loaded = sum(1 for a in loads if (one_minute_load(a) or 0.0) > cores)
    if loaded:
        print(f"warning: {loaded} of {len(loads)} launches ran with a load average above "
              f"the {cores} cores (column 'load'; it includes our own earlier launches' ranks, "
              "'others running' does not): the measured times include waiting for other "
              "processes, which the model does not predict")
    _write(out, result)
    return result


def validation_table(rows) -> str:
    """Local. Predicted against measured step times (the median and the fastest
    sample), the highest 1-minute load of the launches and the most other
    threads runnable as one started, as a Markdown table."""
    head = ("model", "ranks", "transport", "predicted", "measured (median)", "error",
            "fastest sample", "error vs fastest", "load", "others running")
    body = [(r["model"], str(r["ranks"]), "shm" if r["transport"] == "default" else r["transport"],
             _ms(r["predicted_s"]), _ms(r["measured_s"]), f"{100 * r['error']:+.0f}%",
             _ms(r["fastest_s"]), f"{100 * r['error_fastest']:+.0f}%", f"{r['load']:.1f}",
             str(r.get("others_running", "")))
            for r in rows]
    return _markdown(head, body)


def project(profiles=("cpu-cluster", "gpu-cluster"), out: str = "bench-out/model-projection.json",
            budget_s: float = 120.0) -> dict:
    """Local (starts one MPI job). Strong and weak scaling of a UNet3d."""
    m = PROJECTION_MODEL
    print("tracing one step of the UNet3d on 2 ranks ...", flush=True)
    events = traced([m])[m["name"]]
    traced_on = ([2, 1, 1], measured_network("default"))
    print("measuring its compute on scaled-down blocks (one process) ...", flush=True)
    compute, points = measure_compute(m, points=5, budget_s=budget_s)
    counts = [2 ** k for k in range(int(math.log2(MAX_RANKS)) + 1)]
    result: dict[str, Any] = {"model": m, "compute_fit": list(compute.coef), "compute_points": points,
              "profiles": {}, "strong": {}, "weak": {}, "limits": {}}
    for name in profiles:
        machine = PROFILES[name]
        result["profiles"][name] = machine.as_dict()
        for side in SIDES:
            shape = (1, 2, side, side, side)
            rows = [best_grid(events, m["shape"], shape, m["dims"], p, compute, machine,
                              traced_on) for p in counts]
            key = f"{name} {side}^3"
            result["strong"][key] = rows
            result["limits"][key] = limiting(rows)
        rows = []
        for p in counts:
            dims = _cubic(p)
            weak_shape = (1, 2) + tuple(WEAK_BLOCK * d for d in dims)
            rows.append(predict(events, m["shape"], weak_shape, dims, m["dims"], compute, machine,
                                traced_on))
        result["weak"][name] = rows
    print(projection_text(result))
    _write(out, result)
    _plot(result, Path(out).with_suffix(".png"))
    return result


def _cubic(p: int) -> tuple[int, int, int]:
    """The most cubic split of ``p`` (a power of two) over three axes."""
    dims = [1, 1, 1]
    while math.prod(dims) < p:
        dims[dims.index(min(dims))] *= 2
    big, mid, small = sorted(dims, reverse=True)
    return big, mid, small


def breakdown_table(rows) -> str:
    """Local. Each grid's predicted step time by category, as a Markdown table."""
    head = ("ranks", "grid", "step") + CATEGORIES
    body = [(str(r["ranks"]), "x".join(map(str, r["grid"])), _ms(r["step"]),
             *(_ms(r[k]) for k in CATEGORIES)) for r in rows]
    return _markdown(head, body)


def projection_text(result) -> str:
    """Local. The strong- and weak-scaling projections as text with tables."""
    lines = []
    for key, rows in result["strong"].items():
        base = rows[0]["step"]
        lines.append(f"\nstrong scaling, {key} (efficiency = T1 / (P x TP)):")
        head: tuple[str, ...] = ("ranks", "grid", "step", "speed-up", "efficiency", "compute",
                                 "halo", "allreduces")
        body: list[tuple[str, ...]] = [(str(r["ranks"]), "x".join(map(str, r["grid"])), _ms(r["step"]),
                 f"{base / r['step']:.1f}", f"{100 * base / (r['step'] * r['ranks']):.0f}%",
                 _ms(r["compute"]), _ms(r["halo"]),
                 _ms(r["gradient allreduce"] + r["small allreduces"])) for r in rows]
        lines.append(_markdown(head, body))
        lim = result["limits"][key]
        lines.append(f"stops scaling (efficiency < 50%) at {lim['ranks']} ranks: {lim['op']}"
                     if lim["ranks"] else "efficiency stays above 50% to 1,024 ranks")
    for name, rows in result["weak"].items():
        base = rows[0]["step"]
        lines.append(f"\nweak scaling, {name}, {WEAK_BLOCK}^3 cells per rank "
                     "(efficiency = T1 / TP):")
        head = ("ranks", "field", "step", "efficiency", "compute", "halo", "allreduces")
        body = [(str(r["ranks"]), "x".join(str(WEAK_BLOCK * d) for d in r["grid"]),
                 _ms(r["step"]), f"{100 * base / r['step']:.0f}%", _ms(r["compute"]),
                 _ms(r["halo"]), _ms(r["gradient allreduce"] + r["small allreduces"]))
                for r in rows]
        lines.append(_markdown(head, body))
    return "\n".join(lines)


def _plot(result, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install matplotlib)")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, rows in result["strong"].items():
        ax1.loglog([r["ranks"] for r in rows], [r["step"] for r in rows], "o-", ms=3, label=key)
    ax1.set(xlabel="ranks", ylabel="predicted step (s)", title="strong scaling, UNet3d")
    for name, rows in result["weak"].items():
        ax2.semilogx([r["ranks"] for r in rows], [rows[0]["step"] / r["step"] for r in rows],
                     "o-", ms=3, label=name)
    ax2.set(xlabel="ranks", ylabel="efficiency T1 / TP", ylim=(0, 1.05),
            title=f"weak scaling, {WEAK_BLOCK}^3 per rank")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _markdown(head, body) -> str:
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in body]
    return "\n".join(lines)


def _write(out: str, result: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1, default=list))
    print(f"wrote {out}")
