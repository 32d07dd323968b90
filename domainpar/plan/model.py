"""The memory model: a rank's peak as a function of its block, fitted to
measured points and extrapolated to the blocks of the candidate grids.

    peak(block) = a + b * cells + c * faces

``cells`` is the number of elements of the block (the input's, all dims), so
``b`` is the bytes per input element of everything that grows with the block:
the activations saved for backward, their gradients, the transient buffers
of the largest layer. ``a`` is what does not grow with the block: the
parameters, their gradients and the optimizer's state, which every rank holds
whole (they are replicated), and the fixed buffers. ``faces`` is the sum over
the shardable dims of the block's cross-section (``cells / block[d]``): a
sharded conv reads one block plus its halo, and the padded copies and halo
slabs it keeps grow with the block's surface, which matters for small blocks
(and for deep levels of a UNet, where a block is a few cells wide). The face
term is fitted only from four points up and kept only when its coefficient
comes out positive and it adds at least 0.1% somewhere measured; otherwise the
fit is ``a + b * cells``.

Least squares over the measured points; ``r2`` and the residuals say how well
the line fits them. Measured points are deterministic (counted bytes, not
sampled), so a poor ``r2`` means the model is not linear in its block, and the
estimates should not be trusted.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

TERMS = ("bytes", "bytes/cell", "bytes/face cell")


def features(block: Sequence[int], dims: Sequence[int]) -> tuple[int, int]:
    """Local. ``(cells, faces)`` of a block: its element count and the sum over
    ``dims`` of its cross-sections."""
    cells = math.prod(block)
    return cells, sum(cells // block[d] for d in dims)


@dataclass
class Fit:
    """``peak = coef[0] + coef[1] * cells (+ coef[2] * faces)`` in bytes."""
    coef: tuple[float, ...]
    r2: float
    residuals: list[float] = field(default_factory=list)

    def predict(self, cells: int, faces: int) -> float:
        """Local. The fitted peak bytes of a block of ``cells`` cells and ``faces`` halo faces."""
        value = self.coef[0] + self.coef[1] * cells
        return value + (self.coef[2] * faces if len(self.coef) > 2 else 0.0)

    def describe(self) -> str:
        """``"peak = 1.2 MiB + 214 B x cells + 226 B x faces (R^2 0.99998)"``."""
        from .units import format_bytes
        parts = [format_bytes(self.coef[0]), f"{self.coef[1]:.4g} B x cells"]
        if len(self.coef) > 2:
            parts.append(f"{self.coef[2]:.4g} B x faces")
        return f"peak = {' + '.join(parts)} (R^2 {self.r2:.5f})"

    def as_dict(self) -> dict:
        """Local. The fit as JSON-ready data: terms, R^2, residuals."""
        return {"terms": dict(zip(TERMS, self.coef)), "r2": self.r2,
                "residuals_bytes": self.residuals}


def fit(points: Sequence[tuple[int, int, float]]) -> Fit:
    """Local. Least-squares fit of ``(cells, faces, peak_bytes)`` points (at
    least 2 with distinct cells)."""
    import numpy as np
    cells, faces, peaks = (np.array(v, dtype=float) for v in zip(*points))
    if len(set(cells)) < 2:
        raise ValueError("the memory fit needs points of at least two block sizes")
    result = None
    if len(points) >= 4:
        result = _lstsq(np.stack([np.ones_like(cells), cells, faces], 1), peaks)
        # A face term that is negative, or too small to matter anywhere measured, is noise.
        if result[0][1] <= 0 or result[0][2] * faces.max() <= 1e-3 * peaks.max():
            result = None
    if result is None:
        result = _lstsq(np.stack([np.ones_like(cells), cells], 1), peaks)
    coef, residuals = result
    total = float(((peaks - peaks.mean()) ** 2).sum())
    r2 = 1.0 - float((residuals ** 2).sum()) / total if total > 0 else 1.0
    return Fit(tuple(float(c) for c in coef), r2, [float(r) for r in residuals])


def _lstsq(matrix, values):
    import numpy as np
    # Columns scaled to unit size first: cells and bytes span ten orders of magnitude.
    scale = np.abs(matrix).max(axis=0)
    scale[scale == 0] = 1.0
    coef = np.linalg.lstsq(matrix / scale, values, rcond=None)[0] / scale
    return coef, values - matrix @ coef
