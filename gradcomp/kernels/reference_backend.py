"""Backend ``reference``: the pure-PyTorch kernels, the default kernel of every op.

Each function implements one op of :mod:`gradcomp.kernels.ops` with its
schema's arguments, by the oracle of :mod:`gradcomp.kernels.reference`. They
run on any device. The fused ops are defined here as the composition of the
others (``compose_*``):
their default kernels compose the ops through the dispatcher, so on a device
whose backend lacks the fused kernel they run that backend's ops.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from gradcomp.kernels import reference as R
from gradcomp.kernels import reference_lowbit as L
from gradcomp.kernels.ops import kernel
from gradcomp.kernels.ops import op as _dispatcher

__all__ = [
    "unavailable_reason", "devices", "quantize_int8", "dequantize_int8", "dequantize_int8_add_",
    "quantize_int8_ef", "topk", "threshold", "approx_topk", "scatter_add_", "dgc_accumulate_",
    "quantize_packed", "quantize_packed_ef", "dequantize_packed", "dequantize_packed_add_", "quantize_sign",
    "quantize_sign_ef", "dequantize_sign", "dequantize_sign_add_", "quantize_fp8", "quantize_fp8_ef",
    "dequantize_fp8", "dequantize_fp8_add_", "compose_reduce_quantize_int8",
    "compose_reduce_quantize_packed", "compose_dgc_topk_", "reduce_quantize_int8", "dgc_topk_",
    "reduce_quantize_packed", "COMPOSITIONS",
]


def unavailable_reason() -> str | None:
    return None


def devices() -> frozenset[str]:
    """Every device type: the reference is plain torch."""
    return _ANY


class _Any(frozenset):
    def __contains__(self, item) -> bool:  # every device type
        return True


_ANY = _Any()


@kernel("reference")
def quantize_int8(x, block_size, stochastic, key, q, scales):
    rq, rs = R.quantize_key(x, block_size, stochastic, key)
    q.copy_(rq)
    scales.copy_(rs)


@kernel("reference")
def dequantize_int8(q, scales, block_size, check_int8, out):
    if check_int8:
        R.check_int8_values(q, scales)
    R.dequantize_int8(q, scales, block_size, out)


@kernel("reference")
def dequantize_int8_add_(acc, q, scales, block_size, check_int8):
    if check_int8:
        R.check_int8_values(q, scales)
    R.dequantize_int8_add_(acc, q, scales, block_size)


@kernel("reference")
def quantize_int8_ef(x, residual, block_size, stochastic, key, q, scales):
    p = x.reshape(-1).to(torch.float32) + residual.view(-1)
    quantize_int8(p, block_size, stochastic, key, q, scales)
    residual.view(-1).copy_(p - R.dequantize_int8(q, scales, block_size))


@kernel("reference")
def topk(x, k):
    return R.topk(x, k)


@kernel("reference")
def threshold(x, tau):
    return R.threshold(x, tau)


@kernel("reference")
def approx_topk(x, k):
    return R.approx_topk(x, k)


@kernel("reference")
def scatter_add_(acc, indices, values):
    R.check_indices(indices, acc.numel())
    R.scatter_add_(acc, indices, values)


@kernel("reference")
def dgc_accumulate_(g, u, v, momentum, scale):
    R.dgc_accumulate_(g, u, v, momentum, scale)


# ------------------------------------------------- sub-byte and fp8 block codecs


def _write(outs, results) -> None:
    for out, r in zip(outs, results):
        out.copy_(r)


@kernel("reference")
def quantize_packed(x, bits, block_size, stochastic, key, codes, scales):
    _write((codes, scales), L.quantize_packed(x, bits, block_size, stochastic, key))


@kernel("reference")
def quantize_packed_ef(x, residual, bits, block_size, stochastic, key, codes, scales):
    _write((codes, scales), L.quantize_packed_ef(x, residual, bits, block_size, stochastic, key))


@kernel("reference")
def dequantize_packed(codes, scales, bits, block_size, out):
    out.view(-1).copy_(L.dequantize_packed(codes, scales, bits, block_size, out.numel()))


@kernel("reference")
def dequantize_packed_add_(acc, codes, scales, bits, block_size):
    L.dequantize_packed_add_(acc, codes, scales, bits, block_size)


@kernel("reference")
def quantize_sign(x, block_size, codes, scales):
    _write((codes, scales), L.quantize_sign(x, block_size))


@kernel("reference")
def quantize_sign_ef(x, residual, block_size, codes, scales):
    _write((codes, scales), L.quantize_sign_ef(x, residual, block_size))


@kernel("reference")
def dequantize_sign(codes, scales, block_size, out):
    out.view(-1).copy_(L.dequantize_sign(codes, scales, block_size, out.numel()))


@kernel("reference")
def dequantize_sign_add_(acc, codes, scales, block_size):
    L.dequantize_sign_add_(acc, codes, scales, block_size)


@kernel("reference")
def quantize_fp8(x, fmt, block_size, codes, scales):
    _write((codes, scales), L.quantize_fp8(x, fmt, block_size))


@kernel("reference")
def quantize_fp8_ef(x, residual, fmt, block_size, codes, scales):
    _write((codes, scales), L.quantize_fp8_ef(x, residual, fmt, block_size))


@kernel("reference")
def dequantize_fp8(codes, scales, fmt, block_size, out):
    out.view(-1).copy_(L.dequantize_fp8(codes, scales, fmt, block_size))


@kernel("reference")
def dequantize_fp8_add_(acc, codes, scales, fmt, block_size):
    L.dequantize_fp8_add_(acc, codes, scales, fmt, block_size)


# ----------------------------------------------------------------- fused ops


def compose_reduce_quantize_int8(ops: Mapping[str, Callable], acc, q, scales, block_size, divisor, stochastic,
                                 key, decode, check_int8, out_q, out_scales) -> None:
    """``reduce_quantize_int8`` as the composition of ``ops`` (op name -> kernel)::

        acc += D(q, scales); acc /= divisor; (out_q, out_scales) = Q(acc); if decode: acc = D(out_q, out_scales)
    """
    ops["dequantize_int8_add_"](acc, q, scales, block_size, check_int8)
    if divisor != 1:
        acc.div_(divisor)
    ops["quantize_int8"](acc, block_size, stochastic, key, out_q, out_scales)
    if decode:
        ops["dequantize_int8"](out_q, out_scales, block_size, False, acc)


def compose_reduce_quantize_packed(ops: Mapping[str, Callable], acc, codes, scales, bits, block_size, divisor,
                                   stochastic, key, decode, out_codes, out_scales) -> None:
    """``reduce_quantize_packed`` as the composition of ``ops``, as
    :func:`compose_reduce_quantize_int8` with the packed ops."""
    ops["dequantize_packed_add_"](acc, codes, scales, bits, block_size)
    if divisor != 1:
        acc.div_(divisor)
    ops["quantize_packed"](acc, bits, block_size, stochastic, key, out_codes, out_scales)
    if decode:
        ops["dequantize_packed"](out_codes, out_scales, bits, block_size, acc)


def compose_dgc_topk_(ops: Mapping[str, Callable], g, u, v, momentum, scale, k):
    """``dgc_topk_`` as ``dgc_accumulate_`` then ``topk`` of ``v``, by ``ops``."""
    ops["dgc_accumulate_"](g, u, v, momentum, scale)
    return ops["topk"](v, k)


@kernel("reference")
def reduce_quantize_int8(acc, q, scales, block_size, divisor, stochastic, key, decode, check_int8, out_q,
                         out_scales):
    compose_reduce_quantize_int8(_dispatcher, acc, q, scales, block_size, divisor, stochastic, key, decode,
                                 check_int8, out_q, out_scales)


@kernel("reference")
def dgc_topk_(g, u, v, momentum, scale, k):
    return compose_dgc_topk_(_dispatcher, g, u, v, momentum, scale, k)


@kernel("reference")
def reduce_quantize_packed(acc, codes, scales, bits, block_size, divisor, stochastic, key, decode, out_codes,
                           out_scales):
    compose_reduce_quantize_packed(_dispatcher, acc, codes, scales, bits, block_size, divisor, stochastic, key,
                                   decode, out_codes, out_scales)


#: the compositions of the fused ops, for a backend that lacks their kernel
COMPOSITIONS = {"reduce_quantize_int8": compose_reduce_quantize_int8, "dgc_topk_": compose_dgc_topk_,
                "reduce_quantize_packed": compose_reduce_quantize_packed}
