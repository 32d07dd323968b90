"""The demo's pictures (matplotlib, Agg; rank 0 draws them): a plane of a
held-out sample (input, prediction, truth, error; u and v) and the loss curve."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt
    return plt


def _moving_average(values, window: int) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    window = max(1, min(window, len(v)))
    kernel = np.ones(window) / window
    # The first window - 1 points average what there is so far.
    head = np.cumsum(v[:window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(v, kernel, mode="valid")])


def sample_png(path, planes: dict, *, seams, title: str, plane_label: str) -> Path:
    """Local. ``planes``: ``input``, ``prediction``, ``truth``, each (2, D, W) for
    (u, v). One row per field: input, prediction, truth on one colour scale,
    then the model's error (prediction - truth) beside the error of predicting
    no change (input - truth), both on one symmetric scale. ``seams``: the D
    indices where a rank's block starts (drawn dashed), to show that the cuts
    leave no mark."""
    plt = _pyplot()
    err = planes["prediction"] - planes["truth"]
    still = planes["input"] - planes["truth"]
    fig, axes = plt.subplots(2, 5, figsize=(19, 7.4), constrained_layout=True)
    for row, field in enumerate(("u", "v")):
        stack = np.stack([planes[k][row] for k in ("input", "prediction", "truth")])
        lo, hi = float(stack.min()), float(stack.max())
        emax = max(float(np.abs(err[row]).max()), float(np.abs(still[row]).max()), 1e-12)
        panels = [("input (t)", planes["input"][row], "viridis", lo, hi),
                  ("prediction (t + Δt)", planes["prediction"][row], "viridis", lo, hi),
                  ("truth (t + Δt)", planes["truth"][row], "viridis", lo, hi),
                  ("error: prediction − truth", err[row], "RdBu_r", -emax, emax),
                  ("no-change error: input − truth", still[row], "RdBu_r", -emax, emax)]
        for ax, (name, image, cmap, vmin, vmax) in zip(axes[row], panels):
            shown = ax.imshow(image, cmap=cmap, vmin=vmin, vmax=vmax, origin="lower",
                              interpolation="nearest")
            ax.set_title(f"{field}: {name}", fontsize=11)
            ax.set_xlabel("x")
            ax.set_ylabel("z")
            for s in seams:
                ax.axhline(s - 0.5, color="white" if cmap == "viridis" else "black",
                           linestyle="--", linewidth=0.8, alpha=0.7)
            fig.colorbar(shown, ax=ax, shrink=0.85)
    fig.suptitle(f"{title}\n{plane_label}", fontsize=12)
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def loss_png(path, losses, *, persistence: float, test_mse: float, title: str) -> Path:
    """Local. Training loss per step (and its moving average) on a log scale,
    with the persistence baseline (predicting no change, on the training set)
    and the held-out MSE at the end."""
    plt = _pyplot()
    from matplotlib.ticker import LogFormatterSciNotation
    steps = np.arange(1, len(losses) + 1)
    fig, ax = plt.subplots(figsize=(8, 4.8), constrained_layout=True)
    ax.semilogy(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8,
                label="training loss (MSE per step)")
    ax.semilogy(steps, _moving_average(losses, 20), color="tab:blue", linewidth=2,
                label="moving average (20 steps)")
    ax.axhline(persistence, color="tab:gray", linestyle="--",
               label=f"no-change baseline, training set ({persistence:.2e})")
    ax.plot([steps[-1]], [test_mse], marker="o", color="tab:red", linestyle="none",
            label=f"held-out trajectory MSE ({test_mse:.2e})")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean squared error (log scale)")
    ax.set_title(title)
    # Label the minor ticks too: a one-decade range would show a single label.
    ax.yaxis.set_minor_formatter(LogFormatterSciNotation(labelOnlyBase=False,
                                                         minor_thresholds=(2, 0.5)))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower left", fontsize=9)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def memory_png(path, memory: dict, *, title: str) -> Path:
    """Local. Per-rank peak memory against the budget for 1, 2 and 4 ranks:
    the plan's estimates (hatched) beside the measured peaks of the runs the
    job made (the one-process attempt, marked where it ran out of memory with
    the allocation it was refused on top; the sharded run's largest rank).
    ``memory``: the demo summary's "memory" entry."""
    plt = _pyplot()
    mib = 2.0 ** 20
    budget = memory["budget_bytes"] / mib
    estimates = {int(n): b / mib for n, b in memory["plan"]["estimates"].items()}
    measured = _measured(memory)
    counts = sorted(set(estimates) | set(measured))
    x = np.arange(len(counts))
    fig, ax = plt.subplots(figsize=(8, 4.8), constrained_layout=True)
    ax.bar(x - 0.2, [estimates.get(n, 0) for n in counts], 0.4, color="white",
           edgecolor="tab:blue", hatch="//", label="estimated (domainpar plan)")
    for i, n in enumerate(counts):
        if n not in measured:
            ax.text(x[i] + 0.2, budget * 0.03, "not run", ha="center", fontsize=9,
                    rotation=90, color="gray")
            continue
        peak, refused, failed = measured[n]
        ax.bar(x[i] + 0.2, peak, 0.4, color="tab:red" if failed else "tab:green",
               label="measured: out of memory" if failed else "measured: trained")
        if refused:
            ax.bar(x[i] + 0.2, refused, 0.4, bottom=peak, color="white", edgecolor="tab:red",
                   hatch="xx", label="the allocation refused")
        top = peak + (refused or 0)
        ax.text(x[i] + 0.2, top, "FAILED:\nout of memory" if failed else f"{peak:.0f} MiB",
                ha="center", va="bottom", fontsize=9,
                color="tab:red" if failed else "black")
    ax.axhline(budget, color="black", linestyle="--",
               label=f"budget per rank ({budget:.0f} MiB above baseline)")
    if memory.get("allowance_bytes"):
        ax.axhline(budget - memory["allowance_bytes"] / mib, color="gray", linestyle=":",
                   label="what the plan may use (budget less the runtime allowance)")
    ax.set_xticks(x, [f"{n} rank{'s' if n > 1 else ''}" for n in counts])
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.set_title(title)
    ax.set_xlim(-0.5, len(counts) - 0.5)
    ax.set_ylim(0, 1.5 * max([budget, *estimates.values()]
                              + [p + (r or 0) for p, r, _ in measured.values()]))
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="upper right", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _measured(memory: dict) -> dict:
    """{ranks: (peak MiB, refused allocation MiB or None, failed)} of the runs made."""
    mib = 2.0 ** 20
    runs = {}
    alone = memory.get("one_process")
    if alone and alone.get("peak_bytes") is not None:
        refused = alone.get("requested_bytes")
        runs[1] = (alone["peak_bytes"] / mib, refused / mib if refused else None,
                   not alone["fits"])
    peaks = memory["sharded_peak_bytes"]
    runs[len(peaks)] = (max(peaks) / mib, None, False)
    return runs
