"""Ring attention's primitive: ``RingAttention``, one autograd Function that
fuses the ring shifts of the k/v blocks with the block attention around them,
forward and adjoint, and its block kernels. Pairwise collective over the ring
communicator (point to point, every rank every step); local when a rank
attends to its own k/v block only; an allreduce when partial results are
combined. The op rules that plan the layouts and call it are in
``ops/attention.py`` (scaled_dot_product_attention, nn.MultiheadAttention).

It fuses communication with computation for memory (never the N x N scores,
never the whole k/v), and it combines partial results with
``ops.reduce.allreduce_extremum``: so it lives in ``ops/``, not ``autograd/``
(which holds the pure communication primitives and imports no op).

Forward: at each of the P steps a rank posts the nonblocking send of the k/v
block it holds to the next rank and the receive of the previous rank's,
computes on the block it holds meanwhile (polling the messages between tiles:
MPI moves nonblocking messages only inside calls), and folds the result into
its running ``(out, lse)`` by a log-sum-exp online softmax. Backward is a ring
too, flash-attention style: with the global ``out`` and ``lse`` each block's
gradients are exact on their own; the k/v blocks travel again, and their
gradient accumulators travel one step behind them (other tags) and arrive back
at their owner after P hops. ``RING_WAIT`` adds up the time left waiting.

Block kernels: torch's CPU flash kernel
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which given
the global out and lse returns a block's exact gradients), or a tiled math
kernel whose score tiles hold at most ``spec.tile`` elements; half types
accumulate in float32. Causal blocks are cut into pieces (``_pieces``) so that
no causal mask is materialised.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from .. import autograd as ag
from ..autograd._arrays import to_array
from ..comm import pairwise
from .reduce import allreduce_extremum

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
FLASH_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_ACC = {torch.bfloat16: torch.float32, torch.float16: torch.float32}  # out, lse, gradients
_NEG_INF = float("-inf")
_GRAD_TAG = pairwise.RING_TAG + 2  # k/v gradients: other tags than the k/v blocks


class _WaitClock:
    """Seconds spent waiting for ring messages (k/v blocks, their gradients) that
    had not arrived when the computation before them was done: the communication
    the overlap left exposed (``domainpar bench attention`` reads it)."""

    def __init__(self):
        self.seconds = 0.0

    def reset(self) -> None:
        self.seconds = 0.0

    def wait(self, pending) -> None:
        t0 = time.perf_counter()
        pending.wait()
        self.seconds += time.perf_counter() - t0


RING_WAIT = _WaitClock()


# -- the per-rank plan ---------------------------------------------------------------------------
@dataclasses.dataclass
class RingSpec:
    """Local. One rank's plan for ring attention: the softmax scale and causality,
    the GQA grouping, where its query rows and each k/v block start globally, its
    coordinate on the k/v axis, and whether k/v blocks travel the ring."""
    scale: float
    causal: bool
    groups: int          # GQA: query heads per k/v head
    row0: int            # global index of this rank's first query row
    kv_offsets: tuple    # global first key of the k/v block of each coordinate
    coord: int           # this rank's coordinate on the k/v axis
    ring: bool           # k/v blocks travel (else: this rank's own block only)
    partial: bool        # combine (out, lse) over the axis after the block (q not sharded)
    masks: tuple         # (mask4, cut_cols): (Bm, Hm, Lm, Sm), rows already this rank's
    flash: bool          # torch's CPU flash kernel, else the tiled math one
    tile: int            # score elements per math tile / query rows x keys per flash call


def _steps(spec: RingSpec, size: int) -> int:
    return size if spec.ring else 1


def _source(spec: RingSpec, step: int, size: int) -> int:
    """The coordinate whose k/v block a rank holds at ``step``."""
    return (spec.coord - step) % size


class RingAttention(torch.autograd.Function):
    """Pairwise collective around the ring ``comm`` (point to point, every rank
    every step). Attention of this rank's q block (B, H, Lb, E) to every k/v
    block (B, Hkv, Sb, E), the blocks travelling around the ring; or to this
    rank's block only (``spec.ring`` off), combined over ``comm`` when
    ``spec.partial``. Saves only q, k, v, out and lse for backward."""

    @staticmethod
    def forward(ctx, q, k, v, comm, spec: RingSpec):
        size = comm.Get_size() if comm is not None else 1
        acc = _ACC.get(q.dtype, q.dtype)
        out = q.new_zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc)
        lse = q.new_full(q.shape[:-1], _NEG_INF, dtype=acc)
        cur = (k.contiguous(), v.contiguous())
        for step in range(_steps(spec, size)):
            src = _source(spec, step, size)
            pending = nxt = None
            if spec.ring and step < size - 1:  # post the next block before computing
                nxt = _kv_buffers(k, v, spec, _source(spec, step + 1, size))
                pending = _shift(cur, nxt, comm)
            _block_forward(q, cur[0], cur[1], spec, src, out, lse, pending)
            if pending is not None:
                RING_WAIT.wait(pending)
                assert nxt is not None  # posted with pending
                cur = nxt
        del cur
        if spec.partial:
            out, lse = _combine(out, lse, comm)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.spec = comm, spec
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, spec = ctx.comm, ctx.spec
        size = comm.Get_size() if comm is not None else 1
        dout = dout.contiguous()
        # Rows masked out entirely have lse = -inf and scores -inf: any finite lse
        # gives them p = 0 (torch's flash kernel keeps 0 there).
        lse = torch.where(torch.isneginf(lse), 0.0, lse)
        acc = lse.dtype  # half types accumulate in float32
        delta = None if spec.flash else (dout.to(acc) * out.to(acc)).sum(-1)
        dq = torch.zeros_like(q, dtype=acc)
        cur = (k.contiguous(), v.contiguous())
        arriving = incoming = None
        steps = _steps(spec, size)
        for step in range(steps):
            src = _source(spec, step, size)
            pending = nxt = None
            if spec.ring and step < size - 1:
                nxt = _kv_buffers(k, v, spec, _source(spec, step + 1, size))
                pending = _shift(cur, nxt, comm)
            dk, dv = torch.zeros_like(cur[0], dtype=acc), torch.zeros_like(cur[1], dtype=acc)
            _block_backward(dout, q, cur[0], cur[1], out, lse, delta, spec, src, dq, dk, dv,
                            pending, arriving)
            if arriving is not None:  # this block's gradient from the ranks it visited before
                RING_WAIT.wait(arriving)
                assert incoming is not None  # posted with arriving
                dk += incoming[0]
                dv += incoming[1]
            if spec.ring and size > 1:  # on to the next rank; after the last step: the owner
                incoming = _kv_buffers(k, v, spec, _source(spec, step + 1, size), acc)
                arriving = _shift((dk, dv), incoming, comm, _GRAD_TAG)
            if pending is not None:
                RING_WAIT.wait(pending)
                assert nxt is not None  # posted with pending
                cur = nxt
        if arriving is not None:
            RING_WAIT.wait(arriving)
            assert incoming is not None  # posted with arriving
            dk, dv = incoming
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _kv_buffers(k, v, spec: RingSpec, coord: int, dtype=None):
    n = _block_length(spec, coord)
    return (k.new_empty(k.shape[:-2] + (n, k.shape[-1]), dtype=dtype or k.dtype),
            v.new_empty(v.shape[:-2] + (n, v.shape[-1]), dtype=dtype or v.dtype))


def _block_length(spec: RingSpec, coord: int) -> int:
    return spec.kv_offsets[coord + 1] - spec.kv_offsets[coord]


def _shift(send, recv, comm, tag=pairwise.RING_TAG):
    return pairwise.ring_shift([to_array(t) for t in send], [to_array(t) for t in recv], comm,
                                  tag=tag)


def _combine(out, lse, comm):
    """Collective over ``comm``. Per-rank partial (out, lse) over disjoint key
    blocks combined into the (replicated) attention over all keys."""
    top = allreduce_extremum(lse, comm, "max")
    top = torch.where(torch.isneginf(top), 0.0, top)
    w = torch.exp(lse - top)
    den = ag.allreduce_tensor(w, comm, "sum")
    num = ag.allreduce_tensor(out * w.unsqueeze(-1), comm, "sum")
    out = num / torch.where(den == 0, 1.0, den).unsqueeze(-1)
    return out, top + torch.log(den)


# -- blocks, tiles and pieces --------------------------------------------------------------------
def _pieces(r0: int, rows: int, c0: int, cols: int, causal: bool):
    """How the query rows ``[r0, r0+rows)`` attend to the keys ``[c0, c0+cols)``:
    ``(row slice, column slice, top-left causal)`` pieces, local indices.

    Causal (key j visible to query i iff j <= i): a block wholly above the
    diagonal has no piece, one wholly below is one piece seen whole; one the
    diagonal crosses loses the rows that see none of its keys, and the rest is
    a rectangle every remaining row sees whole plus a top-left causal part."""
    if rows == 0 or cols == 0:
        return []
    everything = (slice(0, rows), slice(0, cols), False)
    if not causal or c0 + cols - 1 <= r0:
        return [everything]
    if c0 > r0 + rows - 1:
        return []
    t0 = max(0, c0 - r0)
    d = r0 + t0 - c0  # keys [0, d) are seen by every remaining row
    pieces = [(slice(t0, rows), slice(0, d), False)] if d else []
    return pieces + [(slice(t0, rows), slice(d, cols), True)]


def _tiles(spec: RingSpec, q, cols: int):
    """Row tiles of the q block: bounded score tiles for the math kernel, and
    points between flash calls where MPI can move the ring's messages on."""
    rows = q.shape[-2]
    per_row = max(1, q.shape[0] * q.shape[1] * cols)
    step = max(1, spec.tile // per_row)
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


def _mask_piece(spec: RingSpec, rows: slice, c0: int, cols: slice, dtype):
    """The additive mask of a piece (None without masks): each mask cut to the
    piece's rows and, where it has the key dim, to its global keys."""
    total = None
    for m, cut in spec.masks:
        if m.shape[-2] != 1:
            m = m[:, :, rows]
        if cut:
            m = m[..., c0 + cols.start:c0 + cols.stop]
        if m.dtype == torch.bool:
            m = torch.zeros((), dtype=dtype, device=m.device).masked_fill(~m, _NEG_INF) \
                if m.numel() else m.to(dtype)
        else:
            m = m.to(dtype)
        total = m if total is None else total + m
    return total


def _work(spec: RingSpec, q, k, src: int):
    """(tile start, rows, cols, causal, mask) for every piece of the block of
    coordinate ``src`` (rows and cols relative to the q and k blocks)."""
    c0 = spec.kv_offsets[src]
    cols_n = k.shape[-2]
    for a, b in _tiles(spec, q, cols_n):
        for rows, cols, causal in _pieces(spec.row0 + a, b - a, c0, cols_n, spec.causal):
            rows = slice(a + rows.start, a + rows.stop)
            yield rows, cols, causal, _mask_piece(spec, rows, c0, cols, q.dtype)


def _expand_heads(t, groups: int):
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold_heads(t, groups: int):
    """The gradient of ``_expand_heads``: summed over each group."""
    return t if groups == 1 else _grouped_rows(t, groups).sum(2)


def _block_forward(q, k, v, spec: RingSpec, src: int, out, lse, pending):
    if q.shape[0] * q.shape[1] == 0:
        return
    ke, ve = (_expand_heads(k, spec.groups), _expand_heads(v, spec.groups)) if spec.flash \
        else (k, v)
    for rows, cols, causal, mask in _work(spec, q, k, src):
        if spec.flash:
            o, o_lse = _FLASH(q[:, :, rows], ke[:, :, cols], ve[:, :, cols], 0.0, causal,
                              attn_mask=mask, scale=spec.scale)
            if mask is not None:  # torch's kernel gives rows it cannot see lse 0, not -inf
                o_lse = torch.where(torch.isneginf(mask).all(-1), _NEG_INF, o_lse)
        else:
            o, o_lse = _math_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal, mask,
                                     spec)
        _merge(out[:, :, rows], lse[:, :, rows], o, o_lse)
        if pending is not None:
            pending.test()


