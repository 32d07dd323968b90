"""Byte sizes as people write them (``16GiB``, ``500 MB``, ``2e9``) and back."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1,
          "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """Local. ``"16GiB"`` -> 17179869184. Binary units (KiB, MiB, GiB, TiB) are
    powers of 1024, decimal ones (kB, MB, GB, TB; K, M, G, T) powers of 1000;
    no unit means bytes. Raises ValueError naming the accepted units."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (write e.g. 16GiB, 500MB, 2e9; units: "
                         "B, kB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (of 1024))")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"a memory size must be > 0, got {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """Local. 3.5 * 2**30 -> ``"3.50 GiB"`` (binary units, three significant figures)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
