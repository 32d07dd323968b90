"""Scaled dot-product attention and nn.MultiheadAttention on tensors sharded
along the sequence dim: ring attention.

q ``(..., L, E)``, k ``(..., S, E)``, v ``(..., S, Ev)``; the sequence dim is
``ndim - 2``. The leading (batch, head) dims may be sharded too: they stay
local, and k/v are brought onto q's layout there (``enter_domain`` for plain
tensors, a repartition for DomainTensors laid out otherwise). Who holds what:

- q and k/v sharded along the sequence dim (the ring). Every rank keeps its
  q block; the k/v blocks travel around the ranks of q's grid axis (k/v cut
  along another axis, or with other block sizes, are repartitioned onto it
  first). At each of the P steps a rank posts the nonblocking send of the k/v
  block it holds to the next rank and the receive of the previous rank's,
  computes on the block it holds meanwhile, and folds the result into its
  running output by a log-sum-exp online softmax (running ``out`` and
  ``lse``). Backward is a ring too, flash-attention style: with the global
  ``out`` and ``lse`` each block's gradients are exact on their own
  (``p = exp(s - lse)``, ``ds = p * (dp - rowsum(dout * out))``); the k/v blocks
  travel again, and their gradient accumulators travel one step behind them and
  arrive back at their owner after P hops. Every rank takes part in every step,
  empty blocks too. Output: q's layout (sequence dim cut like q's).
- q sharded along the sequence dim, k/v not: each rank attends with its q
  block to the whole k/v (causal offsets and mask rows from its block); k/v
  gradients are summed over the ranks. Output: q's layout.
- k/v sharded along the sequence dim, q not: each rank attends with the whole
  q to its k/v block, and the partial ``(out, lse)`` are combined with a max
  and two sums over the axis. Output: replicated along that axis (a plain
  tensor when nothing else is sharded); q's gradient is summed over the ranks.

Memory per rank is O(N/P): backward keeps only the local q, k, v, out and lse
(never the N x N scores, never the whole k/v), and the ring holds two k/v
blocks (the one in use and the one arriving) plus, in backward, two gradient
accumulators. The block kernel on CPU is torch's flash kernel
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which given
the global out and lse returns a block's exact gradients); elsewhere (CUDA,
E != Ev, ``KERNEL = "math"``) a tiled math kernel whose score tiles hold at
most ``MATH_TILE`` elements; half types accumulate in float32. Between tiles
the ring polls its messages (MPI moves nonblocking messages only inside
calls); ``RING_WAIT`` adds up the time left waiting for them.
The primitive (the ``RingAttention`` Function, its block kernels,
``RING_WAIT``) is ``ops/ring.py``; this module plans where every block goes
and holds the SDPA and nn.MultiheadAttention rules.

Causal attention follows torch (top-left: key j is visible to query i iff
j <= i, global indices, also when L != S): blocks wholly above the diagonal are
skipped, and a block the diagonal crosses is cut into a rectangle seen whole
and a top-left causal part, so no mask is materialised. ``attn_mask``
(boolean, True = attend, or additive float, any shape that broadcasts to
``(..., L, S)``) is a plain replicated tensor, cut to the q rows and to each
k/v block's columns; rows masked out entirely give 0, as torch does.

Refused (UnsupportedOpError on every rank): ``dropout_p > 0``; an ``attn_mask``
that is a DomainTensor or requires grad; k/v whose leading dims differ from q's
(broadcast batch dims) other than the GQA head dim; with ``enable_gqa``, a
sharded head dim whose q blocks are not whole groups of heads. A sharded
feature dim (E, Ev) is repartitioned to whole features first; so are k/v cut
along the sequence over a grid axis that q's leading dims use (onto q's
leading layout, whole sequence: the local case).
nn.MultiheadAttention additionally refuses ``need_weights=True`` (its default:
the (B, L, S) weights are what ring attention never forms; pass
``need_weights=False``), dropout while training, ``add_bias_kv``,
``add_zero_attn``, ``static_k``/``static_v`` and a sharded embedding dim.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F

from .. import autograd as ag
from ..comm.decomposition import Decomposition, balanced_sizes
from ..tensor import layout
from ..tensor.dispatch import UnsupportedOpError, op_name, register, same_grid
from ..tensor.domain_tensor import DomainTensor
from ..tensor.params import enter_domain
from .common import bind, meta_call
from .common import meta as _meta
from .ring import FLASH_DTYPES, RingAttention, RingSpec

KERNEL = "auto"        # "auto": torch's CPU flash kernel where it applies; "math": always ours
MATH_TILE = 1 << 22    # score elements per tile of the math kernel
FLASH_TILE = 1 << 22   # query rows x keys per flash call (MPI progress between calls)


# -- layouts -------------------------------------------------------------------------------------
def _refuse(func, why: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"{op_name(func)}: {why}")


def _bring(t, dec, axes, grid):
    """Operand ``t`` (DomainTensor or plain replicated tensor) as its local block of
    layout ``dec``, its gradient summed over the grid ``axes`` along which every
    rank uses the same block."""
    if isinstance(t, DomainTensor):
        local = ag.repartition(t._local, t._dec, dec)
    else:
        local = enter_domain(t, dec, {d: d for d in dec.shard})
    extra = set(axes) - set(dec.shard.values())
    if extra and local.requires_grad and torch.is_grad_enabled():
        local = ag.broadcast(local, grid.sub(extra))
    return local


def attention(func, q, k, v, *, masks=(), causal=False, scale=None, gqa=False):
    """Collective (see the module docstring). Scaled dot-product attention of q,
    k, v (DomainTensors or plain tensors, at least one a DomainTensor), with the
    additive or boolean ``masks`` (plain tensors, summed) and torch's options;
    arguments already validated by torch on the global shapes."""
    dts = [t for t in (q, k, v) if isinstance(t, DomainTensor)]
    same_grid(func, dts)
    grid = dts[0]._dec.grid
    n = q.ndim
    groups = q.shape[-3] // k.shape[-3] if gqa and n >= 3 else 1
    _check_operands(func, q, k, v, masks, groups)
    plan = _plan(func, q, k, v, dts, groups)
    axes = set(plan.q.shard.values()) | ({plan.axis} if plan.partial else set())
    q4, k4, v4 = (_canonical(_bring(t, d, axes, grid), n)
                  for t, d in ((q, plan.q), (k, plan.k), (v, plan.v)))
    seq = n - 2
    offsets: tuple[int, ...] = (0, k.shape[seq])
    coord = 0
    if plan.axis is not None:
        offsets = tuple(itertools.accumulate(plan.k.block_sizes(seq), initial=0))
        coord = grid.coords[plan.axis]
    flash = _use_flash(q4, v4)
    spec = RingSpec(scale=float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
                    causal=bool(causal), groups=groups,
                    row0=plan.q.offsets()[seq] if seq in plan.q.shard else 0,
                    kv_offsets=offsets, coord=coord,
                    ring=plan.axis is not None and not plan.partial, partial=plan.partial,
                    masks=tuple(_mask_block(m, n, plan.out) for m in masks),
                    flash=flash, tile=FLASH_TILE if flash else MATH_TILE)
    comm = grid.sub((plan.axis,)) if plan.axis is not None else None
    out = RingAttention.apply(q4, k4, v4, comm, spec).reshape(plan.out.local_shape())
    if not isinstance(q, DomainTensor) and not plan.out.shard:
        return out
    return DomainTensor(out, plan.out)


def _check_operands(func, q, k, v, masks, groups: int) -> None:
    n = q.ndim
    for t, what in ((k, "key"), (v, "value")):
        want = tuple(q.shape[d] // groups if d == n - 3 else q.shape[d] for d in range(n - 2))
        if tuple(t.shape[:n - 2]) != want:
            raise _refuse(func, f"the {what}'s leading dims {tuple(t.shape[:n - 2])} must equal "
                                f"the query's {want} on DomainTensors (expand broadcast dims)")
    for m in masks:
        if m.ndim > n:  # torch refuses it too (an in-place broadcast to the mask's shape)
            raise RuntimeError(f"{op_name(func)}: attn_mask of shape {tuple(m.shape)} has more "
                               f"dims than the query ({n})")
        if isinstance(m, DomainTensor):
            raise _refuse(func, "attn_mask must be a plain (replicated) tensor, not a "
                                "DomainTensor")
        if m.requires_grad:
            raise _refuse(func, "a mask that requires grad is not supported on DomainTensors")


@dataclasses.dataclass
class _Plan:
    q: Decomposition  # the layouts the blocks are brought onto
    k: Decomposition
    v: Decomposition
    out: Decomposition
    axis: int | None  # the grid axis the k/v blocks are cut along (ring or partial)
    partial: bool     # q not cut along the sequence: partial results combined over ``axis``


def _plan(func, q, k, v, dts, groups: int) -> _Plan:
    """Where every block goes. The leading dims keep the query's layout (else the
    key's or value's); the sequence dim of q stays as it is; k/v are cut along
    q's sequence axis (the ring) when either is cut along the sequence at all,
    else whole (q's blocks attend to all keys); with q whole along the
    sequence, k/v stay cut along theirs (partial results combined) unless that
    axis is taken by the leading dims."""
    n = q.ndim
    seq, head = n - 2, n - 3
    lead_src = q if isinstance(q, DomainTensor) else dts[0]
    lead_shard = {d: a for d, a in lead_src._dec.shard.items() if d < seq}
    from_kv = lead_src is not q
    q_block, kv_block = {}, {}
    for d in lead_shard:
        s = lead_src._dec.block_sizes(d)
        if d == head and groups > 1:
            q_block[d] = tuple(x * groups for x in s) if from_kv else s
            if any(x % groups for x in q_block[d]):
                raise _refuse(func, f"enable_gqa with the head dim {d} sharded in blocks of "
                                    f"{list(q_block[d])} query heads: each block must hold "
                                    f"whole groups of {groups} heads")
            kv_block[d] = tuple(x // groups for x in q_block[d])
        else:
            q_block[d] = kv_block[d] = s

    q_axis = q._dec.shard.get(seq) if isinstance(q, DomainTensor) else None
    kv_seq = [t for t in (k, v) if isinstance(t, DomainTensor) and seq in t._dec.shard]
    kv_axis = kv_seq[0]._dec.shard[seq] if kv_seq else None
    if q_axis is not None:
        axis = q_axis if kv_axis is not None else None
    else:
        axis = kv_axis if kv_axis not in lead_shard.values() else None
    q_shard, kv_shard = dict(lead_shard), dict(lead_shard)
    if q_axis is not None:
        q_shard[seq], q_block[seq] = q_axis, q._dec.block_sizes(seq)
    if axis is not None:
        owner = [t for t in kv_seq if t._dec.shard[seq] == axis]
        kv_shard[seq] = axis
        kv_block[seq] = owner[0]._dec.block_sizes(seq) if owner else \
            balanced_sizes(k.shape[seq], lead_src._dec.grid.dims[axis])
    like = lead_src._dec
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    return _Plan(q=layout.derive(like, q.shape, q_shard, q_block),
                 k=layout.derive(like, k.shape, kv_shard, kv_block),
                 v=layout.derive(like, v.shape, kv_shard, kv_block),
                 out=layout.derive(like, out_shape, q_shard, q_block),
                 axis=axis, partial=q_axis is None and axis is not None)


def _canonical(t, n: int):
    """A local block (..., T, F) as (B, H, T, F): the leading dims but the last
    flattened into B (the head dim is ``ndim - 3``)."""
    if n == 2:
        return t.reshape(1, 1, *t.shape)
    if n == 3:
        return t.unsqueeze(0)
    return t.reshape(math.prod(t.shape[:n - 3]), *t.shape[n - 3:])  # not -1: blocks may be empty


def _mask_block(m, n: int, out_dec):
    """A plain mask cut to this rank's query rows and leading block, as (Bm, Hm,
    Lm, Sm) with each of Bm, Hm, Lm 1 or this rank's size; and whether its
    key dim must be cut to each k/v block (it is 1 otherwise)."""
    m = m.reshape((1,) * (n - m.ndim) + tuple(m.shape))
    cut = []
    for d in range(n - 1):  # leading dims and rows: this rank's block where m has them
        if m.shape[d] != 1 and d in out_dec.shard:
            cut.append(out_dec.local_slices()[d])
        else:
            cut.append(slice(None))
    m = m[tuple(cut)]
    if n == 2:
        m4 = m.reshape(1, 1, *m.shape)
    elif n == 3:
        m4 = m.unsqueeze(0)
    else:
        batch = tuple(m.shape[:n - 3])
        if all(x == 1 for x in batch):
            m4 = m.reshape(1, *m.shape[n - 3:])
        else:
            local_batch = tuple(out_dec.local_shape()[:n - 3])
            m4 = m.expand(*local_batch, *m.shape[n - 3:]).reshape(math.prod(local_batch),
                                                                  *m.shape[n - 3:])
    return m4, m4.shape[-1] != 1


def _use_flash(q4, v4) -> bool:
    return (KERNEL == "auto" and q4.device.type == "cpu" and q4.dtype in FLASH_DTYPES
            and q4.shape[-1] == v4.shape[-1])


# -- torch.nn.functional.scaled_dot_product_attention ------------------------------------------
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
               "enable_gqa")


@register(F.scaled_dot_product_attention)
def scaled_dot_product_attention(func, args, kwargs):
    """Pairwise collective: a ring of nonblocking sends when q and k/v are sharded
    along the sequence dim; local when only q is, allreduce when only k/v are.
    is_causal, attn_mask (bool or float, replicated), scale, enable_gqa, uneven
    and empty blocks, leading dims sharded too; no dropout."""
    a = bind(func, args, kwargs, _SDPA_NAMES,
             {"dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False})
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if a["dropout_p"]:
        raise _refuse(func, f"dropout_p={a['dropout_p']} is not supported on DomainTensors "
                            f"(ring attention has no dropout); pass dropout_p=0")
    if isinstance(mask, DomainTensor):
        raise _refuse(func, "attn_mask must be a plain (replicated) tensor, not a DomainTensor")
    # torch's own checks and errors, from the global shapes, on every rank alike
    meta_call(func, _meta(q), _meta(k), _meta(v), attn_mask=_meta(mask), dropout_p=0.0,
              is_causal=a["is_causal"], scale=a["scale"], enable_gqa=a["enable_gqa"])
    return attention(func, q, k, v, masks=() if mask is None else (mask,),
                     causal=a["is_causal"], scale=a["scale"], gqa=a["enable_gqa"])


# -- torch.nn.functional.multi_head_attention_forward (nn.MultiheadAttention) -------------------
_MHA_NAMES = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight",
              "in_proj_bias", "bias_k", "bias_v", "add_zero_attn", "dropout_p",
              "out_proj_weight", "out_proj_bias", "training", "key_padding_mask",
              "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
              "k_proj_weight", "v_proj_weight", "static_k", "static_v",
              "average_attn_weights", "is_causal")


@register(F.multi_head_attention_forward)
def multi_head_attention_forward(func, args, kwargs):
    """Pairwise collective (ring attention, as scaled_dot_product_attention)
    between local in- and out-projections whose weights enter every block.
    Packed or separate weights, biases, batch_first, unbatched input,
    key_padding_mask, attn_mask, is_causal; needs need_weights=False."""
    a = bind(func, args, kwargs, _MHA_NAMES,
             {"training": True, "key_padding_mask": None, "need_weights": True,
              "attn_mask": None, "use_separate_proj_weight": False, "q_proj_weight": None,
              "k_proj_weight": None, "v_proj_weight": None, "static_k": None,
              "static_v": None, "average_attn_weights": True, "is_causal": False})
    _check_mha(func, a)
    query, key, value = a["query"], a["key"], a["value"]
    heads = a["num_heads"]
    batched = query.ndim == 3
    # torch's own checks and errors on the global shapes (need_weights off: refused above)
    meta = {n: _meta(x) for n, x in a.items()}
    meta["need_weights"] = False
    meta_call(func, **meta)

    kpm = F._canonical_mask(mask=a["key_padding_mask"], mask_name="key_padding_mask",
                            other_type=F._none_or_dtype(a["attn_mask"]),
                            other_name="attn_mask", target_type=query.dtype)
    mask, causal = a["attn_mask"], a["is_causal"]
    if causal and kpm is None:
        mask = None  # torch's hint: causal attention without a materialised mask
    else:
        mask = F._canonical_mask(mask=mask, mask_name="attn_mask", other_type=None,
                                 other_name="", target_type=query.dtype, check_other=False)
        causal = causal and kpm is None
    entered = {}

    def weights(x: Any, i: int) -> tuple[Any, Any]:
        """The i-th (q, k, v) projection weight and bias as x's blocks use them."""
        def enter(p, part):
            if p is None:
                return None
            if isinstance(x, DomainTensor):  # once per operand: self-attention enters once
                key_ = (id(p), id(x))
                if key_ not in entered:
                    entered[key_] = enter_domain(p, x._dec, {})
                p = entered[key_]
            return p.chunk(3)[i] if part else p
        if a["use_separate_proj_weight"]:
            w = enter(a[("q_proj_weight", "k_proj_weight", "v_proj_weight")[i]], False)
        else:
            w = enter(a["in_proj_weight"], True)
        return w, enter(a["in_proj_bias"], True)

    hd = query.shape[-1] // heads
    q, k, v = (_project(x, *weights(x, i), heads, hd, batched)
               for i, x in enumerate((query, key, value)))
    masks = []
    if mask is not None:  # (L, S) or (B * heads, L, S)
        masks.append(mask if mask.dim() == 2 else mask.view(-1, heads, *mask.shape[1:]))
    if kpm is not None:  # (B, S), or (S,) unbatched
        masks.append(kpm.view(-1, 1, 1, kpm.shape[-1]))
    out = attention(func, q, k, v, masks=tuple(masks), causal=causal)
    return _out_projection(out, a["out_proj_weight"], a["out_proj_bias"], batched), None


