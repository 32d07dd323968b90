"""Normalization: batch_norm, instance_norm, group_norm and layer_norm on
DomainTensors (and the nn modules built on them: BatchNorm1d/2d/3d,
InstanceNorm1d/2d/3d, GroupNorm, LayerNorm).

Each op normalizes over a set of *reduced* dims, with one (mean, variance)
statistic per index of the other dims:

- batch_norm: every dim but the channel dim 1 (per channel);
- instance_norm: the spatial dims (per sample and channel);
- group_norm: the channels of a group and the spatial dims (per sample and group);
- layer_norm: the trailing ``normalized_shape`` dims (per leading index).

When no reduced dim is cut over more than one process (``layout.cut``: a
one-rank grid, a cut batch dim, dims sharded on grid axes of one process) the
op is local: torch's own kernel runs on the block, with weight and bias entered
as below; where running statistics are updated, only when no dim at all is cut
(the block is then the whole tensor). Otherwise the statistics are a
collective over the grid axes that cut the reduced dims:

1. each rank takes its block's moments (count n_i, mean_i, M2_i) in two
   passes (the mean, then the squared deviations; outside a graph, over
   trailing dims, in C, ``ops.rowwise``, two reads); n_i follows from the
   layout, no message carries it; an empty block has n_i = 0 and stays in the
   autograd graph;
2. every rank gets every rank's (mean_i, M2_i): each writes its pair into its
   row of a zero [P, 2, ...] tensor, summed by an allreduce, differentiable
   where the statistics need a gradient (adding zeros is exact, so every rank
   holds the same bits);
3. the live blocks' rows are combined with Chan's parallel formula,
   mean = sum n_i mean_i / n and M2 = sum M2_i + n_i (mean_i - mean)^2, never
   as E[x^2] - E[x]^2 (which loses every digit when the mean is large), by
   the same ops on every rank, so the result is bitwise identical on all;
4. mean and 1/sqrt(var + eps) enter the block's normalization through
   ``ag.broadcast``, whose backward sums their gradients over the ranks.

Backward is autograd's through these steps; the elementwise normalization
(``Affine``) saves the input block, not a normalized copy of it, and computes
its gradients from (x - mean), which stays exact under a large offset. A
float32 or float64 group_norm instead takes steps 1-3 without a graph and
fuses step 4 with its backward as torch's kernel does (``ops.affine``):
no graph through the moments, fewer passes over the block than autograd's
way, and one allreduce in backward. Where the C loops take the block
(``rowwise.usable``) all of it runs in C, ``GroupNormRows``: each pass one
loop, the arithmetic per (sample, group) in double (a 1x32x4x8x8 block on 2
ranks, forward and backward: 262 us against 434 with torch's small ops).

Weight and bias are replicated and enter through ``enter_domain``: sliced to
the block where their dim is sharded (channels of batch/instance/group norm,
sharded dims of a layer norm's ``normalized_shape``), with their gradient
summed over the ranks.

Running statistics (batch_norm and instance_norm in training) are updated in
place on every rank with the same numbers, momentum as given and the unbiased
variance, as torch does: per-channel values of a sharded channel dim are
assembled by a zero-padded allreduce (exact), and instance_norm's average over
a sharded batch sums per-rank rows in rank order. Every rank therefore ends
with bitwise identical running statistics.

Sharded dims: any. batch_norm's statistics reduce over a sharded batch dim (its
grid axis joins the communicator); instance, group and layer norm are per
sample and need no message along the batch dim. A sharded channel dim works
for batch_norm and instance_norm (statistics are per channel).

Refused (UnsupportedOpError, on every rank alike):

- group_norm with the channel dim sharded where a block boundary splits a
  group (every block size along the channel dim must be a multiple of
  channels / num_groups);
- any DomainTensor among running_mean, running_var, weight and bias (they are
  plain, replicated tensors).

torch validates the arguments first, on the meta device with the global
shapes (once per signature), so bad input gets torch's own error on every rank
before any message.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from mpi4py import MPI

from .. import autograd as ag
from ..comm.decomposition import Decomposition
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, op_name, register
from ..tensor.domain_tensor import DomainTensor
from ..tensor.params import enter_domain
from . import rowwise, window
from .affine import Affine, GroupAffine, GroupNormRows, opmath
from .common import bind, meta_call, signature, stand_in


# -- arguments ---------------------------------------------------------------------------------
def torch_checks(func, *args) -> None:
    """torch's own argument errors, from the global shapes on the meta device, on
    every rank alike before any message (``common.meta_call``: cached per signature,
    errors not cached)."""
    meta_call(func, *(stand_in(a) for a in args))


def _check_operands(func, x, **plain) -> None:
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: only the input may be a DomainTensor")
    for what, t in plain.items():
        if isinstance(t, DomainTensor):
            raise UnsupportedOpError(f"{op_name(func)}: {what} must be a plain (replicated) "
                                     f"tensor, not a DomainTensor")


# -- statistics -------------------------------------------------------------------------------
def _block_statistics(dec: Decomposition, dims, tracked: bool = False) -> bool:
    """Local. Whether the statistics over ``dims`` are this block's own, so that
    torch's kernel on the block gives them: no reduced dim is cut over more than
    one process, and, where running statistics are updated (``tracked``), no dim
    at all (torch's kernel updates them from the block, which is then the whole
    tensor)."""
    return not any(layout.cut(dec, d) for d in (dec.shard if tracked else dims))


def _axes(dec: Decomposition, dims) -> list[int]:
    """The grid axes that cut ``dims``, in increasing order (sub-communicator order)."""
    return sorted(dec.shard[d] for d in dims if d in dec.shard)


def _member_counts(dec: Decomposition, dims, comm: MPI.Cartcomm, base: int) -> list[int]:
    """Element count of each member's block over the reduced ``dims``, in ``comm``'s
    rank order: ``base`` (the unsharded reduced extents) times the member's block
    sizes along the sharded ones. From the layout alone, no message."""
    sharded = [d for d in dims if d in dec.shard]
    if comm.Get_size() == 1:
        return [base * math.prod(dec.local_shape()[d] for d in sharded)]
    axes = _axes(dec, dims)
    counts = []
    for i in range(comm.Get_size()):
        coords = comm.Get_coords(i)
        n = base
        for d in sharded:
            n *= dec.block_sizes(d)[coords[axes.index(dec.shard[d])]]
        counts.append(n)
    return counts


def _statistics_plan(dec: Decomposition, dims) -> tuple[MPI.Cartcomm, tuple[int, ...]]:
    """Collective on the first use of the sub-communicator. The communicator over
    the axes that cut the reduced ``dims`` and each member's element count over
    them (``_member_counts``): planned per layout and dims."""
    dims = tuple(dims)

    def make():
        comm = layout.comm_of(dec, dims)
        base = math.prod(dec.global_shape[d] for d in dims if d not in dec.shard)
        return comm, tuple(_member_counts(dec, dims, comm, base))
    return layout.planned(("norm_statistics", dec, dims), make)


def _rows(t: torch.Tensor, comm: MPI.Comm, differentiable: bool) -> torch.Tensor:
    """Collective over ``comm``. Every member's ``t`` as rows [P, *t.shape], the
    same bits on every rank: each writes its row of a zero tensor, summed (adding
    zeros is exact). Differentiable when asked: its gradient is this rank's row."""
    p, r = comm.Get_size(), comm.Get_rank()
    zeros = t.new_zeros
    full = torch.cat([zeros((r,) + t.shape), t.unsqueeze(0), zeros((p - r - 1,) + t.shape)])
    return ag.allreduce_sum(full, comm) if differentiable else ag.allreduce_tensor(full, comm)


