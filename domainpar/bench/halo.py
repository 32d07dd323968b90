"""`domainpar bench halo`: HaloExchange.fill against raw mpi4py on the same bytes.

For 2-D and 3-D float32 fields sharded along one axis at a time over a 1-D
grid of all ranks, each face (halo width x the cross-section) is sized 1 MiB
to 64 MiB. Timed side by side, round-robin, in one run:

- ``sendrecv``: raw ``comm.Sendrecv`` of contiguous buffers of the same bytes
  between the same ranks: the wire, the target to match;
- ``fill``: ``HaloExchange.fill`` as it chooses by default (contiguous faces go
  straight to MPI; strided faces as derived datatypes or packed, whichever its
  plan timed faster on its first calls);
- ``fill_unchecked``: the same with ``check=False`` (no agreement allreduce);

and, for strided faces, fill with each way forced, to keep the choice honest:

- ``fill_pack``: packed as domainpar packs (C kernels, numpy on single-element
  rows); ``fill_numpy``: numpy's copy for every face;
  ``fill_datatype``: derived datatypes straight from the array;
- ``subarray``: raw ``comm.Sendrecv`` of the same face straight from the array
  with MPI subarray datatypes (what a hand-written mpi4py exchange would do).
"""
from __future__ import annotations

import math
import os
import platform
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from ..comm import Decomposition, HaloExchange, ProcessGrid, capabilities, packing
from ..comm import halo as halo_module
from ..progress import Progress
from .output import write_json
from .settings import applied, configurations, context_for, describe
from .timing import interleaved, median, ratios, split_configurations

TARGET_RATIO = 1.10


