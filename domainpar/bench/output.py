"""Where the benchmarks put their results: JSON, and a PNG of it beside it."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def write_json(report: dict, out: str, log: Callable = print) -> Path:
    """Local (rank 0 calls it). ``report`` as indented JSON at ``out`` (parent
    folders made) and its plot at the same stem with .png (see ``plots``), and
    a line saying where each went."""
    from .plots import write_png
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    log(f"JSON: {path}")
    write_png(report, path.with_suffix(".png"), log)
    return path