def _merge(out, lse, o, o_lse):
    """Online softmax: (out, lse) of the rows so far and (o, o_lse) of new keys, in place."""
    new = torch.logaddexp(lse, o_lse)
    safe = torch.where(torch.isneginf(new), 0.0, new)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(o * torch.exp(o_lse - safe).unsqueeze(-1))
    lse.copy_(new)


def _scores(q, k, causal: bool, mask, spec: RingSpec):
    """Scaled, masked scores of a tile, grouped (B, Hkv, G, t, s) for GQA."""
    g = spec.groups
    if g > 1:
        b, h = q.shape[:2]
        q = q.reshape(b, h // g, g, *q.shape[2:])
        k = k.unsqueeze(2)
        if mask is not None:
            mask = mask.reshape(mask.shape[0], h // g, g, *mask.shape[2:]) \
                if mask.shape[1] == h else mask.unsqueeze(2)
    s = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    if mask is not None:
        s = s + mask
    if causal:
        t, n = s.shape[-2:]
        hidden = torch.ones(t, n, dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill(hidden, _NEG_INF)
    return s


def _grouped(t, groups: int):
    return t if groups == 1 else t.unsqueeze(2)


def _ungrouped(t, groups: int):
    return t if groups == 1 else t.reshape(t.shape[0], -1, *t.shape[3:])


def _math_forward(q, k, v, causal, mask, spec: RingSpec):
    acc = _ACC.get(q.dtype, q.dtype)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    s = _scores(q, k, causal, mask, spec)
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isneginf(top), 0.0, top)
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    o = torch.matmul(p, _grouped(v, spec.groups)) / torch.where(total == 0, 1.0, total)
    lse = (top + torch.log(total)).squeeze(-1)
    return _ungrouped(o, spec.groups), _ungrouped(lse, spec.groups)


def _block_backward(dout, q, k, v, out, lse, delta, spec: RingSpec, src: int, dq, dk, dv,
                    *pendings):
    if q.shape[0] * q.shape[1] == 0:
        return
    g = spec.groups
    if spec.flash:
        ke, ve = _expand_heads(k, g), _expand_heads(v, g)
        dke, dve = (dk, dv) if g == 1 else (torch.zeros_like(ke), torch.zeros_like(ve))
    for rows, cols, causal, mask in _work(spec, q, k, src):
        if spec.flash:
            gq, gk, gv = _FLASH_BACKWARD(dout[:, :, rows], q[:, :, rows], ke[:, :, cols],
                                         ve[:, :, cols], out[:, :, rows], lse[:, :, rows],
                                         0.0, causal, attn_mask=mask, scale=spec.scale)
            dke[:, :, cols] += gk
            dve[:, :, cols] += gv
        else:
            gq, gk, gv = _math_backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols],
                                        v[:, :, cols], lse[:, :, rows], delta[:, :, rows],
                                        causal, mask, spec)
            dk[:, :, cols] += gk
            dv[:, :, cols] += gv
        dq[:, :, rows] += gq
        for pending in pendings:
            if pending is not None:
                pending.test()
    if spec.flash and g > 1:
        dk += _fold_heads(dke, g)
        dv += _fold_heads(dve, g)


def _math_backward(dout, q, k, v, lse, delta, causal, mask, spec: RingSpec):
    g = spec.groups
    dout, q, k, v = (t.to(lse.dtype) for t in (dout, q, k, v))
    s = _scores(q, k, causal, mask, spec)
    p = torch.exp(s - _grouped_rows(lse, g).unsqueeze(-1))
    do = _grouped_rows(dout, g)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, _grouped(v, g).transpose(-1, -2))
              - _grouped_rows(delta, g).unsqueeze(-1))
    dq = torch.matmul(ds, _grouped(k, g)) * spec.scale
    dk = torch.matmul(ds.transpose(-1, -2), _grouped_rows(q, g)) * spec.scale
    if g > 1:
        dk, dv = dk.sum(2), dv.sum(2)
    return _ungrouped(dq, g), dk, dv


def _grouped_rows(t, groups: int):
    """A per-query-head tensor (B, H, ...) as (B, Hkv, G, ...)."""
    if groups == 1:
        return t
    return t.reshape(t.shape[0], t.shape[1] // groups, groups, *t.shape[2:])

