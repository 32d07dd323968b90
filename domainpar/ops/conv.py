"""Convolutions, 1-, 2- and 3-D, on inputs sharded along the batch dim and any
spatial dims (transposed convolutions: ``ops/conv_transpose.py``).

- conv: every rank fills ghost cells around its block (a halo fill, zero
  padding outside the domain, also on a periodic grid) and runs torch's conv on
  the cells its outputs read, in one Function (``HaloConv``) that saves only
  the block and the ghost slabs; where no gradient is wanted (``torch.no_grad``,
  inference) the same forward runs without the Function and saves nothing
  (``halo_conv``). Output layout: ``window.sliding``.
  ``padding_mode`` other than zeros reaches us as ``F.pad`` (nn.ConvNd pads
  first), which has its own rule.
- conv_transpose (``ops/conv_transpose.py``): the adjoint of a conv, by halo
  *accumulate*.

Weight and bias are replicated: they enter every block's computation through
``enter_domain``, so their gradient is the sum of the ranks' partial gradients
(or DomainParallel's deferred, bucketed sum). torch itself validates the
arguments first, on the meta device with the global shapes, so bad input gets
torch's own error on every rank before any message is sent.

Refused (UnsupportedOpError on every rank): the channel dim sharded; an
unbatched input; a DomainTensor as weight or bias.

The local call (torch's conv on a block, steered to oneDNN on CPU where torch's
size rule would pick im2col for a thin block) is ``ops/onednn.py``. A conv that
needs no ghost cells (no spatial dim sharded, or a kernel 1 wide, stride 1 and
unpadded along every sharded one: a 1x1 conv; no block empty there) runs on the
blocks as they are: a kernel 1 wide along every dim (stride 1, no padding, one
group) on the CPU as a matrix product per sample (``pointwise``: torch's conv
takes its slow path there); other float32 3-D convs through HaloConv with no ghost cells,
for the kernel choice; the others by torch's op.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

from ..autograd.primitives import accumulate_in_place, fill_in_place
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, op_name, register
from ..tensor.domain_tensor import DomainTensor
from ..tensor.params import enter_domain
from . import onednn, window
from .common import autocast_dtype, autocast_operands, bind
from .common import meta as _meta
from .onednn import local_conv, local_conv_backward, row_pieces

_CONV = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}


def per_dim(v, n: int) -> tuple:
    """Local. A conv argument (int, or one per spatial dim) as ``n`` values."""
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def check_operands(func, x, weight, bias, nsp: int) -> None:
    """x a batched DomainTensor with whole channels; weight and bias plain."""
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: only the input may be a DomainTensor")
    for what, t in (("weight", weight), ("bias", bias)):
        if isinstance(t, DomainTensor):
            raise UnsupportedOpError(f"{op_name(func)}: the {what} must be a plain (replicated) "
                                     f"tensor, not a DomainTensor")
    if x.ndim != nsp + 2:
        raise UnsupportedOpError(
            f"{op_name(func)} on a DomainTensor needs a batched input of {nsp + 2} dims "
            f"(N, C, spatial...), got {x.ndim}; unsqueeze a batch dim")
    if 1 in x._dec.shard:
        raise UnsupportedOpError(
            f"{op_name(func)}: the channel dim 1 is sharded ({layout.sharded_dims_text(x._dec)}); "
            f"redistribute so that channels are whole on every rank")


def enter_params(weight, bias, out_dec):
    """Collective the first time it sees a parameter (``enter_domain``). Weight
    and bias entering every block's computation (gradients summed); also for
    ``ops/conv_transpose.py``."""
    return (enter_domain(weight, out_dec, {}),
            None if bias is None else enter_domain(bias, out_dec, {}))


def whole_blocks(func, x: DomainTensor, weight, bias, out_dec, *options):
    """Collective (``enter_params``). No sharded spatial dim needs ghost cells:
    torch's op runs on the block as it is (conv and transposed conv)."""
    w, b = enter_params(weight, bias, out_dec)
    return DomainTensor(func(x._local, w, b, *options), out_dec)