def _check_mha(func, a):
    for name in ("query", "key", "value"):
        t = a[name]
        if isinstance(t, DomainTensor) and t.ndim - 1 in t._dec.shard:
            raise _refuse(func, f"the {name}'s embedding dim {t.ndim - 1} is sharded "
                                f"({layout.sharded_dims_text(t._dec)}); redistribute it whole")
    for name in ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
                 "v_proj_weight", "out_proj_weight", "out_proj_bias", "attn_mask",
                 "key_padding_mask", "bias_k", "bias_v", "static_k", "static_v"):
        if isinstance(a[name], DomainTensor):
            raise _refuse(func, f"{name} must be a plain (replicated) tensor, not a "
                                f"DomainTensor")
    if a["need_weights"]:
        raise _refuse(func, "need_weights=True would form the (B, L, S) attention weights, "
                            "which ring attention never materialises; call the module with "
                            "need_weights=False")
    if a["training"] and a["dropout_p"]:
        raise _refuse(func, f"dropout={a['dropout_p']} while training is not supported on "
                            f"DomainTensors; use dropout=0 or eval mode")
    if a["bias_k"] is not None or a["bias_v"] is not None:
        raise _refuse(func, "add_bias_kv (bias_k, bias_v) is not supported on DomainTensors")
    if a["add_zero_attn"]:
        raise _refuse(func, "add_zero_attn is not supported on DomainTensors")
    if a["static_k"] is not None or a["static_v"] is not None:
        raise _refuse(func, "static_k / static_v are not supported on DomainTensors")


