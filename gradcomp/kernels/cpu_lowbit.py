"""Registry backend ``cpu``, continued: the native kernels of the sub-byte and fp8 block codecs.

The ops of :mod:`gradcomp.kernels.lowbit` (packed int4/int2, sign, fp8) on CPU tensors, by
``gradcomp._C`` (csrc/cpu/lowbit.cpp, OpenMP over blocks, the GIL released), bit for bit
:mod:`gradcomp.kernels.reference_lowbit`. Imported by the registry once :mod:`gradcomp.kernels.cpu`
is usable (its ``KERNEL_MODULES``).
"""

from __future__ import annotations

import torch

from gradcomp.kernels.cpu import as_numpy, dtype_name, flat_cpu, native, out_numpy
from gradcomp.kernels.ops import kernel
from gradcomp.kernels.reference_lowbit import packed_nbytes, sign_nbytes

__all__ = ["quantize_packed", "quantize_packed_ef", "dequantize_packed", "dequantize_packed_add_",
           "reduce_quantize_packed", "quantize_sign", "quantize_sign_ef", "dequantize_sign",
           "dequantize_sign_add_", "quantize_fp8", "quantize_fp8_ef", "dequantize_fp8", "dequantize_fp8_add_"]


def _x(x):
    xf = flat_cpu("x", x)
    return as_numpy(xf), dtype_name("x", xf), xf.numel()


def _outs(codes, scales, ncodes, n, block_size):
    return (out_numpy("codes", codes, torch.uint8, ncodes),
            out_numpy("scales", scales, torch.float32, -(-n // block_size)))


def _res(residual, n):
    return None if residual is None else out_numpy("residual", residual, torch.float32, n)


def _packed(x, residual, bits, block_size, stochastic, key, codes, scales):
    xv, dt, n = _x(x)
    cv, sv = _outs(codes, scales, packed_nbytes(n, bits), n, block_size)
    native().quantize_packed(xv, dt, int(bits), block_size, bool(stochastic), int(key), cv, sv, _res(residual, n))


@kernel("cpu")
def quantize_packed(x, bits, block_size, stochastic, key, codes, scales):
    """Packed ``bits``-bit blockwise absmax codes of CPU x (reference_lowbit.quantize_packed)."""
    _packed(x, None, bits, block_size, stochastic, key, codes, scales)


@kernel("cpu")
def quantize_packed_ef(x, residual, bits, block_size, stochastic, key, codes, scales):
    """:func:`quantize_packed` of ``x + residual``, the residual updated in the same pass."""
    _packed(x, residual, bits, block_size, stochastic, key, codes, scales)


def _decode_args(codes, scales, out):
    return flat_cpu("codes", codes).numpy(), flat_cpu("scales", scales).numpy(), \
        out_numpy("out", out, torch.float32, out.numel())


@kernel("cpu")
def dequantize_packed(codes, scales, bits, block_size, out):
    """``out = code * scale`` (float32 out of the element count)."""
    c, s, o = _decode_args(codes, scales, out)
    native().dequantize_packed(c, s, int(bits), block_size, o, False)


@kernel("cpu")
def dequantize_packed_add_(acc, codes, scales, bits, block_size):
    """``acc += code * scale`` (the product rounded first)."""
    c, s, a = _decode_args(codes, scales, acc)
    native().dequantize_packed(c, s, int(bits), block_size, a, True)


@kernel("cpu")
def reduce_quantize_packed(acc, codes, scales, bits, block_size, divisor, stochastic, key, decode, out_codes,
                           out_scales):
    """:func:`gradcomp.kernels.reduce_quantize_packed` in one native pass per block."""
    c, s, a = _decode_args(codes, scales, acc)
    n = acc.numel()
    cv, sv = _outs(out_codes, out_scales, packed_nbytes(n, bits), n, block_size)
    native().reduce_quantize_packed(a, c, s, int(bits), block_size, float(divisor), bool(stochastic), int(key),
                                    cv, sv, bool(decode))


def _sign(x, residual, block_size, codes, scales):
    xv, dt, n = _x(x)
    cv, sv = _outs(codes, scales, sign_nbytes(n), n, block_size)
    native().quantize_sign(xv, dt, block_size, cv, sv, _res(residual, n))


@kernel("cpu")
def quantize_sign(x, block_size, codes, scales):
    """Scaled sign of CPU x (reference_lowbit.quantize_sign)."""
    _sign(x, None, block_size, codes, scales)


@kernel("cpu")
def quantize_sign_ef(x, residual, block_size, codes, scales):
    """:func:`quantize_sign` of ``x + residual``, the residual updated in the same pass."""
    _sign(x, residual, block_size, codes, scales)


@kernel("cpu")
def dequantize_sign(codes, scales, block_size, out):
    """``out = bit ? -scale : scale``."""
    c, s, o = _decode_args(codes, scales, out)
    native().dequantize_sign(c, s, block_size, o, False)


@kernel("cpu")
def dequantize_sign_add_(acc, codes, scales, block_size):
    """``acc += bit ? -scale : scale``."""
    c, s, a = _decode_args(codes, scales, acc)
    native().dequantize_sign(c, s, block_size, a, True)


def _fp8(x, residual, fmt, block_size, codes, scales):
    xv, dt, n = _x(x)
    cv, sv = _outs(codes, scales, n, n, block_size)
    native().quantize_fp8(xv, dt, fmt, block_size, cv, sv, _res(residual, n))


@kernel("cpu")
def quantize_fp8(x, fmt, block_size, codes, scales):
    """Blockwise-scaled fp8 codes of CPU x (reference_lowbit.quantize_fp8)."""
    _fp8(x, None, fmt, block_size, codes, scales)


@kernel("cpu")
def quantize_fp8_ef(x, residual, fmt, block_size, codes, scales):
    """:func:`quantize_fp8` of ``x + residual``, the residual updated in the same pass."""
    _fp8(x, residual, fmt, block_size, codes, scales)


@kernel("cpu")
def dequantize_fp8(codes, scales, fmt, block_size, out):
    """``out = float(code) * scale``."""
    c, s, o = _decode_args(codes, scales, out)
    native().dequantize_fp8(c, s, fmt, block_size, o, False)


@kernel("cpu")
def dequantize_fp8_add_(acc, codes, scales, fmt, block_size):
    """``acc += float(code) * scale``."""
    c, s, a = _decode_args(codes, scales, acc)
    native().dequantize_fp8(c, s, fmt, block_size, a, True)
