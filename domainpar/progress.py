"""Progress output for long work (benchmarks, the demo, training examples).

One line per update on rank 0, redrawn in place on a terminal and printed at a
bounded rate elsewhere (a batch job's log gets a line every ``every_s``
seconds, not one per step). The other ranks print nothing, so a caller may
update on every rank alike.

    bar = Progress(300, "train", comm=comm)
    for step in range(300):
        ...
        bar.update(loss=f"{loss:.3e}", step=f"{ms:.0f} ms")
    bar.close()
"""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Local (prints on rank 0 of ``comm`` only; never communicates).

    ``total``: the number of steps (``None`` when unknown); ``label``: what is
    being done; ``stream``: where to print (default stderr, so that a command's
    stdout stays its result); ``every_s``: the least time between two printed
    lines when the stream is not a terminal.
    """

    WIDTH = 24  # characters of the bar itself

    def __init__(self, total: int | None, label: str, comm=None, stream: TextIO | None = None,
                 every_s: float = 10.0):
        self.total = total
        self.label = label
        self.count = 0
        self.stream = stream or sys.stderr
        self.enabled = comm is None or comm.Get_rank() == 0
        self.tty = self.enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every_s = every_s
        self.t0 = time.perf_counter()
        self._last_print = -float("inf")
        self._last_line = ""

    def update(self, n: int = 1, **fields) -> None:
        """Advance by ``n`` steps and show ``fields`` (name=value) after the bar."""
        self.count += n
        if not self.enabled:
            return
        now = time.perf_counter()
        done = self.total is not None and self.count >= self.total
        if not self.tty and not done and now - self._last_print < self.every_s:
            return
        self._last_print = now
        self._print(self._line(now, fields), final=done)

    def close(self, **fields) -> None:
        """End the line (prints the final state once more when it was not shown)."""
        if not self.enabled:
            return
        line = self._line(time.perf_counter(), fields) if fields else self._last_line
        if self.tty:
            self.stream.write("\n")
        elif line and line != self._last_line:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _line(self, now: float, fields: dict) -> str:
        elapsed = now - self.t0
        if self.total:
            fraction = min(self.count / self.total, 1.0)
            filled = int(round(fraction * self.WIDTH))
            bar = "#" * filled + "." * (self.WIDTH - filled)
            eta = elapsed / self.count * (self.total - self.count) if self.count else 0.0
            head = (f"{self.label} [{bar}] {self.count}/{self.total} "
                    f"{_clock(elapsed)} elapsed, {_clock(eta)} left")
        else:
            head = f"{self.label} {self.count} done, {_clock(elapsed)} elapsed"
        tail = "  ".join(f"{k} {v}" for k, v in fields.items())
        return f"{head}  {tail}" if tail else head

    def _print(self, line: str, final: bool) -> None:
        if self.tty:
            # Pad over the previous line's tail: the new one may be shorter.
            pad = max(len(self._last_line) - len(line), 0)
            self.stream.write("\r" + line + " " * pad)
        else:
            self.stream.write(line + "\n")
        self._last_line = line
        self.stream.flush()


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}:{seconds % 60:02d}"