def moments(local: torch.Tensor, dims, comm: MPI.Comm, counts, scratch=None):
    """Collective over ``comm``. (mean, M2, n) over the reduced ``dims`` of the
    blocks of the members of ``comm`` (module docstring, steps 1-3); mean and M2
    keep the reduced dims (size 1) and are replicated over ``comm``. ``scratch``,
    a tensor shaped like ``local`` outside any graph, holds the squared deviations
    instead of a temporary."""
    dims = tuple(dims)
    n_me = counts[comm.Get_rank()]
    local = local.to(opmath(local.dtype))  # half types: float32 statistics, as torch's
    if local.numel() == 0:
        # Zeros that stay in the graph: every rank's result must need grad alike,
        # or only some would enter the backward's collectives.
        mean_i = m2_i = local.sum(dim=dims, keepdim=True)
    else:
        mean_i, m2_i = _block_moments(local, dims, scratch)
    if comm.Get_size() == 1:
        return mean_i, m2_i, n_me
    tracked = torch.is_grad_enabled() and mean_i.requires_grad
    rows = _rows(torch.stack([mean_i, m2_i]), comm, tracked)
    live = tuple(i for i, c in enumerate(counts) if c > 0)  # empty blocks contribute nothing
    if not live:
        return rows[0, 0], rows[0, 1], 0
    if len(live) < len(counts):
        rows = rows[list(live)]
    # Chan's parallel combination, the same ops on every rank (identical bits):
    # mean = sum n_i mean_i / n, taken as shifts from the first block's mean so that
    # a large common offset costs no digits; M2 = sum M2_i + n_i (mean_i - mean)^2.
    means, m2s = rows[:, 0], rows[:, 1]
    share, count = _chan_weights(tuple(counts[i] for i in live), means.dim(), means.dtype,
                                 means.device)
    ref = means[0]
    mean = ref + ((means - ref) * share).sum(0)
    dev = means - mean
    return mean, (m2s + count * (dev * dev)).sum(0), sum(counts)


