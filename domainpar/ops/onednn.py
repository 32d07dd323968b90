"""CPU oneDNN kernel selection for the local conv of a block: a workaround for
torch's size rule, on a private torch API. Local: every function here acts on
this rank's tensors only, but for the ranks' agreement on a tuned conv's way
(``agree``, ``agree_on_nothing``: one small allreduce at a conv's first forward).

torch runs batch-1 float32 3-D convs on CPU by im2col (``slow_conv3d``) when
N*C*D*H is small ("native is faster for some cases"), and a block is smaller
than the whole along its sharded dims: sharding alone would move a conv onto
that path, which holds 27 times its input in columns and ran 4x slower than
oneDNN on a 1x8x34x66x66 block. ``kernel_order`` asks torch which backend it
would pick (``torch._C._select_conv_backend``, private: a torch without it
leaves the choice to torch) and finds a reordering of the spatial dims (a view)
that gets oneDNN, or else ``LAYOUT``: the block converted to oneDNN's own tensor
layout. ``local_conv_backward`` runs torch's conv backward that way;
``local_conv`` runs a conv's forward by torch's oneDNN kernel directly
(``torch.mkldnn_convolution``, no reordering needed) and a transposed conv's
reordered. All give the same numbers as torch's default path (to float32
rounding). ``tuned_conv`` runs a large conv whole or in pieces of output rows,
whichever this rank timed faster the first time it met the conv's signature:
oneDNN is much slower on a few block shapes than on their neighbours
(``DOMAINPAR_CONV_TUNING=0``: always whole). A sharded conv's ranks agree on
one way at its first forward (``_AGREED``: the one collective here).

Torch version: checked on torch 2.13.0+cpu (tests/test_onednn.py: the private
query and the direct kernel exist, the query picks im2col for a thin block and
oneDNN for the reordered one, and every selected path matches torch's default).
The timings above are from commit ee1623b, which did not record its torch
version; those of ``_DIRECT`` from torch 2.13.0+cpu. If a torch release changes
the rule or drops either, tests/test_onednn.py says so.
"""
from __future__ import annotations

import functools
import time

import numpy as np
import torch

from ..comm import collectives
from ..comm.runtime import switch

LAYOUT = "onednn-layout"  # kernel_order's answer: convert the block to oneDNN's layout

# torch's oneDNN conv kernel itself, under the size rule (public in the torch
# namespace, undocumented: checked on 2.13.0+cpu by tests/test_onednn.py). A conv's
# forward calls it on the block as it lies, where a reordered view made oneDNN
# copy the block into its layout and the output came back strided: 1x2x66x128x128
# -> 4 channels took 62-64 ms reordered (and made contiguous), 38 ms direct. Backward
# has no such entry (torch's convolution_backward applies the rule), so it keeps
# the reordering. None in a torch without it: the reordering then serves both.
_DIRECT = getattr(torch, "mkldnn_convolution", None)


def local_conv(func, cells, w, b, stride, padding, dilation, groups, output_padding=None,
               agree=None):
    """Local (collective over ``agree`` where given). torch's conv (or transposed
    conv, given ``output_padding``) on this rank's cells, by oneDNN where torch
    would take its im2col path for the block alone (see the module docstring).
    A conv calls torch's oneDNN kernel directly (``_DIRECT``). Otherwise (a
    transposed conv, or a torch without that entry): the size rule reads dims 2
    and 3 only, so torch gets the block with its spatial dims reordered (a view;
    weight and arguments reordered alike), largest first, and the result is
    reordered back; where no order passes the rule, a conv converts the block to
    oneDNN's own layout. A large float32 3-D conv runs whole or in pieces of
    output rows, whichever ran faster the first time this rank met its
    signature (``tuned_conv``).

    ``agree``, a communicator, makes the call collective over it (every rank of
    it calls ``local_conv`` or ``agree_on_nothing`` together): the ranks choose
    one way for all (``_AGREED``).
    """
    tuned = output_padding is None and cells.dim() == 5 and cells.dtype == torch.float32 \
        and cells.device.type == "cpu" and TUNING and cells.numel() >= _TUNE_CELLS
    if tuned:
        return tuned_conv(func, cells, w, b, stride, padding, dilation, groups, agree)
    if agree is not None:
        agree_on_nothing(agree)
    return _conv(func, cells, w, b, stride, padding, dilation, groups, output_padding)


