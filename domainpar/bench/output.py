"""Where the benchmarks put their results."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def write_json(report: dict, out: str, log: Callable = print) -> Path:
    """Local (rank 0 calls it). ``report`` as indented JSON at ``out`` (parent
    folders made), and a line saying where."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    log(f"JSON: {path}")
    return path
