"""The demo's headline: a field one process cannot hold trains sharded.

Three steps around the training, under ``--memory-per-rank`` (``budget``):

- ``plan``: ``domainpar plan`` for the demo's model and field size (rank 0, a
  process of its own): per-rank estimates for 1, 2 and 4 ranks and the
  smallest rank count that fits the budget (``plan.json`` in the output
  folder).
- ``one_process``: the training step on the whole field in one process under
  the budget (``budget.one_process``): it fails, the job goes on.
- the sharded training itself runs under the same budget in every rank
  (``job``), and its peak per rank is set beside the budget.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..bench.timing import on_rank0
from ..plan.units import format_bytes
from . import budget as budgets

ENTRY = "domainpar.demo.surrogate:Surrogate"
SHOWN = (1, 2, 4)  # the rank counts the plot and the summary show
# What a rank holds beyond the live tensors the planner counts, which the plan
# is asked to leave free: heap fragments, libraries' code and workspaces, MPI's
# and h5py's buffers, and copies the planner's one-rank model misses (measured
# for the demo's UNet on 2x2x64^3, 2 ranks: 150-170 MiB of resident memory
# above the plan's estimate, of which the kernel's limit counts most).
RUNTIME_ALLOWANCE = 160 * 2**20


def plan_command(args, out: Path) -> list[str]:
    """Local. The ``domainpar plan`` command line for the demo's training."""
    side = str(args.side)
    return [sys.executable, "-m", "domainpar.cli", "plan", ENTRY,
            "--kwargs", json.dumps({"width": args.width}),
            "--shape", str(args.batch), "2", side, side, side, "--shard-dims", "2",
            "--memory", str(args.memory_per_rank - RUNTIME_ALLOWANCE), "--optimizer", "adam",
            "--time-budget", str(args.plan_seconds), "--json", str(out / "plan.json")]


def plan(comm, args, out: Path) -> dict:
    """Collective. Run the planner on rank 0 (its output goes to this job's);
    return, on every rank, the training estimates per rank count (``estimates``:
    {ranks: bytes} for ``SHOWN``) and the smallest count that fits (``ranks``,
    None when none does)."""
    def run():
        cmd = plan_command(args, out)
        print("      $ domainpar plan " + " ".join(_quoted(c) for c in cmd[4:]), flush=True)
        code = subprocess.call(cmd, env=budgets.solo_env())
        if code != 0:
            raise RuntimeError(f"domainpar plan failed (exit status {code})")
        result = json.loads((out / "plan.json").read_text())
        rows = {row["ranks"]: row["train_bytes"] for row in result["rows"]}
        smallest = (result.get("smallest") or {}).get("train")
        return {"estimates": {n: rows[n] for n in SHOWN if n in rows},
                "ranks": smallest["ranks"] if smallest else None}
    return on_rank0(comm, run)


def problem(planned: dict, size: int) -> str | None:
    """Local. Why the job cannot show the headline on ``size`` ranks (None if it can)."""
    need = planned["ranks"]
    if need is None:
        return "no rank count fits --memory-per-rank by the plan: raise it, or lower --side"
    if need > size:
        return (f"the plan needs {need} ranks for --memory-per-rank, this job has {size}: "
                f"run it on {need} (-n {need}, or DEMO_NP={need}), or raise the budget")
    return None


def one_process(comm, h5, args, out: Path) -> dict:
    """Collective. The one-process attempt (rank 0 starts it; the others wait);
    its report on every rank."""
    return on_rank0(comm, lambda: budgets.one_process(
        h5, budget=args.memory_per_rank, batch=args.batch, width=args.width,
        seed=args.seed, out=out))


def planned_line(planned: dict, size: int) -> str:
    """Local. The plan's verdict in one line."""
    allowance = format_bytes(RUNTIME_ALLOWANCE)
    est = ", ".join(f"{n} rank{'s' if n > 1 else ''} {format_bytes(b)}"
                    for n, b in planned["estimates"].items())
    note = (f"; this job has {size}" if planned["ranks"] and planned["ranks"] < size else "")
    return (f"plan: training estimate per rank: {est}; smallest rank count that fits the "
            f"budget less a {allowance} runtime allowance: {planned['ranks']}{note}")


def sharded_line(peaks: list[int], budget: int) -> str:
    """Local. The sharded run's measured peaks beside the budget."""
    per = " / ".join(format_bytes(p) for p in peaks)
    return (f"sharded on {len(peaks)} ranks: peak per rank {per} above baseline (resident), "
            f"budget {format_bytes(budget)} per rank: trained under the limit")


def _quoted(text: str) -> str:
    return f"'{text}'" if any(c in text for c in " {}\"") else text