def _conv(func, cells, w, b, stride, padding, dilation, groups, output_padding=None):
    """``local_conv`` without the pieces."""
    transposed = output_padding is not None
    order = kernel_order(tuple(cells.shape), cells.dtype, cells.device.type, tuple(w.shape),
                         tuple(stride), tuple(padding), tuple(dilation), groups,
                         tuple(output_padding or ()))
    if order is not None and not transposed and _DIRECT is not None:
        return _DIRECT(cells, w, b, list(padding), list(stride), list(dilation), groups)
    if order == LAYOUT:
        return func(cells.to_mkldnn(), w, b, stride, padding, dilation, groups).to_dense()
    if order is not None:
        perm = (0, 1) + tuple(2 + o for o in order)
        inverse = tuple(perm.index(d) for d in range(len(perm)))
        cells, w = cells.permute(perm), w.permute(perm)
        stride, padding, dilation = ([v[o] for o in order] for v in (stride, padding, dilation))
        if transposed:
            output_padding = [output_padding[o] for o in order]
    if transposed:
        out = func(cells, w, b, stride, padding, output_padding, groups, dilation)
    else:
        out = func(cells, w, b, stride, padding, dilation, groups)
    return out if order is None else out.permute(inverse)


def local_conv_backward(grad, cells, weight, spec, mask):
    """Local. (grad of cells, of weight, of bias) of ``local_conv`` (not
    transposed), by the same spatial-dim order, so by the same kernel. ``spec``:
    anything with ``stride``, ``padding``, ``dilation``, ``groups`` (conv's
    ``ConvSpec``); ``mask``: which of the three gradients to compute."""
    stride, padding, dilation = spec.stride, spec.padding, spec.dilation
    order = kernel_order(tuple(cells.shape), cells.dtype, cells.device.type,
                         tuple(weight.shape), stride, padding, dilation, spec.groups, ())
    inverse = None
    if order == LAYOUT:
        grad, cells = grad.contiguous().to_mkldnn(), cells.contiguous().to_mkldnn()
    elif order is not None:
        perm = (0, 1) + tuple(2 + o for o in order)
        inverse = tuple(perm.index(d) for d in range(len(perm)))
        grad, cells, weight = grad.permute(perm), cells.permute(perm), weight.permute(perm)
        stride, padding, dilation = ([v[o] for o in order] for v in (stride, padding, dilation))
    g_in, g_w, g_b = torch.ops.aten.convolution_backward(
        grad, cells, weight, [weight.shape[0]] if mask[2] else None, list(stride),
        list(padding), list(dilation), False, [0] * len(stride), spec.groups, list(mask))
    if inverse is not None:
        g_in = None if g_in is None else g_in.permute(inverse)
        g_w = None if g_w is None else g_w.permute(inverse)
    if g_in is not None and g_in.layout != torch.strided:
        g_in = g_in.to_dense()
    return g_in, g_w, g_b


@functools.lru_cache(maxsize=1024)
def kernel_order(shape, dtype, device, w_shape, stride, padding, dilation, groups, out_pad):
    """Local, no tensor touched. A reordering of the spatial dims under which torch
    picks a oneDNN kernel where it would pick im2col for ``shape`` as it is;
    ``LAYOUT`` where no order does and oneDNN's own tensor layout will; None when
    there is no need or no way (or this torch lacks the private query)."""
    if len(shape) != 5 or device != "cpu" or dtype != torch.float32 or 0 in shape:
        return None
    if (all(k == 1 for k in w_shape[2:]) and all(s == 1 for s in stride)
            and not any(padding) and not any(out_pad)):
        # A 1x1x1 conv: torch's slow path builds no columns (it is one matrix
        # product), so it needs nothing from oneDNN; its layout would only add a
        # copy of the block each way, at backward's start, the step's peak.
        return None
    select = getattr(torch._C, "_select_conv_backend", None)
    if select is None:  # a torch without this (private) query: leave the choice to torch
        return None
    transposed = bool(out_pad)

    def backend(order):
        perm = (0, 1) + tuple(2 + o for o in order)
        x = torch.empty(1).expand([shape[d] for d in perm])
        w = torch.empty(1).expand([w_shape[d] for d in perm])
        pick = lambda v: [v[o] for o in order]  # noqa: E731
        return str(select(x, w, None, pick(stride), pick(padding), pick(dilation), transposed,
                          pick(out_pad) if transposed else [0, 0, 0], groups))

    try:
        if "Slow" not in backend((0, 1, 2)):
            return None
        order = tuple(sorted(range(3), key=lambda o: -shape[2 + o]))
        if "Slow" not in backend(order):
            return order
    except (RuntimeError, TypeError):
        return None
    # No order passes the size rule: a conv (not transposed) can still go to oneDNN
    # through oneDNN's own tensor layout (a copy of the block each way), 2.4x faster
    # with half the peak memory of im2col on a 1x4x34x64x64 block.
    return None if transposed else LAYOUT