def _block_moments(local: torch.Tensor, dims: tuple, scratch):
    """Local. This block's (mean_i, M2_i) over ``dims``, kept (size 1). Outside a
    graph, over trailing dims, the C row loops (``rowwise.moments``: two reads, no
    temporary) where they take the block; else two passes of torch's ops, mean
    then squared deviations (torch.var_mean's one-pass Welford is as exact but
    runs 5-6x slower on the CPU: 18 ms against 3 ms on 16 MiB of float32, torch
    2.13)."""
    k = local.dim() - len(dims)
    graph = local.requires_grad and torch.is_grad_enabled()
    if not graph and sorted(dims) == list(range(k, local.dim())) and rowwise.usable(local):
        mean, m2 = rowwise.moments(local, math.prod(local.shape[:k]))
        kept = tuple(local.shape[:k]) + (1,) * len(dims)
        return mean.to(local.dtype).reshape(kept), m2.to(local.dtype).reshape(kept)
    mean_i = local.mean(dim=dims, keepdim=True)
    dev = local - mean_i if scratch is None else torch.sub(local, mean_i, out=scratch)
    sq = dev * dev if dev.requires_grad else dev.mul_(dev)  # in place outside a graph
    return mean_i, sq.sum(dim=dims, keepdim=True)


@functools.lru_cache(maxsize=256)
def _chan_weights(counts: tuple[int, ...], ndim: int, dtype: torch.dtype, device: torch.device):
    """Local. The live blocks' shares n_i / n and counts n_i as (L, 1, ...) tensors
    of ``ndim`` dims (constants of a layout: made once per layout and type)."""
    n = sum(counts)
    shape = (len(counts),) + (1,) * (ndim - 1)
    return (torch.tensor([c / n for c in counts], dtype=dtype, device=device).reshape(shape),
            torch.tensor(counts, dtype=dtype, device=device).reshape(shape))


def _invstd(m2: torch.Tensor, n: int, eps: float) -> torch.Tensor:
    return torch.rsqrt(m2 / max(n, 1) + eps)


def _enter_stats(mean, invstd, comm):
    """The replicated statistics entering this block's computation: one Broadcast,
    whose backward sums both gradients over ``comm`` in one allreduce."""
    if comm.Get_size() == 1 or not (mean.requires_grad and torch.is_grad_enabled()):
        return mean, invstd
    both = ag.broadcast(torch.stack([mean, invstd]), comm)
    return both[0], both[1]


def normalize(local, dims, comm, counts, eps, weight=None, bias=None):
    """Collective over ``comm``. ``local`` normalized over ``dims`` with the
    statistics of every member's block, then scaled and shifted by ``weight``
    and ``bias`` (already this block's, broadcastable). Returns (out, mean, M2, n)
    with mean and M2 replicated over ``comm``."""
    mean, m2, n = moments(local, dims, comm, counts)
    invstd = _invstd(m2, n, eps)
    mean_b, invstd_b = _enter_stats(mean, invstd, comm)
    return Affine.apply(local, mean_b, invstd_b, weight, bias), mean, m2, n