def _project(x, w, b, heads: int, hd: int, batched: bool):
    """In-projection of x (L, B, E) or (L, E) into heads (B, heads, L, hd): local
    on the blocks of a DomainTensor, plain on a plain tensor."""
    local = F.linear(x._local if isinstance(x, DomainTensor) else x, w, b)
    if not batched:
        local = local.unsqueeze(1)
    rows, batch = local.shape[:2]
    local = local.reshape(rows, batch, heads, hd).permute(1, 2, 0, 3)
    if not isinstance(x, DomainTensor):
        return local
    dec, where = x._dec, {0: 2, 1: 0}  # (L, B, E) dims -> (B, heads, L, hd) dims
    glob = (x.shape[1] if batched else 1, heads, x.shape[0], hd)
    return DomainTensor(local, layout.derive(dec, glob,
                                             {where[d]: ax for d, ax in dec.shard.items()},
                                             {where[d]: dec.block_sizes(d) for d in dec.shard}))


def _out_projection(out, w, b, batched: bool):
    """(B, heads, L, hd) -> (L, B, E) (or (L, E)) and the out-projection."""
    local = out._local if isinstance(out, DomainTensor) else out
    bsz, heads, rows, hd = local.shape
    local = local.permute(2, 0, 1, 3).reshape(rows, bsz, heads * hd)
    if not batched:
        local = local.squeeze(1)
    if not isinstance(out, DomainTensor):
        return F.linear(local, w, b)
    dec = out._dec
    back = {2: 0, 0: 1} if batched else {2: 0}
    shard = {back[d]: ax for d, ax in dec.shard.items() if d in back}
    sizes = {back[d]: dec.block_sizes(d) for d in dec.shard if d in back}
    glob = (dec.global_shape[2],) + ((dec.global_shape[0],) if batched else ()) + (w.shape[0],)
    odec = layout.derive(dec, glob, shard, sizes)
    local = F.linear(local, enter_domain(w, odec, {}),
                     None if b is None else enter_domain(b, odec, {}))
    return DomainTensor(local, odec)