def _field_shape(ndim: int, axis: int, face_bytes: int, width: int, block: int, ranks: int):
    """A float32 field whose face along ``axis`` (``width`` deep) has ``face_bytes``."""
    cross = face_bytes // (4 * width)
    if ndim == 2:
        others = [cross]
    else:
        side = int(round(math.sqrt(cross)))
        others = [side, cross // side]
    shape = list(others)
    shape.insert(axis, block * ranks)
    return tuple(shape)


def _raw_paths(comm, halo, arr):
    """Raw mpi4py equivalents of one fill: per peer, a Sendrecv of contiguous
    buffers of the same bytes, and one of the same boxes by subarray datatype."""
    (_dim, sends, recvs), = halo.rounds
    peers = sorted({t.peer for t in sends} | {t.peer for t in recvs})
    mpi_type = MPI.FLOAT

    def subarray(box):
        return mpi_type.Create_subarray(arr.shape, [s.stop - s.start for s in box],
                                        [s.start for s in box]).Commit()

    plain, typed = [], []
    for peer in peers:
        out = [t for t in sends if t.peer == peer]
        inn = [t for t in recvs if t.peer == peer]
        # one message each way per peer in these layouts (width <= block)
        assert len(out) == 1 and len(inn) == 1, "bench layouts exchange one face per peer"
        nbytes_out = arr[out[0].box].nbytes
        nbytes_in = arr[inn[0].box].nbytes
        plain.append((peer, np.ones(nbytes_out, np.uint8), np.empty(nbytes_in, np.uint8)))
        typed.append((peer, subarray(out[0].box), subarray(inn[0].box)))

    def sendrecv():
        for peer, sbuf, rbuf in plain:
            comm.Sendrecv([sbuf, MPI.BYTE], peer, 0, [rbuf, MPI.BYTE], peer, 0)

    def sendrecv_subarray():
        for peer, stype, rtype in typed:
            comm.Sendrecv([arr, 1, stype], peer, 0, [arr, 1, rtype], peer, 0)

    def free():
        for _, s, r in typed:
            s.Free()
            r.Free()

    return sendrecv, sendrecv_subarray, free


class _Setup(NamedTuple):
    shape: tuple
    halo: HaloExchange
    arr: np.ndarray
    strided: bool
    paths: dict
    free: Callable[[], None]


def _setup(grid, ndim, axis, face, width, block) -> _Setup:
    """Local. A field, its exchange and every path timed on it (built under the
    settings in force: configuration B builds its own under B's)."""
    shape = _field_shape(ndim, axis, int(face * 2**20), width, block, grid.size)
    dec = Decomposition(shape, grid, shard={axis: 0})
    halo = HaloExchange(dec, {axis: width})
    arr = np.ones(halo.padded_shape, np.float32)
    strided = not arr[halo.ghost_slices(axis, "lo")].flags.c_contiguous
    sendrecv, subarray, free = _raw_paths(grid.comm, halo, arr)
    paths = {"sendrecv": sendrecv, "fill": lambda: halo.fill(arr),
             "fill_unchecked": lambda: halo.fill(arr, check=False),
             "subarray": subarray}
    if strided:
        paths.update(_forced_fills(dec, axis, width, arr))
    return _Setup(shape, halo, arr, strided, paths, free)


def _figures(halo, samples, strided: bool) -> dict:
    """One configuration's medians, ratios and the way its fill settled on."""
    (plan,) = halo.tuning()
    med = {k: median(v) for k, v in samples.items()}
    out = {
        "fill_way": plan["way"] or ("packed" if strided else "direct"),
        "fill_tuning_s": plan["timings"],
        "median_s": med, "samples_s": samples,
        "ratio_fill_to_sendrecv": med["fill"] / med["sendrecv"],
        "ratio_fill_to_subarray": med["fill"] / med["subarray"],
        "ratio_unchecked_to_sendrecv": med["fill_unchecked"] / med["sendrecv"],
    }
    for forced in ("fill_pack", "fill_numpy", "fill_datatype"):
        if forced in med:
            out[f"ratio_fill_to_{forced}"] = med["fill"] / med[forced]
    out["meets_target"] = out["ratio_fill_to_sendrecv"] <= TARGET_RATIO
    return out


def _run_case(grid, ndim, axis, face, width, block, repeats, compare=None) -> dict:
    """Collective. Time every path for one field and face size; with ``compare``,
    configuration B's paths too (on their own exchange and array), interleaved."""
    a = _setup(grid, ndim, axis, face, width, block)
    paths, b = a.paths, None
    if compare:
        with applied(compare):
            b = _setup(grid, ndim, axis, face, width, block)
        paths = {**paths, **{f"B:{k}": fn for k, fn in b.paths.items()}}
    reps = repeats if face <= 16 else max(5, repeats // 2)
    # warm-up long enough for fill's plan to finish timing its ways
    samples = interleaved(grid.comm, paths, reps, warmup=halo_module.TUNING_CALLS + 1,
                          context=context_for(compare))
    samples, samples_b = split_configurations(samples)
    face_bytes = a.arr[a.halo.ghost_slices(axis, "lo")].nbytes
    case = {
        "ndim": ndim, "axis": axis, "strided": a.strided, "field_shape": list(a.shape),
        "padded_block_shape": list(a.halo.padded_shape), "width": width,
        "face_bytes": face_bytes, "repeats": reps, **_figures(a.halo, samples, a.strided),
    }
    case["wire_GBps"] = face_bytes / case["median_s"]["sendrecv"] / 1e9
    a.free()
    if b is not None:
        b.free()
        case["B"] = _figures(b.halo, samples_b, b.strided)
        case["ratio_B_over_A"] = ratios(case["B"]["median_s"], case["median_s"])
    return case


def run(dims=(2, 3), faces_mib=(1, 4, 16, 64), width=1, block=8, repeats=11,
        out: str | None = "bench-out/halo.json", log=print, compare=None) -> dict:
    """Collective over MPI.COMM_WORLD. Run the benchmark; returns the report
    (rank 0 also writes it to ``out`` as JSON and PNG). ``compare``: the
    settings of a configuration B timed beside this one (``settings``)."""
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 2:
        raise SystemExit("domainpar bench halo needs 2 or more MPI ranks "
                         "(domainpar bench halo -n 2 launches them)")
    if block < width:  # the raw baselines send one face per neighbour
        raise SystemExit(f"domainpar bench halo: --block {block} must be at least "
                         f"--width {width}")
    grid = ProcessGrid((size,))
    load = [os.getloadavg()]
    if rank == 0:
        log(f"halo fill vs raw mpi4py on {size} ranks, float32, width {width}, "
            f"medians of {repeats} interleaved runs")
        if compare:
            log(f"compared, interleaved: {describe(compare)}")
        log(HEADER)
    cases = []
    shapes = [(face, ndim, axis) for face in sorted(faces_mib) for ndim in dims
              for axis in range(ndim)]
    bar = Progress(len(shapes), "bench halo", comm=comm)
    # Small faces first: after the big arrays come and go, strided copies run
    # slower (the allocator hands back memory in a worse state), which would
    # penalise whichever cases happen to come later.
    for face, ndim, axis in shapes:
        case = _run_case(grid, ndim, axis, face, width, block, repeats, compare)
        cases.append(case)
        bar.update(case=f"{ndim}-D axis {axis} {face:g} MiB")
        if rank == 0:
            log(_row(case))
            if compare:
                log(_row(case, "B"))
    bar.close()
    cases.sort(key=lambda c: (c["ndim"], c["axis"], c["face_bytes"]))
    if rank == 0:
        log("sorted:")
        log(HEADER)
        for case in cases:
            log(_row(case))
            if compare:
                log(_row(case, "B"))
    report = {
        "benchmark": "halo", "ranks": size, "target_ratio": TARGET_RATIO,
        "host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "loadavg_start_end": load + [os.getloadavg()],
        "capabilities": capabilities(), "configurations": configurations(compare),
        "cases": cases,
    }
    if rank == 0 and out:
        write_json(report, out, log)
    return report


def _forced_fills(dec, axis, width, arr):
    """fill with strided faces forced through each way: packed, numpy only,
    derived datatypes. Plans fix their way when built, so each gets its own
    HaloExchange, planned under the forced setting."""
    def planned(way, native):
        saved = halo_module.FORCED_WAY
        halo_module.FORCED_WAY = way
        try:
            h = HaloExchange(dec, {axis: width})
            h.fill(arr)
        finally:
            halo_module.FORCED_WAY = saved

        def run():
            saved_native = packing.use_native
            packing.use_native = native
            try:
                h.fill(arr)
            finally:
                packing.use_native = saved_native
        return run

    return {"fill_pack": planned("pack", True), "fill_numpy": planned("pack", False),
            "fill_datatype": planned("datatype", True)}


_COLUMNS = {"sendrecv": "sendrecv", "fill": "fill", "fill_unchecked": "unchecked",
            "subarray": "subarray", "fill_pack": "packed", "fill_numpy": "numpy",
            "fill_datatype": "datatype"}
HEADER = (f"{'':>2} {'field':>5} {'axis':>4} {'face MiB':>8} "
          + " ".join(f"{title:>9}" for title in _COLUMNS.values())
          + f" {'fill/sendrecv':>13} {'unchecked/sendrecv':>18} {'fill way':>9}   (median ms)")


def _row(case, config: str = "A") -> str:
    """A table row of one case: configuration A's figures, or B's."""
    c = case if config == "A" else case["B"]
    m = c["median_s"]
    ms = [f"{m[k] * 1e3:9.3f}" if k in m else f"{'-':>9}" for k in _COLUMNS]
    return (f"{config:>2} {case['ndim']:>3}-D {case['axis']:>4} "
            f"{case['face_bytes'] / 2**20:8.1f} {' '.join(ms)} "
            f"{c['ratio_fill_to_sendrecv']:13.2f} {c['ratio_unchecked_to_sendrecv']:18.2f} "
            f"{c['fill_way']:>9}")
