#!/usr/bin/env python3
"""README's "models that run" table, from the model zoo's results.

    python tests/run_mpi.py -n 2 tests/test_model_zoo.py
    python tests/run_mpi.py -n 4 tests/test_model_zoo.py
    python tests/zoo_table.py [build/model-zoo]

Each run of tests/test_model_zoo.py leaves one JSON record per (model, layout)
in build/model-zoo/n<P>/; this prints, as Markdown, one row per model that runs
on some layout (library, model, the layouts, the largest float64 relative
difference from one process over them and over output, input gradient and
parameter gradients), then the (model, layout) pairs still refused, with the op
and the issue-18 item. Local, no MPI; only the standard library.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

# The order the layouts are listed in (tests/test_model_zoo.py's LAYOUTS).
LAYOUT_ORDER = ("2 ranks", "2 ranks uneven", "4 ranks", "4 ranks uneven", "2x2 grid")


def load(results: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(results.glob("n*/*.json"))]


def _order(layout: str) -> int:
    return LAYOUT_ORDER.index(layout) if layout in LAYOUT_ORDER else len(LAYOUT_ORDER)


def tables(records: list[dict]) -> str:
    models: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        models.setdefault((r["library"], r["model"]), []).append(r)
    runs = ["| library | model | layouts (sharded = one process) | float64 error |",
            "|---|---|---|---|"]
    refused = ["| library | model | layout | first refused op | issue 18 item |",
               "|---|---|---|---|---|"]
    for (library, model), rs in sorted(models.items()):
        rs.sort(key=lambda r: _order(r["layout"]))
        ok = [r for r in rs if r.get("runs")]
        if ok:
            error = max(r["float64_error"] for r in ok)
            runs.append(f"| {library} | {model} | {', '.join(r['layout'] for r in ok)} "
                        f"| {error:.0e} |")
        for r in rs:
            if "refused_op" in r:
                refused.append(f"| {library} | {model} | {r['layout']} | `{r['refused_op']}` "
                               f"| {r['item']} |")
            elif not r.get("runs"):
                refused.append(f"| {library} | {model} | {r['layout']} | differs from one "
                               "process (a failing test) | |")
    return "\n".join(runs) + "\n\nStill refused (the same UnsupportedOpError on every rank):\n\n" \
        + "\n".join(refused)


def main(argv: list[str]) -> int:
    results = Path(argv[1]) if len(argv) > 1 else \
        Path(__file__).resolve().parent.parent / "build" / "model-zoo"
    records = load(results)
    if not records:
        print(f"no results in {results}: run tests/test_model_zoo.py on 2 and 4 ranks first",
              file=sys.stderr)
        return 1
    print(tables(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