def pointwise(x: DomainTensor, weight, bias, out_dec):
    """Collective (``enter_params``). A conv of kernel 1, stride 1, no padding and
    one group as a batched matrix product per sample, ``bias + W @ x`` over the
    block's cells (``torch.baddbmm``). Measured on torch 2.13.0, CPU, one thread,
    forward and backward: torch's conv takes its slow path for such a kernel,
    14.9 against 2.6 ms for 16 -> 1 channels over 2^18 cells (neuraloperator's
    projection), 4.9 against 4.1 ms for 8 -> 8 over 512^2, 1.8 against 1.4 ms for
    4 -> 4 over 64^3."""
    w, b = enter_params(weight, bias, out_dec)
    local = x._local
    n, cin, cout = local.shape[0], local.shape[1], w.shape[0]
    cells = local.reshape(n, cin, math.prod(local.shape[2:]))  # n may be 0 (an empty block)
    matrix = w.reshape(1, cout, cin).expand(n, cout, cin)
    out = (torch.bmm(matrix, cells) if b is None else
           torch.baddbmm(b.reshape(1, cout, 1), matrix, cells))
    return DomainTensor(out.view((n, cout) + tuple(local.shape[2:])), out_dec)


def padding_pairs(padding, kernel, dilation, nsp):
    """Local. (lo, hi) per spatial dim, as torch resolves ints, tuples, 'valid' and
    'same' (also for halo fusion's convs, nn/fusion.py)."""
    if padding == "valid":
        return [(0, 0)] * nsp
    if padding == "same":
        out = []
        for k, d in zip(kernel, dilation):
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        return out
    return [(p, p) for p in per_dim(padding, nsp)]


# -- plans -------------------------------------------------------------------------------------
def plan_key(func, x: DomainTensor, weight, bias, options: tuple):
    """Local. Everything a conv's plan (``_conv_plan``, ``_transposed_plan``)
    depends on: the input's layout and dtype (and autocast's, which the meta call
    sees), weight and bias shapes and dtypes, the other arguments, lists among
    them as tuples (torch reads both alike; nn.ConvTranspose given an
    ``output_size`` passes ``output_padding`` as a list, which would make the key
    unhashable and the plan made afresh on every call). None (no caching) for a
    weight or bias that is not a tensor: torch's error, uncached."""
    if not isinstance(weight, torch.Tensor) or not isinstance(bias, (torch.Tensor, type(None))):
        return None
    return (func, x._dec, x.dtype, autocast_dtype(x._local), weight.shape, weight.dtype,
            None if bias is None else (bias.shape, bias.dtype),
            tuple(tuple(o) if isinstance(o, list) else o for o in options))


def planned(key, make):
    """Local. ``make()``'s plan, cached under ``key`` (``layout.planned``); made
    afresh for a key of None (``plan_key``: a weight that is not a tensor)."""
    return make() if key is None else layout.planned(key, make)


@dataclasses.dataclass(frozen=True)
class _ConvPlan:
    """What a conv call derives from layouts and arguments alone: its output
    layout, the spec of its HaloConv (None: torch's op on the block as it is,
    for whole blocks other than float32 3-D ones with symmetric padding) and
    whether an exchange fills ghost cells."""
    out_dec: object
    spec: ConvSpec | None = None
    exchanged: bool = False
    pointwise: bool = False  # kernel 1, stride 1, no padding, one group: ``pointwise`` (CPU)


# -- conv ---------------------------------------------------------------------------------------
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


