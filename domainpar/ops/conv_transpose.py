"""Transposed convolutions, 1-, 2- and 3-D, on inputs sharded along the batch
dim and any spatial dims: the adjoint of a conv (``ops/conv.py``, whose
operand checks, plans and parameter entry this module shares).

Every rank runs torch's transposed conv on its block alone; the result covers
its own output cells and spills over its neighbours'. The spill travels by halo
*accumulate*, which adds it into its owners' cells. Output block of coordinate
``c`` starts at ``offset[c] * stride``. Refusals as for conv.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch.nn.functional as F

from .. import autograd as ag
from ..tensor.dispatch import register
from ..tensor.domain_tensor import DomainTensor
from . import window
from .common import autocast_operands, bind
from .common import meta as _meta
from .conv import check_operands, enter_params, per_dim, plan_key, planned, whole_blocks
from .onednn import local_conv

_CONV_T = {F.conv_transpose1d: 1, F.conv_transpose2d: 2, F.conv_transpose3d: 3}


@functools.lru_cache(maxsize=1024)
def transposed_plan(n: int, in_sizes: tuple[int, ...], m: int, kernel: int, stride: int,
                    dilation: int, pad: int) -> window.AxisPlan:
    """A transposed conv is a windowed op read backwards: input cell ``i`` adds
    into the outputs ``[i * stride - pad, ... + dilation * (kernel - 1)]``, so
    ``window.plan_axis`` with the input cells in the role of its outputs and
    the output blocks in the role of its input blocks gives each output block's
    reach (``need``) and the widest spill past it (``lo``/``hi``: the ghost widths
    of the accumulate). The output block of coordinate ``c`` starts at
    ``offset[c] * stride`` (clipped to the output), and each input block keeps
    its own cells: the ownership is given, not derived from anchors."""
    in_offsets = np.concatenate(([0], np.cumsum(in_sizes)[:-1])).astype(np.int64)
    out_starts = np.minimum(in_offsets * stride, m)
    out_starts[0] = 0
    out_sizes = np.diff(np.append(out_starts, m))
    first = np.arange(n, dtype=np.int64) * stride - pad
    spill = window.plan_axis(first, first + dilation * (kernel - 1), None, out_sizes,
                             starts=in_offsets)
    # plan_axis's "outputs" were the input cells: the blocks are the output's.
    return dataclasses.replace(spill, out_sizes=tuple(int(s) for s in out_sizes),
                               out_offsets=spill.in_offsets)


def _transposed_plan(func, x: DomainTensor, weight, bias, options: tuple):
    """Local. torch's own checks and output shape (meta device, global shapes), the
    output layout and the ``transposed_plan`` of each sharded spatial dim ({} when
    none is sharded)."""
    nsp = _CONV_T[func]
    out_shape = tuple(func(_meta(x), _meta(weight), _meta(bias), *options).shape)
    dec = x._dec
    stride_a, padding_a, _, _, dilation_a = options
    stride, dilation = per_dim(stride_a, nsp), per_dim(dilation_a, nsp)
    padding, kernel = per_dim(padding_a, nsp), tuple(weight.shape[2:])
    plans = {}
    for i, d in enumerate(range(2, x.ndim)):
        if d in dec.shard:
            plans[d] = transposed_plan(x.shape[d], dec.block_sizes(d), out_shape[d], kernel[i],
                                       stride[i], dilation[i], padding[i])
    return window.out_layout(dec, out_shape, plans), plans


_CONV_T_ARGS = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups",
                "dilation")


@register(*_CONV_T)
def conv_transpose(func, args, kwargs):
    """Neighbour-wise collective (halo accumulate). Sharded on batch and spatial dims;
    any stride, padding, output_padding, dilation and groups."""
    nsp = _CONV_T[func]
    a = bind(func, args, kwargs, _CONV_T_ARGS,
             {"stride": 1, "padding": 0, "output_padding": 0, "groups": 1, "dilation": 1})
    x, weight, bias = a["input"], a["weight"], a["bias"]
    check_operands(func, x, weight, bias, nsp)
    options = tuple(a[n] for n in _CONV_T_ARGS[3:])
    out_dec, plans = planned(plan_key(func, x, weight, bias, options),
                              lambda: _transposed_plan(func, x, weight, bias, options))
    if not plans:
        return whole_blocks(func, x, weight, bias, out_dec, *options)
    dec = x._dec
    stride, dilation = per_dim(a["stride"], nsp), per_dim(a["dilation"], nsp)
    padding, out_pad = list(per_dim(a["padding"], nsp)), list(per_dim(a["output_padding"], nsp))
    for d in plans:
        padding[d - 2] = out_pad[d - 2] = 0  # the sharded dims are cut to size below
    # Under autocast, cast as autocast would: the bias is added after torch's op.
    local, w, b = autocast_operands(x._local, *enter_params(weight, bias, out_dec))

    # This rank's contributions, placed in its output block padded by the spill widths.
    padded_shape = list(local.shape[:2]) + list(out_dec.local_shape()[2:])
    padded_shape[1] = out_dec.global_shape[1]
    for d, p in plans.items():
        padded_shape[d] += p.lo + p.hi
    if 0 in local.shape[2:]:
        contrib = window.placeholder(padded_shape, local, local, w)
    else:
        contrib = local_conv(func, local, w, None, stride, padding, dilation, a["groups"],
                             out_pad)
        pads = []
        for d in reversed(range(local.ndim)):
            if d in plans:
                p, c = plans[d], window.coordinate(dec, d)
                start, _ = p.window(c)  # where its contributions begin in the padded block
                pads += [start, padded_shape[d] - start - contrib.shape[d]]
            else:
                pads += [0, 0]
        contrib = F.pad(contrib, pads)
    widths = {d: (p.lo, p.hi) for d, p in plans.items() if p.lo or p.hi}
    if widths:
        contrib = ag.halo_accumulate(
            contrib, window.exchange(out_dec, widths, {d: False for d in out_dec.shard}))
        for d, (lo, _) in widths.items():
            contrib = contrib.narrow(d, lo, out_dec.local_shape()[d])
    if b is not None:
        contrib = contrib + b.reshape((1, -1) + (1,) * nsp)
    return DomainTensor(contrib, out_dec)
