"""The plan of a distributed FFT (``ops/fft.py``): the phases of local transforms
and transposes that carry out a transform over given dims, derived from layouts
and shapes alone, so every rank derives the same one without a message. The
rule's docstring says what they do ("Method", "No free dim: transform dims over
every grid axis", "Replicated in, sharded out"); this module holds no data.
"""
from __future__ import annotations

import dataclasses

from ..comm.decomposition import Decomposition
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError
from . import fftband


@dataclasses.dataclass(frozen=True)
class Phase:
    """Move the block to ``src`` (a repartition; None: stay), then transform ``dims``
    (the c2r/r2c dim last) with lengths ``lengths``; the result is laid out by ``dst``,
    and then, where ``then`` is given, cut to it (dims held whole cut along axes
    ``dst`` replicates: "Replicated in, sharded out")."""
    src: Decomposition | None
    dims: tuple[int, ...]
    lengths: tuple[int, ...]
    half: bool
    dst: Decomposition
    then: Decomposition | None = None

    @property
    def out(self) -> Decomposition:
        """The layout after the phase."""
        return self.dst if self.then is None else self.then


def _local(dec: Decomposition, d: int) -> bool:
    return d not in dec.shard or dec.grid.dims[dec.shard[d]] == 1


def _target(name: str, dec: Decomposition, d: int, done, pending) -> int:
    """The dim that takes ``d``'s grid axis (``ops/fft.py``, "Method", step 2)."""
    axis = dec.shard[d]
    ranks = dec.grid.dims[axis]
    shape = dec.global_shape
    # Dims on no axis first; a dim on an axis of one process (whole, but it keeps
    # that axis where it can) only when none is left.
    for free in ([t for t in range(dec.ndim) if t != d and t not in dec.shard],
                 [t for t in range(dec.ndim) if t != d and not layout.cut(dec, t)]):
        free = [t for t in free if shape[t] >= ranks]
        # A transform dim before any other: the result then comes out sharded on a
        # frequency dim, where the channel mixing that follows a transform (an FNO's
        # einsum) stays local; on the channels it would contract a sharded dim.
        tiers = ([t for t in free if t in done],
                 sorted((t for t in free if t in pending), key=lambda t: (-shape[t], t)),
                 sorted((t for t in free if t not in pending), key=lambda t: (-shape[t], t)))
        for tier in tiers:
            if tier:
                return min(tier) if tier is tiers[0] else tier[0]
    raise UnsupportedOpError(
        f"{name} on a DomainTensor of shape {tuple(shape)} sharded on "
        f"{layout.sharded_dims_text(dec)}: transforming dim {d} needs it whole on every rank, "
        f"and no other dim can take its grid axis {axis}: each is sharded already or has fewer "
        f"than the {ranks} ranks of that axis. Add a batch or channel dim of at least {ranks}, "
        f"shard another dim (redistribute), or use fewer ranks on grid axis {axis}")


def _moved(dec: Decomposition, d: int, t: int) -> Decomposition:
    """``dec`` with ``d``'s grid axis on ``t`` (balanced blocks) and ``d`` whole."""
    shard = {k: a for k, a in dec.shard.items() if k != d}
    shard[t] = dec.shard[d]
    sizes = {k: dec.block_sizes(k) for k in shard if k != t}
    return layout.derive(dec, dec.global_shape, shard, sizes)


def transformed(dec: Decomposition, out_sizes: dict[int, int]) -> Decomposition:
    """Local. ``dec`` after local transforms resize the dims in ``out_sizes``."""
    shape = list(dec.global_shape)
    for d, n in out_sizes.items():
        shape[d] = n
    sizes = {k: ((shape[k],) if k in out_sizes else dec.block_sizes(k)) for k in dec.shard}
    return layout.derive(dec, shape, dec.shard, sizes)


def plan(name: str, dec: Decomposition, dims, lengths, out_lengths, kind,
          done: tuple[int, ...] = (), split: bool = False) -> list[Phase]:
    """Local. The phases of a transform (``name``: the torch call, for errors) over
    ``dims`` (torch's order; the half dim last) with input lengths ``lengths``
    (c2r: output lengths) and output sizes ``out_lengths``; ``done``: dims an
    earlier part of the call transformed; ``split``: the half dim in a phase of
    its own (``ops/fft.py``, "Slices of a spectrum"). Planned once per arguments
    (``layout.planned``); a refusal is raised each time."""
    args = (name, dec, tuple(dims), tuple(lengths), tuple(out_lengths), kind, tuple(done),
            split)
    return list(layout.planned(("fftplan", *args), lambda: tuple(_plan(*args))))