@register(*_CONV)
def conv(func, args, kwargs):
    """Neighbour-wise collective (halo fill; none where the kernel reaches no
    neighbour, a 1x1 conv: then a matrix product per sample where the kernel is 1
    wide along every dim). Sharded on batch and spatial dims; any stride, dilation,
    groups, padding (ints, tuples, 'same', 'valid')."""
    nsp = _CONV[func]
    a = bind(func, args, kwargs, _CONV_ARGS,
             {"stride": 1, "padding": 0, "dilation": 1, "groups": 1})
    x, weight, bias = a["input"], a["weight"], a["bias"]
    check_operands(func, x, weight, bias, nsp)
    options = tuple(a[n] for n in _CONV_ARGS[3:])
    key = plan_key(func, x, weight, bias, options)
    plan = planned(key, lambda: _conv_plan(func, x, weight, bias, options, nsp))
    if plan.pointwise and x._local.device.type == "cpu":  # where it was measured
        return pointwise(x, weight, bias, plan.out_dec)
    if plan.spec is None:
        return whole_blocks(func, x, weight, bias, plan.out_dec, *options)
    # Under autocast, cast as autocast would: HaloConv's backward runs outside it.
    block, w, b = autocast_operands(x._local, *enter_params(weight, bias, plan.out_dec))
    dec, spec = x._dec, plan.spec
    halo = None
    if plan.exchanged:
        halo = window.exchange(dec, dict(spec.widths), {d: False for d in dec.shard})
    agree = _first_forward(key, dec)
    return DomainTensor(halo_conv(block, w, b, halo, spec, agree), plan.out_dec)


_FIRST: set = set()  # conv plan keys whose first forward has run (the same on every rank)


def _first_forward(key, dec):
    """Local. The grid's communicator on the first forward of the conv ``key`` (its
    ranks then choose its kernel way together, ``onednn._AGREED``), else None. Every
    rank reaches a plan's first forward at the same call: the keys are global."""
    if key is None or key in _FIRST or not onednn.TUNING:
        return None
    if len(_FIRST) >= 1024:  # a bound for programs whose layouts never repeat
        _FIRST.clear()
    _FIRST.add(key)
    return dec.grid.comm


def _conv_plan(func, x: DomainTensor, weight, bias, options: tuple, nsp: int) -> _ConvPlan:
    """Local. torch's own checks and output shape (from global shapes on the meta
    device, on every rank alike), the output layout, and the HaloConv spec (no
    ghost cells where no sharded spatial dim needs any: a float32 3-D conv then
    still gets the local call's kernel choice)."""
    stride_a, padding_a, dilation_a, groups = options
    out_shape = tuple(func(_meta(x), _meta(weight), _meta(bias), *options).shape)
    dec = x._dec
    spatial = [d for d in range(2, x.ndim) if d in dec.shard]
    stride, dilation = per_dim(stride_a, nsp), per_dim(dilation_a, nsp)
    kernel = tuple(weight.shape[2:])
    pads = padding_pairs(padding_a, kernel, dilation, nsp)
    # A sharded dim that the kernel does not reach across (size 1, stride 1, no
    # padding: a 1x1 conv) keeps its blocks: the block's conv is the answer there
    # (torch refuses an empty one: the windowed path takes a layout that has one).
    if all(kernel[d - 2] == 1 and stride[d - 2] == 1 and pads[d - 2] == (0, 0)
           and min(dec.block_sizes(d)) > 0 for d in spatial):
        out_dec = window.out_layout(dec, out_shape)
        if groups == 1 and all(k == 1 for k in kernel) and all(s == 1 for s in stride) \
                and all(p == (0, 0) for p in pads):
            return _ConvPlan(out_dec, pointwise=True)
        if nsp != 3 or x.dtype != torch.float32 or any(lo != hi for lo, hi in pads):
            return _ConvPlan(out_dec)  # torch's op on the block as it is
        # Whole float32 3-D blocks (the batch dim sharded, or none) take the local call's
        # kernel choice too: torch alone runs a thin batch-1 block by im2col, ~3x slower
        # (1x8x32^3, 8 -> 8 channels, forward and backward: 27.4 against 6.9 ms).
        return _ConvPlan(out_dec, ConvSpec(func, tuple(stride), tuple(lo for lo, _ in pads),
                                           tuple(dilation), groups, (), (),
                                           out_dec.local_shape()))
    plans, torch_pads = {}, []
    for i, d in enumerate(range(2, x.ndim)):
        if d in spatial or pads[i][0] != pads[i][1]:
            plans[d] = window.sliding(x.shape[d], window.block_sizes(dec, d), out_shape[d],
                                      kernel[i], stride[i], dilation[i], pads[i][0])
            torch_pads.append(0)
        else:  # a whole dim with symmetric padding: torch pads it, cheaper in backward
            torch_pads.append(pads[i][0])
    out_dec = window.out_layout(dec, out_shape, plans)
    widths = {d: (p.lo, p.hi) for d, p in plans.items() if p.lo or p.hi}
    windows = {d: p.window(window.coordinate(dec, d)) for d, p in plans.items()}
    spec = ConvSpec(func, tuple(stride), tuple(torch_pads), tuple(dilation), groups,
                    tuple(sorted(widths.items())), tuple(sorted(windows.items())),
                    out_dec.local_shape())
    return _ConvPlan(out_dec, spec, any(d in dec.shard for d in widths))