def _on_block(func, local, dec, weight, bias, lead=(), trail=(), flat=True) -> DomainTensor:
    """Local. torch's own kernel ``func(local, *lead, weight, bias, *trail)`` on this
    block, laid out by ``dec`` (weight and bias flattened to 1-D with ``flat``, as the
    per-channel norms take them); on an empty block, zeros still in the graph of the
    parameters (their broadcast's backward is collective)."""
    if local.numel() == 0:
        return DomainTensor(window.placeholder(local.shape, local, local, weight, bias), dec)
    w, b = ((None if p is None else p.reshape(-1)) for p in (weight, bias)) if flat \
        else (weight, bias)
    return DomainTensor(func(local, *lead, w, b, *trail), dec)


# -- running statistics -----------------------------------------------------------------------
def _update_running(running_mean, running_var, new_mean, new_var, momentum):
    """In place, as torch's kernels: r = (1 - momentum) r + momentum * new."""
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(new_mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            running_var.mul_(1 - momentum).add_(new_var.to(running_var.dtype), alpha=momentum)


def _assemble_channels(values: torch.Tensor, dec: Decomposition, channel_dim: int,
                       batch_dim: int | None = None) -> torch.Tensor:
    """Collective over the axes of ``channel_dim`` (and ``batch_dim``). ``values``
    [k, C_local] (summed over this block's batch entries) as [k, C]: each rank's
    channels in place, summed over the batch blocks in rank order; identical bits
    on every rank."""
    dims = [d for d in (channel_dim, batch_dim) if d is not None and d in dec.shard]
    comm = layout.comm_of(dec, dims)
    c = dec.global_shape[channel_dim]
    if channel_dim in dec.shard:
        off = dec.offsets()[channel_dim]
        values = F.pad(values, (off, c - off - values.shape[-1]))
    if comm.Get_size() == 1:
        return values
    rows = _rows(values.detach(), comm, False)
    out = rows[0]
    for i in range(1, rows.shape[0]):
        out = out + rows[i]
    return out


# -- batch_norm -------------------------------------------------------------------------------
def _channel_params(dec, weight, bias, nd, channel_dim=1):
    """Weight and bias (C,) as this block's, shaped to broadcast along ``channel_dim``."""
    sliced = {0: channel_dim} if channel_dim in dec.shard else {}
    shape = [1] * nd
    shape[channel_dim] = -1
    out = []
    for p in (weight, bias):
        out.append(None if p is None else enter_domain(p, dec, sliced).reshape(shape))
    return out


def _channel_slice(t, dec, channel_dim=1):
    """A replicated per-channel tensor (running statistics) cut to this block's channels."""
    if t is None or channel_dim not in dec.shard:
        return t
    return t[dec.local_slices()[channel_dim]]


@register(F.batch_norm)
def batch_norm(func, args, kwargs):
    """Collective (allreduce of per-block moments over the axes of the sharded batch
    and spatial dims). Training and eval, running statistics (momentum, unbiased
    variance) identical on every rank, affine or not; channel dim may be sharded."""
    a = bind(func, args, kwargs, ("input", "running_mean", "running_var", "weight", "bias",
                                  "training", "momentum", "eps"),
             {"training": False, "momentum": 0.1, "eps": 1e-5})
    x, rm, rv, w, b = a["input"], a["running_mean"], a["running_var"], a["weight"], a["bias"]
    _check_operands(func, x, running_mean=rm, running_var=rv, weight=w, bias=b)
    training, momentum, eps = a["training"], a["momentum"], a["eps"]
    torch_checks(func, x, rm, rv, w, b, training, momentum, eps)
    dec, local, nd = x._dec, x._local, x.ndim
    weight, bias = _channel_params(dec, w, b, nd)
    dims = [0] + list(range(2, nd))
    if not training or _block_statistics(dec, dims, rm is not None or rv is not None):
        # The running statistics (elementwise per channel), or statistics per channel
        # within the block: torch's kernel on the block.
        return _on_block(func, local, dec, weight, bias,
                         (_channel_slice(rm, dec), _channel_slice(rv, dec)),
                         (training, momentum, eps))

    comm, counts = _statistics_plan(dec, dims)
    out, mean, m2, n = normalize(local, dims, comm, counts, eps, weight, bias)
    if rm is not None or rv is not None:
        stats = torch.stack([mean.detach().reshape(-1), m2.detach().reshape(-1) / max(n - 1, 1)])
        stats = _assemble_channels(stats, dec, 1)
        _update_running(rm, rv, stats[0], stats[1], momentum)
    return DomainTensor(out, dec)


# -- instance_norm ----------------------------------------------------------------------------
@register(F.instance_norm)
def instance_norm(func, args, kwargs):
    """Collective over the axes of the sharded spatial dims (none along batch or
    channels). use_input_stats or running statistics, running statistics updated
    identically on every rank (averaged over the whole batch), affine or not."""
    a = bind(func, args, kwargs, ("input", "running_mean", "running_var", "weight", "bias",
                                  "use_input_stats", "momentum", "eps"),
             {"use_input_stats": True, "momentum": 0.1, "eps": 1e-5})
    x, rm, rv, w, b = a["input"], a["running_mean"], a["running_var"], a["weight"], a["bias"]
    _check_operands(func, x, running_mean=rm, running_var=rv, weight=w, bias=b)
    use_input_stats, momentum, eps = a["use_input_stats"], a["momentum"], a["eps"]
    torch_checks(func, x, rm, rv, w, b, use_input_stats, momentum, eps)
    dec, local, nd = x._dec, x._local, x.ndim
    weight, bias = _channel_params(dec, w, b, nd)
    spatial = list(range(2, nd))
    tracked = rm is not None or rv is not None
    if not use_input_stats or _block_statistics(dec, spatial, tracked):
        # The running statistics (elementwise per channel), or statistics per sample
        # and channel within the block: torch's kernel on the block. It updates running
        # statistics only where nothing is cut (the block is the whole tensor).
        return _on_block(func, local, dec, weight, bias,
                         (_channel_slice(rm, dec), _channel_slice(rv, dec)),
                         (use_input_stats, momentum, eps))

    comm, counts = _statistics_plan(dec, spatial)
    out, mean, m2, n = normalize(local, spatial, comm, counts, eps, weight, bias)
    if tracked:
        # torch: the batch average of the per-instance (mean, unbiased variance).
        per = local.shape[:2]  # (N_local, C_local): reshape(0, -1) would be ambiguous
        stats = torch.stack([mean.detach().reshape(per).sum(0),
                             (m2.detach() / max(n - 1, 1)).reshape(per).sum(0)])
        stats = _assemble_channels(stats, dec, 1, batch_dim=0) / max(dec.global_shape[0], 1)
        _update_running(rm, rv, stats[0], stats[1], momentum)
    return DomainTensor(out, dec)


# -- group_norm -------------------------------------------------------------------------------
@register(F.group_norm)
def group_norm(func, args, kwargs):
    """Collective over the axes of the cut spatial dims (none along batch; local
    where no spatial dim is cut over more than one process). Any num_groups,
    affine or not; a sharded channel dim where every block holds whole groups."""
    a = bind(func, args, kwargs, ("input", "num_groups", "weight", "bias", "eps"), {"eps": 1e-5})
    x, groups, w, b, eps = a["input"], a["num_groups"], a["weight"], a["bias"], a["eps"]
    _check_operands(func, x, weight=w, bias=b)
    dec, local, nd = x._dec, x._local, x.ndim
    key = ("group_norm", dec, signature(x), groups, signature(w), signature(b), eps)
    plan = layout.planned(key, lambda: _group_plan(func, x, groups, w, b, eps))
    weight, bias = _channel_params(dec, w, b, nd)
    if plan.comm is None:
        return _on_block(func, local, dec, weight, bias, (plan.local_groups,), (eps,))
    # GroupNormRows where the C loops take the block and the parameters given (of
    # its type, on the CPU, contiguous)
    if rowwise.usable(local, *(p for p in (weight, bias) if p is not None)):
        flat = [None if p is None else p.reshape(-1) for p in (weight, bias)]
        out = GroupNormRows.apply(local, *flat, plan.comm, plan.float_counts,
                                  float(sum(plan.counts)), plan.local_groups,
                                  plan.view_shape[2], eps)
        return DomainTensor(out, dec)
    if local.dtype in (torch.float32, torch.float64):
        return DomainTensor(_fused_groups(local, plan, eps, weight, bias), dec)
    # (N, G, C/G, spatial...): statistics per (sample, group) over dims 2.. of the view.
    view = local.reshape(plan.view_shape)
    wv = None if weight is None else weight.reshape(plan.param_shape)
    bv = None if bias is None else bias.reshape(plan.param_shape)
    out, _, _, _ = normalize(view, range(2, nd + 1), plan.comm, plan.counts, eps, wv, bv)
    return DomainTensor(out.reshape(local.shape), dec)


def _fused_groups(local, plan: _GroupPlan, eps, weight, bias) -> torch.Tensor:
    """Collective over ``plan.comm``. Group norm of a float32 or float64 block with
    torch's ops (where ``GroupNormRows`` does not take it): the groups'
    statistics by ``moments`` (no graph: ``GroupAffine``'s backward holds their
    dependence on the block), then ``GroupAffine``."""
    assert plan.comm is not None  # the caller took the block-statistics path otherwise
    n, g, per = plan.view_shape[:3]
    view = local.reshape(n, g, per, math.prod(local.shape[2:]))
    out = torch.empty_like(view)  # the moments' scratch, then GroupAffine's output
    with torch.no_grad():
        mean, m2, count = moments(view, (2, 3), plan.comm, plan.counts, out)
        invstd = _invstd(m2, count, eps)
    shape = (1, g, per, 1)
    wv = None if weight is None else weight.reshape(shape)
    bv = None if bias is None else bias.reshape(shape)
    out = GroupAffine.apply(view, mean, invstd, wv, bv, plan.comm, count, out)
    return out.reshape(local.shape)


@dataclasses.dataclass(frozen=True)
class _GroupPlan:
    local_groups: int
    comm: MPI.Cartcomm | None = None  # None: statistics of the block, torch's kernel on it
    counts: tuple[int, ...] = ()
    view_shape: tuple[int, ...] = ()
    param_shape: tuple[int, ...] = ()
    float_counts: torch.Tensor | None = None  # counts as float64 (GroupNormRows)


def _group_plan(func, x: DomainTensor, groups, w, b, eps) -> _GroupPlan:
    """Local (collective on the first use of a sub-communicator). torch's checks, the
    refusal of split groups, and the statistics' communicator, member counts and
    shapes: from the layout and arguments alone."""
    torch_checks(func, x, groups, w, b, eps)
    dec, nd = x._dec, x.ndim
    per_group = x.shape[1] // groups
    if 1 in dec.shard and any(s % per_group for s in dec.block_sizes(1)):
        raise UnsupportedOpError(
            f"{op_name(func)}: the channel dim 1 is sharded into blocks {dec.block_sizes(1)} "
            f"that split groups of {per_group} channels ({layout.sharded_dims_text(dec)}); "
            f"give every block a multiple of {per_group} channels or keep channels whole")
    local_shape = dec.local_shape()
    local_groups = local_shape[1] // per_group
    spatial = list(range(2, nd))
    if _block_statistics(dec, spatial):
        return _GroupPlan(local_groups)
    comm, counts = _statistics_plan(dec, spatial)  # counts of cells: per_group values each
    cells = tuple(per_group * n for n in counts)
    return _GroupPlan(local_groups, comm, cells,
                      (local_shape[0], local_groups, per_group) + tuple(local_shape[2:]),
                      (1, local_groups, per_group) + (1,) * (nd - 2),
                      torch.tensor(cells, dtype=torch.float64))


# -- layer_norm -------------------------------------------------------------------------------
@register(F.layer_norm)
def layer_norm(func, args, kwargs):
    """Collective over the axes of the sharded normalized dims (none along the
    others). Any normalized_shape (trailing dims, sharded or not); weight and bias
    sliced to the block; elementwise_affine with or without bias."""
    a = bind(func, args, kwargs, ("input", "normalized_shape", "weight", "bias", "eps"),
             {"eps": 1e-5})
    x, shape, w, b, eps = a["input"], a["normalized_shape"], a["weight"], a["bias"], a["eps"]
    _check_operands(func, x, weight=w, bias=b)
    torch_checks(func, x, shape, w, b, eps)  # an int shape too
    shape = tuple(shape)
    dec, local, nd = x._dec, x._local, x.ndim
    k = len(shape)
    dims = list(range(nd - k, nd))
    sliced = {d - (nd - k): d for d in dims if d in dec.shard}
    weight = None if w is None else enter_domain(w, dec, sliced)
    bias = None if b is None else enter_domain(b, dec, sliced)
    if _block_statistics(dec, dims):
        return _on_block(func, local, dec, weight, bias, (shape,), (eps,), flat=False)
    comm, counts = _statistics_plan(dec, dims)
    out, _, _, _ = normalize(local, dims, comm, counts, eps, weight, bias)
    return DomainTensor(out, dec)
