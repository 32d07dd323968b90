"""The elementwise halves of the sharded norms: (x - mean) * invstd * weight +
bias on this rank's block, with the statistics ``norm.moments`` took over the
ranks that share them.

``Affine`` is the general one: autograd carries the statistics' dependence on
the block through ``norm.moments`` and the broadcast that enters them, so its
backward reads and writes the block about a dozen times with the moments'.
``GroupAffine`` (float32 and float64 group_norm) does what torch's CPU kernel
does:

- forward: y = x * a + c, a = invstd * weight and c = bias - mean * a per
  (sample, channel) (torch's kernel has the same form, and so errors of the
  same size under a large offset);
- backward: per (sample, channel) sums of g and of g * x over the block,
  summed over each group and then over the ranks that share the group
  (``comm``: one allreduce of two numbers per (sample, group), in place of the
  moments' and the statistics' two), and the input gradient
  dx = coef * g + k1 * x + k0.

Where the C row loops take the block (``rowwise.usable``: CPU, one torch
thread), ``GroupNormRows`` runs the whole group norm instead, statistics
included: each pass over the block is one C loop (the moments in two reads,
the forward map, both sums in one read of g and x, dx), and so is the
arithmetic on the few numbers per (sample, group) between them, in double.
Elsewhere ``GroupAffine`` runs torch's ops, which take two passes forward
(``_AFFINE_PASSES``) and five backward (the product g * x is written out
before its sum), after ``norm.moments``.

With n the group's cells over all ranks, r = invstd, w the channel's weight,
A = sum(w g) and B = sum(w g (x - mean)) over the whole group:
dx = r w g - (r / n) A - (r^3 / n) B (x - mean). The weight and bias gradients
are this block's sums; ``enter_domain`` sums them over the ranks as it does
for every parameter.
"""
from __future__ import annotations

import torch
from mpi4py import MPI
from torch.autograd.function import once_differentiable

from .. import autograd as ag
from ..comm import collectives
from . import rowwise


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The type torch's CPU and CUDA kernels compute a half type in: float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class Affine(torch.autograd.Function):
    """Local. (x - mean) * invstd * weight + bias, every operand broadcast against
    x (weight and bias may be None). Saves x and the small operands only (torch's
    fused kernels save no more); backward forms (x - mean) again, which keeps the
    weight and statistics gradients exact under a large offset. A half-type x
    (autocast) is computed in float32 and the result rounded to x's type, as
    torch's mixed-type kernels do; x is saved as it is."""

    @staticmethod
    def forward(ctx, x, mean, invstd, weight, bias):
        scale = invstd if weight is None else invstd * weight
        out = (x.to(opmath(x.dtype)) - mean).mul_(scale)
        if bias is not None:
            out.add_(bias)
        ctx.save_for_backward(x, mean, invstd, weight)
        ctx.bias_shape = None if bias is None else bias.shape
        return out if x.dtype == opmath(x.dtype) else out.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, mean, invstd, weight = ctx.saved_tensors
        x_type, x, g = x.dtype, x.to(opmath(x.dtype)), g.to(opmath(g.dtype))
        need_x, need_mean, need_inv, need_w, need_b = ctx.needs_input_grad
        scale = invstd if weight is None else invstd * weight
        gx = gmean = ginv = gw = gb = None
        if need_x or need_mean:
            gs = g * scale
            gx = gs.to(x_type) if need_x else None
            gmean = -gs.sum_to_size(mean.shape) if need_mean else None
        if need_inv or need_w:
            gdev = g * (x - mean)
            if need_inv:
                ginv = (gdev if weight is None else gdev * weight).sum_to_size(invstd.shape)
            if need_w:
                gw = (gdev * invstd).sum_to_size(weight.shape)
        if need_b:
            gb = g.sum_to_size(ctx.bias_shape)
        return gx, gmean, ginv, gw, gb


class GroupAffine(torch.autograd.Function):
    """Local forward; collective backward over ``comm`` (one allreduce) where
    the input's gradient is needed, on every rank of ``comm`` alike. torch's ops
    (``GroupNormRows`` is the C loops' group norm).

    ``x`` is the block viewed as (N, G, C/G, cells), ``mean`` and ``invstd``
    (N, G, 1, 1) the statistics of the whole groups (constants here: their
    dependence on x is in this backward), ``weight`` and ``bias`` (1, G, C/G, 1)
    or None, ``count`` the cells of one group over all ranks of ``comm``, and
    ``out`` a buffer shaped like x that becomes the output (the moments' scratch
    before: one block-sized allocation for both)."""

    @staticmethod
    def forward(ctx, x, mean, invstd, weight, bias, comm: MPI.Comm, count: int, out):
        a = invstd if weight is None else invstd * weight
        c = -mean * a if bias is None else bias - mean * a
        ctx.save_for_backward(x, mean, invstd, weight)
        ctx.comm, ctx.count, ctx.has_bias = comm, count, bias is not None
        ctx.mark_dirty(out)
        return torch.mul(x, a, out=out).add_(c)  # see _AFFINE_PASSES

    @staticmethod
    @once_differentiable  # the allreduce inside is not: a second derivative raises
    def backward(ctx, g):
        x, mean, invstd, weight = ctx.saved_tensors
        need_x, _, _, need_w, need_b = ctx.needs_input_grad[:5]
        sg = g.sum(-1, keepdim=True)
        buf = torch.empty_like(x) if need_x or need_w else None  # g * x, then dx
        sgx = None if buf is None else _row_dots(g, x, buf)
        gx = gw = gb = None
        if need_x:
            assert sgx is not None and buf is not None  # made above whenever need_x
            w = 1.0 if weight is None else weight
            ab = torch.stack([(w * sg).sum(2, keepdim=True),
                              (w * (sgx - mean * sg)).sum(2, keepdim=True)])
            if ctx.comm.Get_size() > 1:
                ab = ag.allreduce_tensor(ab, ctx.comm)
            inv_n = 1.0 / max(ctx.count, 1)
            k1 = -(invstd ** 3) * ab[1] * inv_n
            k0 = -invstd * ab[0] * inv_n - k1 * mean
            gx = torch.mul(x, k1, out=buf).add_(k0).addcmul_(g, invstd * w)  # _AFFINE_PASSES
        if need_w:
            assert sgx is not None
            gw = (invstd * (sgx - mean * sg)).sum(0, keepdim=True)
        if need_b and ctx.has_bias:
            gb = sg.sum(0, keepdim=True)
        return gx, None, None, gw, gb, None, None, None