@dataclasses.dataclass(frozen=True)
class ConvSpec:
    """Local. What ``HaloConv`` needs to run one rank's conv: torch's conv
    function and options, the ghost widths around the block, the window of
    cells this rank's outputs read, and this rank's output block shape.

    ``ConvSpec.no_halo`` builds one for a conv of a block that holds its ghost
    cells already (no halo to fill, every cell read)."""
    func: object
    stride: tuple
    padding: tuple   # torch's padding of the whole (unsharded) dims
    dilation: tuple
    groups: int
    widths: tuple    # ((dim, (lo, hi)), ...): ghost cells around the block
    windows: tuple   # ((dim, (start, length)), ...): the cells this rank's outputs read
    out_shape: tuple  # this rank's output block

    @classmethod
    def no_halo(cls, func, padding: tuple, dilation: tuple, groups: int,
                out_shape: tuple) -> ConvSpec:
        """Local. The spec of a stride-1 conv of a whole local tensor: no ghost
        cells, torch pads ``padding`` per spatial dim, output block ``out_shape``."""
        return cls(func, (1,) * len(padding), tuple(padding), tuple(dilation), groups,
                   (), (), tuple(out_shape))


class HaloConv(torch.autograd.Function):
    """Neighbour-wise collective (and collective over ``agree`` where given: the
    ranks' choice of the local kernel's way at a conv's first forward,
    ``onednn._AGREED``). A conv of this rank's cells: its block with ghost
    cells filled by ``halo`` (zero outside the domain), in one Function.

    The same as ``window.gather`` then torch's conv, with less memory. Forward
    writes the block once into a padded buffer and frees it after the conv; it
    saves the block and the (thin) ghost slabs, and backward rebuilds the buffer
    from them, a large one in pieces (``_padded_backward``). The block is what
    one process's conv saves, and it is alive anyway while the model's forward
    holds it; saving the padded copy instead would hold both. Backward
    accumulates the ghost gradients in place into the input gradient it has
    just made (ours alone, so in place is safe).
    """

    @staticmethod
    def forward(ctx, block, weight, bias, halo, spec: ConvSpec, agree=None):
        widths = dict(spec.widths)
        out, padded = _halo_conv_forward(block, weight, bias, halo, spec, agree)
        ctx.slabs = [(d, start, padded.narrow(d, start, size).clone())
                     for d, (lo, hi) in widths.items()
                     for start, size in ((0, lo), (lo + block.shape[d], hi)) if size]
        ctx.save_for_backward(block, weight)
        ctx.halo, ctx.spec, ctx.has_bias = halo, spec, bias is not None
        ctx.padded_shape, ctx.block_shape = tuple(padded.shape), tuple(block.shape)
        return out

    @staticmethod
    def backward(ctx, grad):
        block, weight = ctx.saved_tensors
        spec = ctx.spec
        need_in, need_w, need_b = ctx.needs_input_grad[:3]
        mask = (need_in, need_w, need_b and ctx.has_bias)
        if 0 in spec.out_shape[2:]:
            g_padded = block.new_zeros(ctx.padded_shape) if need_in else None
            g_w = torch.zeros_like(weight) if need_w else None
            g_b = weight.new_zeros(weight.shape[0]) if mask[2] else None
        else:
            g_padded, g_w, g_b = _padded_backward(grad, block, weight, ctx.slabs, spec,
                                                  ctx.padded_shape, mask)
        g_block = None
        if need_in:
            assert g_padded is not None  # made above whenever need_in
            if ctx.halo is not None:
                accumulate_in_place(g_padded, ctx.halo)
            g_block = g_padded
            for d, (lo, _) in spec.widths:
                g_block = g_block.narrow(d, lo, ctx.block_shape[d])
        return g_block, g_w, g_b, None, None, None