def _plan(name: str, dec: Decomposition, dims, lengths, out_lengths, kind,
          done: tuple[int, ...], split: bool) -> list[Phase]:
    """``plan`` made afresh."""
    length = dict(zip(dims, lengths))
    out_length = dict(zip(dims, out_lengths))
    half = dims[-1] if kind else None
    pending, phases = list(dims), []
    finished = list(done)
    while pending:
        src = None
        if kind == "r2c" and half is not None and half in pending:
            if not _local(dec, half):
                src = dec = _moved(dec, half, _target(name, dec, half, finished, pending))
            group = [half] if split else \
                [d for d in pending if d != half and _local(dec, d)] + [half]
        elif all(_local(dec, d) for d in pending):
            group = [d for d in pending if d != half] if split and kind == "c2r" and \
                len(pending) > 1 else list(pending)
        else:
            full = [d for d in pending if d != half]
            group = [d for d in full if _local(dec, d)]
            if not group:
                d = full[0] if full else half
                assert d is not None  # only the half dim is left
                src = dec = _moved(dec, d, _target(name, dec, d, finished, pending))
                group = [d]
        dst = transformed(dec, {d: out_length[d] for d in group})
        phases.append(Phase(src, tuple(group), tuple(length[d] for d in group),
                             half in group, dst))
        dec = dst
        finished += group
        pending = [d for d in pending if d not in group]
    return phases


def phases(name: str, dec: Decomposition, dims, lengths, out_lengths, kind, split):
    """Local. The plan, and None; or, where no dim can take a cut transform dim's grid
    axis, the plan from a layout ``start`` on a merged grid, and ``start``. Planned
    once per arguments."""
    args = (name, dec, tuple(dims), tuple(lengths), tuple(out_lengths), kind, split)
    found, start = layout.planned(("fftphases", *args), lambda: _phases(*args))
    return list(found), start


def _phases(name: str, dec: Decomposition, dims, lengths, out_lengths, kind, split):
    """``phases`` made afresh."""
    try:
        return plan(name, dec, dims, lengths, out_lengths, kind, split=split), None
    except UnsupportedOpError as refusal:
        for start in _merged_starts(dec, dims):
            try:
                return plan(name, start, dims, lengths, out_lengths, kind, split=split), start
            except UnsupportedOpError:
                continue
        raise refusal from None


def cut_replicated(phases: list[Phase]) -> list[Phase]:
    """Collective where the input is replicated (``replicated``). ``phases`` of a
    transform of an input replicated along grid axes of more than one rank, with
    no transpose: each such axis cut onto the first dim transformed (in phase
    order, then dim order) that has as many elements as it has ranks, right after
    the phase that transforms it, where a later phase then runs on blocks
    (``ops/fft.py``, "Replicated in, sharded out"). Other plans are kept."""
    dec = phases[0].dst
    axes = [a for a in dec.replicated_axes if dec.grid.dims[a] > 1]
    if not replicated(dec) or any(p.src is not None for p in phases):
        return phases
    out: list[Phase] = []
    for k, phase in enumerate(phases):
        if out:  # the layout after the phase before (cut: this one runs on blocks)
            phase = dataclasses.replace(phase, dst=transformed(
                out[-1].out, {d: phase.dst.global_shape[d] for d in phase.dims}))
        dst, shard = phase.dst, dict(phase.dst.shard)
        for d in sorted(phase.dims) if k < len(phases) - 1 else ():
            if axes and d not in shard and dst.global_shape[d] >= dst.grid.dims[axes[0]]:
                shard[d] = axes.pop(0)
        if len(shard) > len(dst.shard):
            phase = dataclasses.replace(phase, then=layout.derive(
                dst, dst.global_shape, shard, {k: dst.block_sizes(k) for k in dst.shard}))
        out.append(phase)
    return out


def replicated(dec: Decomposition) -> bool:
    """Collective over ``dec``'s grid where it replicates (``fftband.enabled``).
    Whether ``dec`` is replicated along a grid axis of more than one rank, with the
    cut of such inputs on."""
    return any(dec.grid.dims[a] > 1 for a in dec.replicated_axes) and \
        fftband.enabled(dec.grid)


def _merged_starts(dec: Decomposition, dims):
    """Layouts to start from when the plan finds no free dim (``ops/fft.py``, "No free dim"):
    the cut transform dims' axes merged onto the first of them; then every cut
    dim's axes merged onto the largest cut dim the call does not transform."""
    cut = [d for d in range(dec.ndim) if layout.cut(dec, d)]
    ours = [d for d in cut if d in dims]
    if len(ours) > 1:
        yield layout.merged(dec, ours, ours[0])
    others = sorted((d for d in cut if d not in dims), key=lambda d: (-dec.global_shape[d], d))
    if others and ours:
        yield layout.merged(dec, cut, others[0])
