"""Elementwise ops: arithmetic, math functions, activations, comparisons, where,
in their functional, method, in-place and operator forms.

No communication unless operands disagree on their layout (see ``common``).
An in-place op writes into its DomainTensor's block and keeps its layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from ..tensor import layout
from ..tensor.aliasing import writes_operand
from ..tensor.dispatch import UnsupportedOpError, flat, op_name, register, register_attribute
from ..tensor.domain_tensor import DomainTensor
from .common import onto, output_layout, wrap

T = torch.Tensor

# Names of elementwise ops; each is registered in every form that exists:
# torch.<name>, Tensor.<name>, Tensor.<name>_ and torch.nn.functional.<name>.
NAMES = """
abs absolute acos arccos acosh arccosh add addcdiv addcmul angle asin arcsin asinh arcsinh
atan arctan atan2 arctan2 atanh arctanh bitwise_and bitwise_not bitwise_or bitwise_xor
bitwise_left_shift bitwise_right_shift ceil clamp clamp_min clamp_max clip conj conj_physical
copysign cos cosh deg2rad div divide digamma erf erfc erfinv exp exp2 expm1 float_power floor
floor_divide fmod frac hypot i0 igamma igammac lerp lgamma log log10 log1p log2 logaddexp
logaddexp2 logical_and logical_not logical_or logical_xor logit maximum minimum fmax fmin mul
multiply mvlgamma nan_to_num neg negative nextafter polygamma positive pow rad2deg reciprocal
remainder round rsqrt sigmoid sign sgn signbit sin sinc sinh sqrt square sub subtract tan tanh
true_divide trunc fix xlogy where eq ne lt le gt ge greater greater_equal less less_equal
not_equal isnan isinf isposinf isneginf isfinite isreal isclose heaviside masked_fill relu
zero_ fill_ copy_ real imag resolve_conj resolve_neg
relu6 elu selu celu gelu silu mish leaky_relu hardtanh hardswish hardsigmoid softplus softsign
tanhshrink threshold logsigmoid hardshrink softshrink rrelu_ glu_never
""".split()

# Operator forms (a + b, b + a, a += b ...).
DUNDERS = """
__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__
__rtruediv__ __itruediv__ __floordiv__ __rfloordiv__ __ifloordiv__ __mod__ __rmod__ __imod__
__pow__ __rpow__ __ipow__ __neg__ __pos__ __abs__ __invert__ __and__ __rand__ __iand__ __or__
__ror__ __ior__ __xor__ __rxor__ __ixor__ __lshift__ __rlshift__ __ilshift__ __rshift__
__rrshift__ __irshift__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__
""".split()


def _forms(names):
    for name in names:
        for owner in (torch, T, F, torch.special):
            for n in (name, name + "_") if not name.endswith("_") else (name,):
                f = getattr(owner, n, None)
                if callable(f):
                    yield f
    for name in DUNDERS:
        f = getattr(T, name, None)
        if f is not None:
            yield f


def _operands(args, kwargs):
    return [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]


def _local_operands(args, kwargs, out_dec, is_flat: bool):
    """``args`` and ``kwargs`` with every tensor as this rank's operand (``onto``);
    ``is_flat``: ``flat(args, kwargs)``."""
    if is_flat:
        return (tuple(onto(a, out_dec) for a in args),
                {k: onto(v, out_dec) for k, v in kwargs.items()})
    return (pytree.tree_map(lambda a: onto(a, out_dec), args),
            pytree.tree_map(lambda a: onto(a, out_dec), kwargs))


@register(*_forms(NAMES))
def elementwise(func, args, kwargs):
    """Local (a repartition when operands are laid out differently). Broadcasting elementwise
    ops in every form: torch., Tensor., in place, operators, F. activations, comparisons,
    where; plain tensors broadcast against a sharded dim are sliced to the block."""
    if "out" in kwargs and kwargs["out"] is not None:
        raise UnsupportedOpError(f"{op_name(func)}: out= is not supported on DomainTensors; "
                                 f"assign the result instead")
    is_flat = flat(args, kwargs)
    operands = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)] \
        if is_flat else _operands(args, kwargs)
    out_dec, out_shape = output_layout(func, operands)
    local_args, local_kwargs = _local_operands(args, kwargs, out_dec, is_flat)
    if writes_operand(func, args, kwargs):
        target = args[0]
        if not isinstance(target, DomainTensor):
            raise UnsupportedOpError(
                f"{op_name(func)}: an in-place op on a plain tensor cannot take a sharded "
                f"operand (the result would be sharded)")
        if target._dec != out_dec:
            raise UnsupportedOpError(
                f"{op_name(func)}: in place, the result layout {out_dec} must be that of the "
                f"tensor written to, {target._dec}")
        local_args = (target._local,) + tuple(local_args[1:])
        func(*local_args, **local_kwargs)
        return target
    return wrap(func, func(*local_args, **local_kwargs), out_dec)


@register(torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like)
def constant_like(func, args, kwargs):
    """Local. A constant tensor with the layout of its DomainTensor argument (each
    rank fills its block). The random ``*_like`` ops have no rule: per-block
    draws would not equal one process's draw."""
    x = args[0] if args else kwargs.pop("input")
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: a DomainTensor fill value is not supported")
    if kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
        raise UnsupportedOpError(f"{op_name(func)}: memory_format is not supported on "
                                 f"DomainTensors")
    return DomainTensor(func(x._local, *args[1:], **kwargs), x._dec)


@register(torch.view_as_real, torch.view_as_complex)
def complex_view(func, args, kwargs):
    """Local. view_as_real adds a trailing unsharded dim of size 2 (real, imaginary);
    view_as_complex drops it (it must not be sharded). Sharded dims keep their layout."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: needs a DomainTensor input")
    # torch's own checks (dtype, a last dim of size 2) on the global shape
    shape = tuple(func(torch.empty(x.shape, dtype=x.dtype, device="meta")).shape)
    if func is torch.view_as_complex and x.ndim - 1 in x._dec.shard:
        raise UnsupportedOpError(
            f"{op_name(func)}: the last dim (real, imaginary) is sharded on "
            f"{layout.sharded_dims_text(x._dec)}; redistribute so that it is not")
    local = x._local
    if func is torch.view_as_complex and not (
            local.stride(-1) == 1 and local.storage_offset() % 2 == 0
            and all(s % 2 == 0 for s in local.stride()[:-1])):
        local = local.contiguous()  # a block sliced out of a larger one may not be viewable
    return DomainTensor(func(local), layout.remap(x._dec, shape, {d: d for d in x._dec.shard}))


@register(F.prelu)
def prelu(func, args, kwargs):
    """prelu's weight applies along the channel dim (1; 0 for a 1-D input), not by
    broadcasting from the right; a per-channel weight is cut to a sharded channel dim."""
    x, weight = (list(args) + [kwargs.get("weight")])[:2]
    if not isinstance(x, DomainTensor) or isinstance(weight, DomainTensor):
        raise UnsupportedOpError(f"{op_name(func)}: needs a DomainTensor input and a plain weight")
    from ..tensor.params import enter_domain
    channel = 1 if x.dim() >= 2 else 0
    per_channel = weight.numel() > 1 and channel in x._dec.shard
    w = enter_domain(weight, x._dec, {0: channel} if per_channel else {})
    return DomainTensor(F.prelu(x._local, w), x._dec)


@register_attribute("real")
def _real(self):
    return DomainTensor(self._local.real, self._dec)


@register_attribute("imag")
def _imag(self):
    return DomainTensor(self._local.imag, self._dec)
