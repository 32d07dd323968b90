"""PNG plots of the benchmarks' reports, one figure per report (matplotlib, Agg).

Each benchmark's plot shows what its report says most: halo, time against face
size per path (log-log); conv, speedup and memory ratio; grads, the step per
variant with every sample; attention, speedup and memory ratio against
tokens; io, throughput per path; scaling, step time and efficiency against
ranks. Configuration B (``--compare``) is drawn beside A: hatched bars, or
dashed lines in the same colour. The caption names the machine, the ranks and
both configurations.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .settings import parts

_warned = [False]  # "matplotlib is missing" is said once per process


def write_png(report: dict, path: Path, log: Callable = print) -> Path | None:
    """Local (rank 0 calls it). The report's plot at ``path``; None (and a note,
    once) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        if not _warned[0]:
            log("matplotlib is not installed: JSON only, no PNG (pip install matplotlib)")
            _warned[0] = True
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = _PLOTS[report["benchmark"]](report, plt)
    fig.text(0.5, 0.005, _caption(report), ha="center", va="bottom", fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"PNG: {path}")
    return path


# -- shared pieces ------------------------------------------------------------------------------
# Any: matplotlib's keyword arguments differ in type; these are spread into them.
A_STYLE: dict[str, Any] = {"linestyle": "-", "marker": "o"}
B_STYLE: dict[str, Any] = {"linestyle": "--", "marker": "s", "markerfacecolor": "none"}


def _compared(report: dict) -> bool:
    return "B" in report.get("configurations", {})


def _tag(report: dict, name: str) -> str:
    """A legend suffix naming the configuration, when there are two."""
    return f" ({name})" if _compared(report) else ""


def _settings_text(values: dict) -> str:
    return ", ".join(f"{k}={v if v else '(unset)'}" for k, v in values.items())


def _caption(report: dict) -> str:
    ranks = report.get("rank_counts") or report.get("ranks")
    ranks = (f"{ranks} ranks" if isinstance(ranks, int)
             else f"{', '.join(map(str, ranks or ['?']))} ranks")
    cpus = report.get("cpus") or os.cpu_count()
    text = (f"domainpar bench {report['benchmark']} on {report.get('host', '?')} "
            f"({cpus} CPUs), {ranks}")
    if report.get("loadavg_start_end"):  # other load on a shared machine moves the figures
        text += f", load average {report['loadavg_start_end'][0][0]:.1f} at the start"
    conf = report.get("configurations", {})
    if "B" in conf:
        text += (f". A (solid/plain): {_settings_text(conf['A'])}; "
                 f"B (dashed/hatched): {_settings_text(conf['B'])}")
    return text


def _bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str,
          errors: dict[str, list] | None = None) -> list:
    """Grouped bars: one group per name in ``groups``, one bar per series
    (B's series, named "... (B)", hatched). Returns the bar x centres per series."""
    n = len(series)
    width = 0.8 / max(n, 1)
    centres = []
    bases: list[str] = []  # a measure keeps its colour in both configurations
    for i, (label, values) in enumerate(series.items()):
        base = label.removesuffix(" (A)").removesuffix(" (B)")
        if base not in bases:
            bases.append(base)
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        hatch = "//" if label.endswith("(B)") else None
        ax.bar(xs, [v if v is not None else 0 for v in values], width, label=label,
               color=f"C{bases.index(base)}", hatch=hatch, edgecolor="black", linewidth=0.5,
               alpha=0.85)
        centres.append(xs)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    return centres


