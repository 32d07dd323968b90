"""CPU oneDNN kernel selection for the local conv of a block: a workaround for
torch's size rule, on a private torch API. Local: no message; every function
here acts on this rank's tensors only.

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
rounding).

Torch version: checked on torch 2.13.0+cpu (tests/test_onednn.py: the private
query and the direct kernel exist, the query picks im2col for a thin block and
oneDNN for the reordered one, and every selected path matches torch's default).
The timings above are from commit ee1623b, which did not record its torch
version; those of ``_DIRECT`` from torch 2.13.0+cpu. If a torch release changes
the rule or drops either, tests/test_onednn.py says so.
"""
from __future__ import annotations

import functools

import torch

LAYOUT = "onednn-layout"  # kernel_order's answer: convert the block to oneDNN's layout

# torch's oneDNN conv kernel itself, under the size rule (public in the torch
# namespace, undocumented: checked on 2.13.0+cpu by tests/test_onednn.py). A conv's
# forward calls it on the block as it lies, where a reordered view made oneDNN
# copy the block into its layout and the output came back strided: 1x2x66x128x128
# -> 4 channels took 62-64 ms reordered (and made contiguous), 38 ms direct. Backward
# has no such entry (torch's convolution_backward applies the rule), so it keeps
# the reordering. None in a torch without it: the reordering then serves both.
_DIRECT = getattr(torch, "mkldnn_convolution", None)


def local_conv(func, cells, w, b, stride, padding, dilation, groups, output_padding=None):
    """Local. torch's conv (or transposed conv, given ``output_padding``) on this
    rank's cells, by oneDNN where torch would take its im2col path for the block
    alone (see the module docstring). A conv calls torch's oneDNN kernel
    directly (``_DIRECT``). Otherwise (a transposed conv, or a torch without that
    entry): the size rule reads dims 2 and 3 only, so torch gets the block with
    its spatial dims reordered (a view; weight and arguments reordered alike),
    largest first, and the result is reordered back; where no order passes the
    rule, a conv converts the block to oneDNN's own layout.
    """
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