# -- whole or in pieces --------------------------------------------------------------------------
# oneDNN's single-thread 3-D conv forward is much slower on some block shapes than
# on their neighbours, with no rule to tell them by: on this CPU (AMD EPYC, torch
# 2.13, 8 -> 4 channels, 128x128 planes) 757 us an output row at 64 rows and 60,
# 550-600 at 58-77 rows but for those two, 716-722 at 122 and 130. A 2-rank block of
# a 128^3 field has 64 rows. The same conv in 8 pieces of 8 rows took 39 ms against
# 51 whole; elsewhere pieces cost 0-20% more (a copy of the output, more calls).
# Under glibc's default malloc a whole conv of a large block also faults its output
# and oneDNN's scratch in afresh on each call (that conv: 82 ms whole, 38 in pieces).
# So a large conv is timed both ways the first time a rank meets its signature,
# and the faster way is kept for the process: like cuDNN's benchmark mode, a choice
# of speed only (the pieces compute every output from the same cells and weights;
# the numbers agree to float32 rounding, bitwise in the cases measured).
# DOMAINPAR_CONV_TUNING=0 turns it off (every conv whole): the timing costs the
# first call of each signature about 3 more convs (1.1-1.3 s on the first no_grad
# forward of a UNet3d at 128^3 on 2 ranks), which a job of one forward, or one whose
# block shapes keep changing, never repays.
_SETTING, _PROBLEM = switch("DOMAINPAR_CONV_TUNING")
if _PROBLEM:
    raise ValueError(_PROBLEM)
TUNING = _SETTING != "0"
_TUNE_CELLS = 1 << 21    # convs of at least this many input cells are timed
_TUNE_PIECES = 8         # the alternative: this many pieces of output rows,
_TUNE_ROWS = 8           # none thinner than this many rows
_TUNE_ROUNDS = 2         # each way timed this many times, after one run; the faster minimum wins
_CHOICES: dict[tuple, tuple | None] = {}   # signature -> row_pieces' plan (None: whole)
_TIMES: dict[tuple, tuple[float, float]] = {}  # signature -> this rank's (whole, pieces) minima
_MAX_CHOICES = 1024  # a bound for programs whose shapes never repeat: emptied when reached
_clock = time.perf_counter


def set_conv_tuning(on: bool) -> None:
    """Local. Turn the whole-or-pieces timing on or off (the DOMAINPAR_CONV_TUNING
    setting, for ``bench ... --compare``). Choices made before are kept and serve
    again when it is turned back on."""
    global TUNING
    TUNING = bool(on)