def _plain_log(ax, axes: str = "xy") -> None:
    """Log scale with ticks written as plain numbers (0.25, 4, 64), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    for name in axes:
        axis = getattr(ax, f"{name}axis")
        getattr(ax, f"set_{name}scale")("log")
        # 1-2-5 ticks: a range within one decade still gets labels
        axis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


# -- one plot per benchmark ---------------------------------------------------------------------
_HALO_PATHS = ("sendrecv", "fill", "fill_unchecked", "subarray", "fill_pack", "fill_numpy",
               "fill_datatype")


def _halo(report: dict, plt):
    groups: dict[tuple, list] = {}
    for case in report["cases"]:
        groups.setdefault((case["ndim"], case["axis"]), []).append(case)
    n = len(groups)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows + 0.6), squeeze=False)
    colours = dict(zip(_HALO_PATHS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, ((ndim, axis), cases) in zip(axes.flat, sorted(groups.items())):
        cases.sort(key=lambda c: c["face_bytes"])
        mib = [c["face_bytes"] / 2**20 for c in cases]
        for path in _HALO_PATHS:
            for name, style in (("A", A_STYLE), ("B", B_STYLE)):
                part = [c if name == "A" else c.get("B", {}) for c in cases]
                if not all(path in p.get("median_s", {}) for p in part):
                    continue
                ax.plot(mib, [p["median_s"][path] * 1e3 for p in part], color=colours[path],
                        label=path if name == "A" else None, **style)
        _plain_log(ax)
        kind = "strided" if cases[0]["strided"] else "contiguous"
        ax.set_title(f"{ndim}-D field, sharded axis {axis} ({kind} faces)", fontsize=10)
        ax.set_xlabel("face size (MiB)")
        ax.set_ylabel("median time per exchange (ms)")
        ax.grid(which="both", alpha=0.3)
    # one legend for all panels: colours are paths, line styles configurations
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=colours[p], marker="o", label=p) for p in _HALO_PATHS]
    if _compared(report):
        handles += [Line2D([], [], color="black", label="A", **A_STYLE),
                    Line2D([], [], color="black", label="B", **B_STYLE)]
    spare = list(axes.flat)[n:]
    for ax in spare:
        ax.axis("off")
    if spare:
        spare[0].legend(handles=handles, loc="center", fontsize=9, title="path")
    else:
        fig.legend(handles=handles, loc="upper right", fontsize=8)
    fig.suptitle(f"Halo fill vs raw mpi4py Sendrecv, float32, width "
                 f"{report['cases'][0]['width']}, {report['ranks']} ranks"
                 + (" (dashed: B)" if _compared(report) else ""))
    return fig


def _conv(report: dict, plt):
    memory = report.get("memory") or {}
    fig, axes = plt.subplots(1, 2 if memory else 1, figsize=(14 if memory else 6.5, 5.2),
                             squeeze=False,
                             gridspec_kw={"width_ratios": [2, 3]} if memory else None)
    ax = axes[0][0]
    cases = list(report["cases"])
    series = {f"{measure}{_tag(report, name)}": [part["cases"][c][key] for c in cases]
              for measure, key in (("wall", "speedup"), ("CPU", "cpu_speedup"))
              for name, part in parts(report)}
    _bars(ax, cases, series, f"speedup ({report['ranks']} ranks over one process)")
    ax.axhline(report["ranks"], color="grey", linestyle=":", label=f"ideal ({report['ranks']})")
    if "conv3d" in cases:  # the target is the 3-D case's
        at = cases.index("conv3d")
        ax.hlines(report["targets"]["speedup_conv3d"], at - 0.45, at + 0.45, color="red",
                  linestyle="--", linewidth=0.8, label="conv3d target")
    ax.set_title("Conv forward+backward step: speedup")
    ax.legend(fontsize=8)
    if memory:
        ax = axes[0][1]
        short = {"default_malloc": "default malloc", "fixed_mmap_threshold": "fixed mmap"}
        keys = [(alloc, what) for alloc, by_what in memory.items() for what in by_what]
        labels = [f"{what}\n{short.get(alloc, alloc)}" for alloc, what in keys]
        series = {f"{measure}{_tag(report, name)}": [part["memory"][a][w][key] for a, w in keys]
                  for measure, key in (("peak RSS", "ratio"), ("live tensors", "live_tensor_ratio"))
                  for name, part in parts(report)}
        _bars(ax, labels, series, "per-rank peak / one process's")
        ax.axhline(1 / report["ranks"], color="grey", linestyle=":",
                   label=f"ideal (1/{report['ranks']})")
        unet = [i for i, (_, what) in enumerate(keys) if what == "unet"]
        for i in unet:  # the target is the UNet step's
            ax.hlines(report["targets"]["unet_memory_ratio"], i - 0.45, i + 0.45, color="red",
                      linestyle="--", linewidth=0.8, label="UNet target" if i == unet[0] else None)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylim(0, max(1.05, ax.get_ylim()[1] * 1.3))  # room for the legend above the bars
        ax.set_title("Peak memory above the import baseline, per rank / one process")
        ax.legend(fontsize=7, ncol=3, loc="upper center")
    fig.suptitle(f"Convolutions on {report['ranks']} ranks against one process "
                 f"(scale {report['scale']})")
    return fig


def _grads(report: dict, plt):
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    variants = list(report["median_step_s"])
    series = {f"median{_tag(report, name)}":
              [part["median_step_s"][v] * 1e3 for v in variants]
              for name, part in parts(report)}
    centres = _bars(ax, [v.replace("_", " ") for v in variants], series, "step time (ms)")
    for xs, (name, part) in zip(centres, parts(report)):
        for x, v in zip(xs, variants):
            samples = [s * 1e3 for s in part["samples_s"][v]]
            ax.scatter([x] * len(samples), samples, s=12, color="black", zorder=3,
                       label="samples" if (name, v) == ("A", variants[0]) else None)
    ax.set_title(f"Training step: {report['layers']} x Linear({report['width']}, "
                 f"{report['width']}), {report['parameters']:,} parameters, "
                 f"{report['ranks']} ranks", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def _attention(report: dict, plt):
    from matplotlib.ticker import NullLocator
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    ordered = sorted(report["cases"].values(), key=lambda c: c["tokens"])
    tokens = [c["tokens"] for c in ordered]
    for name in ("A", "B") if _compared(report) else ("A",):
        style = A_STYLE if name == "A" else B_STYLE
        tag = _tag(report, name)
        cases = ordered if name == "A" else [c["B"] for c in ordered]
        left.plot(tokens, [c["speedup"] for c in cases], color="C0", label=f"wall{tag}", **style)
        left.plot(tokens, [c["cpu_speedup"] for c in cases], color="C1", label=f"CPU{tag}",
                  **style)
        right.plot(tokens, [c["memory_ratio"] for c in cases], color="C2",
                   label=f"live tensors{tag}", **style)
    n = report["ranks"]
    left.axhline(n, color="grey", linestyle=":", label=f"ideal ({n})")
    right.axhline(1 / n, color="grey", linestyle=":", label=f"ideal (1/{n})")
    for ax, title, ylabel in ((left, "Speedup over one process", f"speedup ({n} ranks)"),
                              (right, "Memory: peak per rank / one process", "ratio")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(tokens, [f"{t:,}" for t in tokens])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(0, max(ax.get_ylim()[1], 1.05))
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Ring attention (SDPA forward+backward), {report['heads']} head(s) x "
                 f"{report['head_dim']}, {'causal' if report['causal'] else 'not causal'}, "
                 f"{n} ranks")
    return fig


def _io(report: dict, plt):
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8),
                                      gridspec_kw={"width_ratios": [3, 1]})
    paths = list(report["aggregate_read_mib_per_s"])
    series = {f"throughput{_tag(report, name)}": [part["aggregate_read_mib_per_s"].get(p)
                                                  for p in paths]
              for name, part in parts(report)}
    _bars(left, [p.replace("_", "\n") for p in paths], series, "aggregate read (MiB/s)")
    left.set_title("Epoch read throughput per path")
    left.tick_params(axis="x", labelsize=8)
    left.legend(fontsize=8)
    steps = ["compute_no_prefetch", "compute_prefetch"]
    series = {f"epoch{_tag(report, name)}":
              [part["median_epoch_s"][s] * 1e3 for s in steps] for name, part in parts(report)}
    _bars(right, ["no prefetch", "prefetch"], series, "epoch with stand-in steps (ms)")
    right.set_xlabel("driver: " + ", ".join(f"{name} {part['compute_epochs_driver']}"
                                            for name, part in parts(report)
                                            if "compute_epochs_driver" in part))
    right.set_title(f"Prefetch ({report['compute_stand_in_ms']:.1f} ms step/sample)",
                    fontsize=10)
    right.legend(fontsize=8)
    shape = "x".join(map(str, report["sample_shape"]))
    fig.suptitle(f"HDF5 reads: {report['samples']} samples of {shape} float32, "
                 f"{report['ranks']} ranks (page cache, not disk)")
    return fig


def _scaling(report: dict, plt):
    modes = [m for m in ("strong", "weak") if m in report]  # --modes may run one
    fig, axes = plt.subplots(2, len(modes), figsize=(5.5 * len(modes) + 0.5, 8.5),
                             squeeze=False)
    cpus = report.get("cpus") or os.cpu_count()
    for col, mode in enumerate(modes):
        top, bottom = axes[0][col], axes[1][col]
        for name, part in parts(report):
            if mode not in part:
                continue
            style = A_STYLE if name == "A" else B_STYLE
            tag = _tag(report, name)
            points = sorted(part[mode]["points"].values(), key=lambda p: p["ranks"])
            ranks = [p["ranks"] for p in points]
            top.plot(ranks, [p["median_step_s"] for p in points], color="C0",
                     label=f"median step{tag}", **style)
            lo = [min(p["samples_s"]) for p in points]
            hi = [max(p["samples_s"]) for p in points]
            top.fill_between(ranks, lo, hi, color="C0", alpha=0.12 if name == "A" else 0.06)
            bottom.plot(ranks, [p["efficiency"] for p in points], color="C1",
                        label=f"efficiency{tag}", **style)
            if name == "A" and points:
                t1 = points[0]["median_step_s"] * points[0]["ranks"]
                ideal = [t1 / r if mode == "strong" else points[0]["median_step_s"]
                         for r in ranks]
                top.plot(ranks, ideal, color="grey", linestyle=":",
                         label="ideal" + (" (from A's T1)" if _compared(report) else ""))
        bottom.axhline(1.0, color="grey", linestyle=":", label="ideal")
        what = report[mode]
        shape = "x".join(map(str, what["global_shape" if mode == "strong" else "block_shape"]))
        top.set_title(f"{mode} scaling: " + (f"global {shape}" if mode == "strong"
                                             else f"{shape} per rank"), fontsize=10)
        top.set_ylabel(("inference forward" if report.get("mode") == "inference"
                        else "training step") + " (s)")
        bottom.set_ylabel("efficiency " + ("T1 / (n Tn)" if mode == "strong" else "T1 / Tn"))
        top.set_ylim(bottom=0)
        bottom.set_ylim(0, max(1.15, bottom.get_ylim()[1]))
        for ax in (top, bottom):
            ax.set_xlabel("ranks n")
            ax.set_xticks(report["rank_counts"])
            ax.grid(alpha=0.3)
            if cpus and max(report["rank_counts"]) > cpus:  # unknown count: no shading
                ax.axvspan(cpus + 0.5, max(report["rank_counts"]) + 0.5, color="red",
                           alpha=0.07, label=f"> {cpus} cores: oversubscribed")
            ax.legend(fontsize=8)
    fig.suptitle(f"{report.get('model_config', 'UNet3d')}, {report.get('mode', 'training')}: "
                 f"{report.get('step', 'forward, loss, backward, optimizer')}\n"
                 f"DomainParallel, sharded along dim {report['sharded_dim']}; {cpus} CPU cores")
    return fig


def _balance(report: dict, plt):
    from .balance import plot  # its module draws it (torch is loaded by then)
    return plot(report, plt)


def _points(report: dict, plt):
    from .points import plot  # its module draws it (torch is loaded by then)
    return plot(report, plt)


def _step(report: dict, plt):
    from .stepreport import plot  # its module draws it: stacked parts per model and rank count
    return plot(report, plt)


def _swap(report: dict, plt):
    from .swap import plot  # its module draws it: both configurations' samples
    return plot(report, plt)


_PLOTS = {"halo": _halo, "conv": _conv, "grads": _grads, "attention": _attention, "io": _io,
          "scaling": _scaling, "balance": _balance, "points": _points,
          "step": _step, "swap": _swap}