def halo_conv(block, weight, bias, halo, spec: ConvSpec, agree=None) -> torch.Tensor:
    """Neighbour-wise collective (and over ``agree``), as ``HaloConv``. Its output;
    where no gradient is wanted (grad mode off, or no operand requiring one) the
    same forward without an autograd node and without the ghost slabs it would
    save: an inference forward copies no slab and keeps none."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (block, weight, bias)):
        return HaloConv.apply(block, weight, bias, halo, spec, agree)
    return _halo_conv_forward(block, weight, bias, halo, spec, agree)[0]


def _halo_conv_forward(block, weight, bias, halo, spec: ConvSpec, agree):
    """(output, padded buffer) of HaloConv's forward: the block written into a
    padded buffer, ghost cells filled by ``halo``, the local conv of the cells
    this rank's outputs read."""
    padded = _padded_block(block, dict(spec.widths))
    if halo is not None:
        fill_in_place(padded, halo)
    if 0 in spec.out_shape[2:]:
        if agree is not None:
            onednn.agree_on_nothing(agree)
        return block.new_zeros(spec.out_shape), padded
    return local_conv(spec.func, _cells(padded, spec), weight, bias, spec.stride, spec.padding,
                      spec.dilation, spec.groups, agree=agree), padded


# Backward rebuilds the padded block from the saved block and ghost slabs. Whole,
# that is a copy of the conv's input alive beside every saved activation, the
# gradient and the input gradient: the training step's peak. So a large block is
# rebuilt and differentiated in pieces of output rows along one dim, each piece
# holding the input rows its outputs read; the pieces' input gradients overlap by
# the kernel's reach and add up. The conv's work is the same (each output row is
# differentiated once); what is added is a copy of each piece's gradient rows.
_PIECES = 8              # at most this many pieces: the copy at the peak is 1/8 of the block
_PIECE_CELLS = 1 << 14   # but none smaller than this many cells (64 KiB of float32)
_PIECE_ROWS = 8          # nor thinner than this many output rows
# Thin pieces cost more than they save: each is a conv backward of its own, and
# oneDNN is slow on slabs a few rows thin (a 8 -> 4 channel conv on 1x8x32x64x64:
# 40 ms in 8 pieces of 4 rows, 30 ms in 4 of 8). A UNet3d step (1x2x64^3, 2 ranks)
# took 1.13-1.14x as long with pieces of 1 row up, at the same peak (43.5 MiB).


@contextlib.contextmanager
def backward_in_pieces_at_any_size():
    """Within it, every conv backward goes in pieces however small its block (as
    many as its output rows allow, up to ``_PIECES``). For ``domainpar plan``:
    its scaled-down blocks must hold at the peak what the full-size blocks of
    the run it plans hold, and those are cut."""
    global _PIECE_CELLS, _PIECE_ROWS
    saved, _PIECE_CELLS, _PIECE_ROWS = (_PIECE_CELLS, _PIECE_ROWS), 1, 1
    try:
        yield
    finally:
        _PIECE_CELLS, _PIECE_ROWS = saved