def row_pieces(padding, out_shape, count: int, min_rows: int):
    """Local. (dim, [(first, stop) output rows, ...]): at most ``count`` pieces of
    output rows, none thinner than ``min_rows``, split evenly along the outermost
    spatial dim that torch does not pad (padding 0: a piece there needs no padding
    of its own); None where there is no such dim or one piece will do."""
    for dim in range(2, len(out_shape)):
        if padding[dim - 2] == 0:
            break
    else:
        return None
    count = min(count, out_shape[dim] // min_rows)
    if count < 2:
        return None
    bounds = np.linspace(0, out_shape[dim], count + 1).round().astype(int)
    return dim, [(int(a), int(c)) for a, c in zip(bounds[:-1], bounds[1:]) if c > a]


def tuned_conv(func, cells, w, b, stride, padding, dilation, groups, agree=None):
    """Local (collective over ``agree`` where given). ``local_conv`` of a conv (not
    transposed), whole or in pieces of output rows: on this rank's first call with
    this signature, each way runs once and is then timed ``_TUNE_ROUNDS`` times,
    alternating, and the one with the smaller minimum is kept (the last result is
    returned: the extra calls are the cost). With ``agree``, the ranks' minima
    are reduced first (``_AGREED``) and every rank keeps the same way."""
    key = (tuple(cells.shape), tuple(cells.stride()), tuple(w.shape), b is None,
           tuple(stride), tuple(padding), tuple(dilation), groups)
    args = (func, cells, w, b, stride, padding, dilation, groups)
    if key in _CHOICES and agree is None:
        return _in_pieces(*args, _CHOICES[key])
    out_shape = [cells.shape[0], w.shape[0]] + [
        (n + 2 * p - d * (k - 1) - 1) // s + 1
        for n, k, s, p, d in zip(cells.shape[2:], w.shape[2:], stride, padding, dilation)]
    ways = [None, row_pieces(padding, out_shape, _TUNE_PIECES, _TUNE_ROWS)]
    out, minima = None, _TIMES.get(key, (0.0, 0.0))
    if ways[1] is not None and key not in _TIMES:
        times: list[list[float]] = [[], []]
        for timed in [False] + [True] * _TUNE_ROUNDS:  # first, untimed: oneDNN builds its kernels
            for way, took in zip(ways, times):
                out = None  # the previous run's output freed first: one alive at a time
                start = _clock()
                out = _in_pieces(*args, way)
                if timed:
                    took.append(_clock() - start)
        minima = (min(times[0]), min(times[1]))
    if len(_CHOICES) >= _MAX_CHOICES:
        _CHOICES.clear()
        _TIMES.clear()
    if ways[1] is not None:
        _TIMES[key] = minima  # this rank's own, for later agreements on this signature
    if agree is not None:
        minima = _slowest(minima, agree)
    _CHOICES[key] = ways[1] if ways[1] is not None and minima[1] < minima[0] else None
    if out is not None:
        return out
    return _conv(*args) if ways[1] is None else _in_pieces(*args, _CHOICES[key])


def agree_on_nothing(agree) -> None:
    """Collective over ``agree``. This rank's part in the ranks' choice of a conv
    it does not tune (a small, empty or other-typed block): no times."""
    _slowest((0.0, 0.0), agree)


def _slowest(minima: tuple[float, float], comm) -> tuple[float, float]:
    """Collective over ``comm``. Each way's largest minimum over the ranks."""
    both = collectives.allreduce(np.array(minima, dtype=np.float64), comm, "max", check=False)
    return float(both[0]), float(both[1])


# _AGREED: each rank times its own block, and where the two ways come close, noise
# decides, differently on different ranks: the rank that drew the slower way then
# holds the others up at every exchange after the conv (2 ranks of a 128^3 UNet3d:
# in 6 training jobs of 7 the ranks chose differently for some convs, and in the two
# `bench step` jobs that split the step, one rank's compute ran 18 and 25 ms a step
# longer than the other's). So a sharded conv's first forward (every rank of the
# grid calls it together) reduces the ranks' times by a MAX allreduce, each way's
# slowest rank, and all keep the way whose slowest rank is faster. A rank that does
# not tune the conv contributes zeros. Choices stay per local signature: where two
# convs share one on some rank, the later agreement serves both there (either way
# gives the same numbers).


def _in_pieces(func, cells, w, b, stride, padding, dilation, groups, plan):
    """Local. The conv of ``cells`` in the pieces of output rows of ``plan`` (dim,
    [(first, stop), ...]), or whole for None: each piece reads the input rows its
    outputs read, and is copied into one output."""
    if plan is None:
        return _conv(func, cells, w, b, stride, padding, dilation, groups)
    dim, rows = plan
    s, reach = stride[dim - 2], dilation[dim - 2] * (w.shape[dim] - 1)
    out = None
    for o0, o1 in rows:
        piece = _conv(func, cells.narrow(dim, o0 * s, (o1 - o0 - 1) * s + reach + 1), w, b,
                      stride, padding, dilation, groups)
        if out is None:
            shape = list(piece.shape)
            shape[dim] = rows[-1][1]
            out = piece.new_empty(shape)
        out.narrow(dim, o0, o1 - o0).copy_(piece)
    return out