class GroupNormRows(torch.autograd.Function):
    """Collective over ``comm``: one allreduce forward, and one backward where the
    input's gradient is needed, on every rank of ``comm`` alike. The group norm
    of this rank's block ``x`` (N, C, cells...: contiguous float32 or float64 on
    the CPU, ``rowwise.usable``) with the statistics of whole groups over the
    blocks of ``comm``'s members; ``counts`` (float64, one per member) their
    cells of one group, ``count`` the sum of those, ``groups`` of ``per``
    channels in the block (C = groups * per, maybe 0), ``weight`` and ``bias``
    (C,) of x's type or None.

    Forward: each member's moments per (sample, group), exchanged as rows of a
    zero buffer (adding zeros is exact: every rank combines the same bits),
    combined by ``rowwise.group_coefs`` into each row's y = x * a + c. Backward:
    the rows' sums of g and g * x, the groups' A and B summed over the members,
    dx = x * a + c + g * b per row. Saves x (as torch's kernel does) and the
    groups' float64 statistics."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm: MPI.Comm, counts: torch.Tensor, count: float,
                groups: int, per: int, eps: float):
        ng = x.shape[0] * groups
        members, me = comm.Get_size(), comm.Get_rank()
        stats = torch.zeros(members, 2, ng, dtype=torch.float64)
        rowwise.moments(x, ng, stats[me, 0], stats[me, 1])
        if members > 1:
            collectives.allreduce(stats.numpy(), comm, "sum", check=False)
        mean, invstd, a, c = rowwise.group_coefs(stats, counts, groups, per, eps, weight, bias,
                                                 x.dtype)
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.groups, ctx.per, ctx.stats = comm, groups, per, (mean, invstd)
        ctx.count, ctx.has_bias = count, bias is not None
        return rowwise.affine(x, a, c, torch.empty_like(x))

    @staticmethod
    @once_differentiable  # the allreduce inside is not: a second derivative raises
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = g.to(x.dtype).contiguous()
        mean, invstd = ctx.stats
        groups, per, w = ctx.groups, ctx.per, weight
        rows = x.shape[0] * groups * per
        sg, sgx = rowwise.dots(g, x, rows)
        if need_x:
            ab = rowwise.group_grad_sums(sg, sgx, mean, groups, per, w, x.dtype)
            if ctx.comm.Get_size() > 1:
                collectives.allreduce(ab.numpy(), ctx.comm, "sum", check=False)
        else:  # only the parameters' gradients, this block's sums: no message
            ab = torch.zeros(2, mean.numel(), dtype=torch.float64)
        a, c, b, gw, gb = rowwise.group_grad_coefs(ab, mean, invstd, groups, per, w, ctx.count,
                                                   sg, sgx, x.dtype)
        gx = rowwise.affine(x, a, c, torch.empty_like(x), g, b) if need_x else None
        gw = gw.to(x.dtype) if need_w else None  # weight: x's type (rowwise.usable)
        gb = gb.to(x.dtype) if need_b and ctx.has_bias else None  # bias: x's type
        return gx, gw, gb, None, None, None, None, None, None


# _AFFINE_PASSES: x * a + c for a block x and small per-(sample, channel) a and c is
# a mul into the output, then add_: two passes. torch's one-pass addcmul(c, x, a), whose
# output takes its shape from broadcasting the small c, ran 3.5x slower on the CPU
# (torch 2.13, 1x2x2x131072 float32: 215 us against 63 us; the in-place addcmul_
# into a full-size tensor is not affected: 51 us).


def _row_dots(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """sum(g * x) over the last dim, keeping it (size 1): torch's product, written
    into ``out`` when given (else a temporary as large as g), and its cascaded sum.
    On this CPU (torch 2.13, MKL), float32, 4 rows of 131072: 78 us as vecdot, a BLAS
    dot per row 50 us, the batched bmm of 1 x n by n x 1 385 us; the relative error
    of a row of 2^21 positive terms 7e-8, 8e-6 and 1e-3."""
    return torch.mul(g, x, out=out).sum(-1, keepdim=True)