def _padded_backward(grad, block, weight, slabs, spec: ConvSpec, padded_shape, mask):
    """(grad of the padded block, of weight, of bias) of HaloConv's conv."""
    widths, windows = dict(spec.widths), dict(spec.windows)
    pieces = _row_pieces(spec, padded_shape)
    if pieces is None:  # small: the whole padded block at once
        padded = _padded_rows(block, slabs, widths, padded_shape, 2, 0, padded_shape[2])
        g_cells, g_w, g_b = local_conv_backward(grad, _cells(padded, spec), weight, spec, mask)
        del padded
        if not mask[0] or tuple(g_cells.shape) == tuple(padded_shape):
            return (None if g_cells is None else g_cells.contiguous()), g_w, g_b
        g_padded = g_cells.new_zeros(padded_shape)
        _cells(g_padded, spec).copy_(g_cells)
        return g_padded, g_w, g_b

    dim, rows = pieces
    s, reach = spec.stride[dim - 2], spec.dilation[dim - 2] * (weight.shape[dim] - 1)
    start = windows.get(dim, (0, padded_shape[dim]))[0]  # of the cells this rank's outputs read
    others = tuple((d, w) for d, w in spec.windows if d != dim)
    g_padded = block.new_zeros(padded_shape) if mask[0] else None
    g_w = g_b = None
    for o0, o1 in rows:
        p0, p1 = start + o0 * s, start + (o1 - 1) * s + reach + 1
        piece = _padded_rows(block, slabs, widths, padded_shape, dim, p0, p1)
        gi, gw, gb = local_conv_backward(grad.narrow(dim, o0, o1 - o0),
                                         _narrowed(piece, others), weight, spec, mask)
        del piece
        if gi is not None:
            assert g_padded is not None  # a grad of the input only when mask[0]
            _narrowed(g_padded.narrow(dim, p0, p1 - p0), others).add_(gi)
        g_w = gw if g_w is None else g_w.add_(gw)
        g_b = gb if g_b is None else g_b.add_(gb)
    return g_padded, g_w, g_b


def _row_pieces(spec: ConvSpec, padded_shape):
    """(dim, [(first, stop) output rows, ...]) for a piecewise backward, along the
    outermost spatial dim torch does not pad itself; None when one piece will do."""
    count = min(_PIECES, int(np.prod(padded_shape)) // _PIECE_CELLS)
    return row_pieces(spec.padding, spec.out_shape, count, _PIECE_ROWS)


def _padded_rows(block, slabs, widths: dict, padded_shape, dim: int, start: int, stop: int):
    """Rows ``[start, stop)`` along ``dim`` of the padded block (the block with its
    ghost slabs around it), built without the rest of it. Every cell is either
    the block's or in the slab of a dim along which it is a ghost cell."""
    if not slabs and not any(lo or hi for lo, hi in widths.values()) \
            and (start, stop) == (0, block.shape[dim]):
        return block
    shape = list(padded_shape)
    shape[dim] = stop - start
    piece = block.new_empty(shape)
    lo = widths.get(dim, (0, 0))[0]
    first, last = max(start, lo), min(stop, lo + block.shape[dim])
    if last > first:
        inner = piece.narrow(dim, first - start, last - first)
        for d, (w_lo, _) in widths.items():
            if d != dim:
                inner = inner.narrow(d, w_lo, block.shape[d])
        inner.copy_(block.narrow(dim, first - lo, last - first))
    for d, at, slab in slabs:  # slabs overlap at corners, with equal values
        if d != dim:
            piece.narrow(d, at, slab.shape[d]).copy_(slab.narrow(dim, start, stop - start))
            continue
        a, b = max(start, at), min(stop, at + slab.shape[d])
        if b > a:
            piece.narrow(dim, a - start, b - a).copy_(slab.narrow(dim, a - at, b - a))
    return piece


def _narrowed(t: torch.Tensor, windows) -> torch.Tensor:
    """``t`` narrowed to ``windows`` ((dim, (start, length)), ...), a view."""
    for d, (start, length) in windows:
        if (start, length) != (0, t.shape[d]):
            t = t.narrow(d, start, length)
    return t


def _cells(padded: torch.Tensor, spec: ConvSpec) -> torch.Tensor:
    """The part of the padded block this rank's outputs read (a view)."""
    return _narrowed(padded, spec.windows)


def _padded_block(block: torch.Tensor, widths: dict) -> torch.Tensor:
    """``block`` copied into a new buffer with ``widths`` zero ghost cells per dim
    (``block`` itself when there are none)."""
    if not any(lo or hi for lo, hi in widths.values()):
        return block
    shape = [n + sum(widths.get(d, (0, 0))) for d, n in enumerate(block.shape)]
    padded = block.new_empty(shape)
    inner = padded
    for d, (lo, hi) in widths.items():
        padded.narrow(d, 0, lo).zero_()
        padded.narrow(d, lo + block.shape[d], hi).zero_()
        inner = inner.narrow(d, lo, block.shape[d])
    inner.copy_(block)
    return padded
