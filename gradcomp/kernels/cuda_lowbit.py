"""Registry backend ``cuda``, continued: the sub-byte and fp8 block codecs (csrc/cuda/lowbit.cu).

The ops of :mod:`gradcomp.kernels.lowbit` on CUDA tensors through CuPy, as
:mod:`gradcomp.kernels.cuda` runs the int8 ones: one quantize kernel per input type (and
error feedback), one decode kernel, the codec passed as arguments. Bit for bit
:mod:`gradcomp.kernels.reference_lowbit` (NaN payloads aside: a GPU writes the canonical NaN).
"""

from __future__ import annotations

import numpy as np
import torch

from gradcomp.kernels.cuda import grid_size, launch_kernel, pointer
from gradcomp.kernels.ops import kernel

__all__ = ["quantize_packed", "quantize_packed_ef", "dequantize_packed", "dequantize_packed_add_",
           "quantize_sign", "quantize_sign_ef", "dequantize_sign", "dequantize_sign_add_", "quantize_fp8",
           "quantize_fp8_ef", "dequantize_fp8", "dequantize_fp8_add_"]

_THREADS = 256  # GC_L_THREADS in lowbit.cu
_PACKED, _SIGN, _FP8 = 0, 1, 2  # GC_PACKED, GC_SIGN, GC_FP8
_SFX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _fmt(name: str) -> int:
    return 0 if name == "e4m3" else 1


def _quantize(x, residual, block_size, codes, scales, kind, bits=8, stochastic=False, key=0, fmt=0):
    n = x.numel()
    if n == 0:
        return
    if x.dtype == torch.float64:
        x = x.to(torch.float32)  # as the reference does
    nblocks = -(-n // block_size)
    per_cta = _THREADS // min(block_size, _THREADS)
    name = ("gc_lowbit_quantize_ef_" if residual is not None else "gc_lowbit_quantize_") + _SFX[x.dtype]
    r = residual.view(-1) if residual is not None else None
    launch_kernel("lowbit", name, -(-nblocks // per_cta), _THREADS,
           (pointer(x), pointer(r), pointer(codes), pointer(scales), np.int64(n), np.int32(block_size),
            np.uint32(key), np.int32(kind), np.int32(bits), np.int32(stochastic), np.int32(fmt)), x.device)


def _decode(codes, scales, block_size, out, add, kind, bits=8, fmt=0):
    n = out.numel()
    if n > 0:
        launch_kernel("lowbit", "gc_lowbit_decode", grid_size(n, _THREADS), _THREADS,
               (pointer(codes), pointer(scales), pointer(out), np.int64(n), np.int32(block_size.bit_length() - 1),
                np.int32(kind), np.int32(bits), np.int32(fmt), np.int32(add)), out.device)


@kernel("cuda")
def quantize_packed(x, bits, block_size, stochastic, key, codes, scales):
    """Packed ``bits``-bit absmax codes of a contiguous 1-D CUDA tensor (reference_lowbit.quantize_packed)."""
    _quantize(x, None, block_size, codes, scales, _PACKED, bits, stochastic, key)


@kernel("cuda")
def quantize_packed_ef(x, residual, bits, block_size, stochastic, key, codes, scales):
    """:func:`quantize_packed` of ``x + residual``, the residual updated in the same kernel."""
    _quantize(x, residual, block_size, codes, scales, _PACKED, bits, stochastic, key)


@kernel("cuda")
def dequantize_packed(codes, scales, bits, block_size, out):
    """``out = code * scale`` (float32)."""
    _decode(codes, scales, block_size, out, False, _PACKED, bits)


@kernel("cuda")
def dequantize_packed_add_(acc, codes, scales, bits, block_size):
    """``acc += code * scale`` (the product rounded first)."""
    _decode(codes, scales, block_size, acc, True, _PACKED, bits)


@kernel("cuda")
def quantize_sign(x, block_size, codes, scales):
    """Scaled sign of a contiguous 1-D CUDA tensor (reference_lowbit.quantize_sign)."""
    _quantize(x, None, block_size, codes, scales, _SIGN, 1)


@kernel("cuda")
def quantize_sign_ef(x, residual, block_size, codes, scales):
    """:func:`quantize_sign` of ``x + residual``, the residual updated in the same kernel."""
    _quantize(x, residual, block_size, codes, scales, _SIGN, 1)


@kernel("cuda")
def dequantize_sign(codes, scales, block_size, out):
    """``out = bit ? -scale : scale``."""
    _decode(codes, scales, block_size, out, False, _SIGN, 1)


@kernel("cuda")
def dequantize_sign_add_(acc, codes, scales, block_size):
    """``acc += bit ? -scale : scale``."""
    _decode(codes, scales, block_size, acc, True, _SIGN, 1)


@kernel("cuda")
def quantize_fp8(x, fmt, block_size, codes, scales):
    """Blockwise-scaled fp8 codes of a contiguous 1-D CUDA tensor (reference_lowbit.quantize_fp8)."""
    _quantize(x, None, block_size, codes, scales, _FP8, fmt=_fmt(fmt))


@kernel("cuda")
def quantize_fp8_ef(x, residual, fmt, block_size, codes, scales):
    """:func:`quantize_fp8` of ``x + residual``, the residual updated in the same kernel."""
    _quantize(x, residual, block_size, codes, scales, _FP8, fmt=_fmt(fmt))


@kernel("cuda")
def dequantize_fp8(codes, scales, fmt, block_size, out):
    """``out = float(code) * scale``."""
    _decode(codes, scales, block_size, out, False, _FP8, fmt=_fmt(fmt))


@kernel("cuda")
def dequantize_fp8_add_(acc, codes, scales, fmt, block_size):
    """``acc += float(code) * scale``."""
    _decode(codes, scales, block_size, acc, True, _FP8, fmt=_fmt(fmt))
