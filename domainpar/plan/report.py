"""From fitted memory models to a recommendation: the estimate for each
candidate grid, the best grid per rank count, the smallest count that fits a
budget, and the table and JSON that show them.

Per rank count the best grid is the one with the lowest estimated training
peak; among equal ones (the estimate depends on a block's cells, and on its
faces only where halos showed in the measured peaks), the one with the least
halo volume to exchange (the most even blocks), then the one sharding fewer
dims (fewer neighbours), then the one sharding the outer dims (contiguous
blocks and halo faces in C order).

Pure Python: the measured fits come in as ``model.Fit`` objects.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .grids import Grid, candidate_counts, grids
from .model import Fit, features
from .units import format_bytes

MODES = ("train", "inference")


@dataclass
class Estimate:
    """Local. A candidate grid's estimated peak memory per rank (bytes) for training
    and for inference, and the sharded dims whose blocks would be too small."""
    grid: Grid
    train: float
    inference: float
    too_small: tuple[int, ...]

    def fits(self, budget: float | None, mode: str = "train") -> bool | None:
        """Local. Whether ``mode``'s peak fits ``budget`` bytes with no block too small;
        None without a budget."""
        if budget is None:
            return None
        return not self.too_small and getattr(self, mode) <= budget

    def key(self):
        """Lowest training peak first; among equal peaks, the least halo volume,
        then the fewest sharded dims, then the outer dims sharded first."""
        halo = sum(math.prod(self.grid.block) // self.grid.block[d] for d in self.grid.sharded)
        return (bool(self.too_small), round(self.train), halo, len(self.grid.sharded),
                tuple(-p for p in self.grid.ranks))

    def as_dict(self, budget: float | None) -> dict:
        """Local. The estimate as JSON-ready data, judged against ``budget``."""
        return {"ranks": self.grid.size, "grid": list(self.grid.ranks),
                "shard": {str(d): a for d, a in self.grid.shard().items()},
                "block": list(self.grid.block), "train_bytes": self.train,
                "inference_bytes": self.inference, "too_small_dims": list(self.too_small),
                "uneven": self.grid.uneven, "fits_train": self.fits(budget, "train"),
                "fits_inference": self.fits(budget, "inference")}


def estimate(grid: Grid, fits: Mapping[str, Fit], min_block: int, multiple: int = 1) -> Estimate:
    """Local. ``fits``: one per mode (``train``, ``inference``).

    Along a sharded dim, a block that is not a multiple of the model's
    down-sampling factor ``multiple`` is estimated as the next multiple: the
    measured blocks are all multiples, and the largest rank of a sharded run
    peaks like the rounded-up block (UNet3d, 40^3 over 2 ranks: blocks of 20
    along the sharded dim, and the first rank's peak is the one-rank pattern's
    at 24, 15% above its peak at 20)."""
    block = list(grid.block)
    for d in grid.sharded:
        block[d] = -(-block[d] // multiple) * multiple
    cells, faces = features(block, grid.dims)
    train, inference = (fits[mode].predict(cells, faces) for mode in MODES)
    return Estimate(grid, train, inference, grid.too_small(min_block))


def ranked(shape: Sequence[int], dims: Sequence[int], count: int, fits: Mapping[str, Fit],
           min_block: int, multiple: int = 1) -> list[Estimate]:
    """Local. Every grid of ``count`` ranks, best first."""
    return sorted((estimate(g, fits, min_block, multiple) for g in grids(shape, dims, count)),
                  key=Estimate.key)


def best_per_count(shape, dims, max_ranks: int, fits, min_block: int,
                   multiple: int = 1) -> list[Estimate]:
    """Local. The best grid of each candidate rank count up to ``max_ranks``,
    stopping after the first count whose blocks are all too small."""
    rows = []
    for count in candidate_counts(max_ranks):
        options = ranked(shape, dims, count, fits, min_block, multiple)
        if not options:
            break
        rows.append(options[0])
        if options[0].too_small:
            break
    return rows


def smallest_fit(rows: Sequence[Estimate], budget: float, mode: str) -> Estimate | None:
    """Local. The first of ``rows`` (in the order given) that fits ``budget`` in ``mode``."""
    return next((r for r in rows if r.fits(budget, mode)), None)


def grid_text(e: Estimate) -> str:
    """``"2x1x1: ProcessGrid((2, 1, 1)), shard={2: 0, 3: 1, 4: 2}"``."""
    if e.grid.size == 1:
        return (f"{e.grid.label()}: one process, nothing sharded (estimated as a DomainTensor "
                "on a one-rank grid; plain torch can differ)")
    return (f"{e.grid.label()}: ProcessGrid({tuple(e.grid.ranks)}), "
            f"shard={e.grid.shard()}")


def table(rows: Sequence[Estimate], dims: Sequence[int], budget: float | None) -> str:
    """Local. The rows as a fixed-width text table."""
    head = ["ranks", "grid (dims " + ",".join(map(str, dims)) + ")", "block per rank",
            "train/rank", "inference/rank"]
    if budget is not None:
        head.append(f"fits {format_bytes(budget)} (train, inference)")
    head.append("note")
    lines = []
    for e in rows:
        cells = [str(e.grid.size), e.grid.label(),
                 "x".join(map(str, e.grid.block)), format_bytes(e.train),
                 format_bytes(e.inference)]
        if budget is not None:
            cells.append(", ".join("yes" if e.fits(budget, m) else "no" for m in MODES))
        notes = []
        if e.too_small:
            notes.append("blocks too small along dim " + ",".join(map(str, e.too_small)))
        elif e.grid.uneven:
            notes.append("uneven blocks")
        cells.append("; ".join(notes))
        lines.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines)]
    right = {0, 3, 4}
    out = []
    for cells in [head] + lines:
        out.append("  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip())
    return "\n".join(out)
