"""Triton kernels of the sub-byte and fp8 block codecs (packed int4/int2, sign, fp8).

Numerics follow :mod:`gradcomp.kernels.reference_lowbit` bit for bit, with the int8 kernels'
rules (:mod:`.quantize`): IEEE division (``div_rn``), no fused multiply-add
(``enable_fp_fusion=False``), rounding by adding and subtracting ``1.5 * 2**23``. One program
quantizes ROWS blocks: pass 1 reads a block in chunks for its absmax (and, for sign, sums
``|x|`` by halving each chunk of ``min(block_size, 256)`` elements, then the chunks' sums
left to right); pass 2 computes each output byte from its ``8 // bits`` elements (one strided
load per element of a byte). fp8 codes are computed on the float32 bit patterns (no fp8
dtype needed), as PyTorch's conversion does for values within the format's range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gradcomp.kernels.ops import kernel
from gradcomp.kernels.reference_lowbit import SUM_TILE
from gradcomp.kernels.triton._common import counter_uniform, device_guard, kernel_view, round_half_even, widen

__all__ = [
    "quantize_packed", "quantize_packed_ef", "dequantize_packed", "dequantize_packed_add_", "quantize_sign",
    "quantize_sign_ef", "dequantize_sign", "dequantize_sign_add_", "quantize_fp8", "quantize_fp8_ef",
    "dequantize_fp8", "dequantize_fp8_add_",
]

# codec kinds (constexpr)
_PACKED, _SIGN, _FP8 = 0, 1, 2
_E4M3, _E5M2 = 0, 1
_NAN_BITS = tl.constexpr(0x7FC00000)
_TILE_GPU, _TILE_CPU = 4096, 512


@triton.jit
def _to_fp8(y, FMT: tl.constexpr):
    """float32 -> fp8 bits (int32), round half to even, for |y| <= the format's largest finite value."""
    b = y.to(tl.uint32, bitcast=True)
    sign = b & 0x80000000
    b = b ^ sign
    if FMT == 0:  # e4m3fn: below 2**-6 the addition of 2**14 rounds the mantissa
        sub = (b.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000
        nrm = (b - 0x3C000000 + 0x7FFFF + ((b >> 20) & 1)) >> 20
        r = tl.where(b < 0x3C800000, sub, nrm)
    else:  # e5m2: below 2**-14, 2**7
        sub = (b.to(tl.float32, bitcast=True) + 128.0).to(tl.uint32, bitcast=True) - 0x43000000
        nrm = (b - 0x38000000 + 0xFFFFF + ((b >> 21) & 1)) >> 21
        r = tl.where(b < 0x38800000, sub, nrm)
    return (r | (sign >> 24)).to(tl.int32)


@triton.jit
def _from_fp8(c, FMT: tl.constexpr):
    """fp8 bits (int32 in [0, 255], not NaN / Inf) -> float32, exactly."""
    if FMT == 0:
        e = (c >> 3) & 15
        m = c & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    else:
        e = (c >> 2) & 31
        m = c & 3
        normal = (((e + 112) << 23) | (m << 21)).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, m.to(tl.float32) * 1.52587890625e-05, normal)  # m * 2**-16
    return tl.where((c & 0x80) != 0, -v, v)


@triton.jit
def _load_p(x_ptr, r_ptr, offs, mask, KIND: tl.constexpr, EF: tl.constexpr):
    p = widen(tl.load(x_ptr + offs, mask=mask, other=0), KIND)
    if EF:
        p = p + tl.load(r_ptr + offs, mask=mask, other=0.0)
    return p


@triton.jit
def _fold(a, ROWS: tl.constexpr, CHUNK: tl.constexpr, LOG2: tl.constexpr):
    """Per row, the sum of a [ROWS, CHUNK] tile by halving (a[:, :h] + a[:, h:], ...)."""
    for i in tl.static_range(LOG2):
        a = tl.sum(tl.reshape(a, [ROWS, 2, CHUNK >> (i + 1)]), axis=1)
    return tl.reshape(a, [ROWS])


@triton.jit
def _code(p, m, live, key, offs, CODEC: tl.constexpr, BITS: tl.constexpr, STOCHASTIC: tl.constexpr,
          FMT: tl.constexpr):
    """The integer code (int32) of float32 values p in blocks of absmax m."""
    if CODEC == 0:
        q: tl.constexpr = (1 << (BITS - 1)) - 1
        y = tl.math.div_rn(p, m) * q
        if STOCHASTIC:
            z = y + counter_uniform(offs, key)
            r = round_half_even(z)
            c = tl.where(r > z, r - 1.0, r)  # floor(z)
        else:
            c = round_half_even(y)
        c = tl.minimum(tl.maximum(c, -q), q).to(tl.int32)
    elif CODEC == 1:
        c = (p < 0.0).to(tl.int32)
    else:
        fmax: tl.constexpr = 448.0 if FMT == 0 else 57344.0
        inv = tl.math.div_rn(fmax, m)
        y = tl.where(inv <= 3.4028234663852886e38, p * inv, tl.math.div_rn(p, m) * fmax)
        c = _to_fp8(y, FMT)
    return tl.where(live, c, 0)


@triton.jit
def _value(c, s, CODEC: tl.constexpr, BITS: tl.constexpr, FMT: tl.constexpr):
    """Decoded float32 value of code c (int32, the field's bits) in a block of scale s."""
    if CODEC == 0:
        half: tl.constexpr = 1 << (BITS - 1)
        return ((c ^ half) - half).to(tl.float32) * s  # sign-extended field
    elif CODEC == 1:
        return tl.where(c != 0, -s, s)
    else:
        return _from_fp8(c, FMT) * s


@triton.jit(do_not_specialize=["n", "nblocks", "key"])
def _quantize_kernel(x_ptr, r_ptr, c_ptr, s_ptr, n, nblocks, key, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr,
                     CHUNK: tl.constexpr, LOG2: tl.constexpr, KIND: tl.constexpr, EF: tl.constexpr,
                     CODEC: tl.constexpr, BITS: tl.constexpr, STOCHASTIC: tl.constexpr, FMT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < nblocks
    cols = tl.arange(0, CHUNK)
    m = tl.zeros([ROWS], tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    bad = tl.zeros([ROWS], tl.int32)
    for c0 in range(0, BLOCK_SIZE, CHUNK):  # pass 1: absmax, non-finite flag (and the sum of |p|)
        offs = rows[:, None] * BLOCK_SIZE + (c0 + cols)[None, :]
        p = _load_p(x_ptr, r_ptr, offs, row_ok[:, None] & (offs < n), KIND, EF)
        a = tl.abs(p)
        finite = (a.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000
        bad = tl.maximum(bad, tl.max(tl.where(finite, 0, 1), axis=1))
        m = tl.maximum(m, tl.max(tl.where(finite, a, 0.0), axis=1))
        if CODEC == 1:
            f = _fold(tl.where(finite, a, 0.0), ROWS, CHUNK, LOG2)
            total = tl.where(c0 == 0, f, total + f)
    live = (bad == 0) & (m > 0.0)
    nan = tl.full([ROWS], _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    if CODEC == 0:
        scale = tl.math.div_rn(m, tl.full([ROWS], (1 << (BITS - 1)) - 1, tl.float32))
    elif CODEC == 1:
        count = tl.minimum(n - rows * BLOCK_SIZE, BLOCK_SIZE).to(tl.float32)
        scale = tl.minimum(tl.math.div_rn(total, tl.where(row_ok, count, 1.0)), m)
    else:
        scale = tl.math.div_rn(m, tl.full([ROWS], 448.0 if FMT == 0 else 57344.0, tl.float32))
    scale = tl.where(bad == 0, scale, nan)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    per: tl.constexpr = 8 // BITS
    bcols = tl.arange(0, CHUNK // per)
    div = tl.broadcast_to(tl.where(live, m, 1.0)[:, None], [ROWS, CHUNK // per])
    for c0 in range(0, BLOCK_SIZE, CHUNK):  # pass 2: one output byte from its `per` elements
        byte = tl.zeros([ROWS, CHUNK // per], tl.int32)
        first = rows[:, None] * BLOCK_SIZE + c0 + bcols[None, :] * per
        for k in tl.static_range(per):
            offs = first + k
            mask = row_ok[:, None] & (offs < n)
            p = _load_p(x_ptr, r_ptr, offs, mask, KIND, EF)
            c = _code(p, div, live[:, None], key, offs, CODEC, BITS, STOCHASTIC, FMT)
            field = c & ((1 << BITS) - 1)
            byte = byte | (field << (k * BITS))
            if EF:
                tl.store(r_ptr + offs, p - _value(field, scale[:, None], CODEC, BITS, FMT), mask=mask)
        tl.store(c_ptr + first // per, byte.to(tl.uint8), mask=row_ok[:, None] & (first < n))


@triton.jit(do_not_specialize=["n"])
def _decode_kernel(c_ptr, s_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, ADD: tl.constexpr,
                   CODEC: tl.constexpr, BITS: tl.constexpr, FMT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < n
    per: tl.constexpr = 8 // BITS
    byte = tl.load(c_ptr + offs // per, mask=mask, other=0).to(tl.int32)
    c = (byte >> ((offs % per).to(tl.int32) * BITS)) & ((1 << BITS) - 1)
    v = _value(c, tl.load(s_ptr + offs // BLOCK_SIZE, mask=mask, other=0.0), CODEC, BITS, FMT)
    if ADD:
        v = tl.load(out_ptr + offs, mask=mask, other=0.0) + v
    tl.store(out_ptr + offs, v, mask=mask)


def _tile(t: torch.Tensor) -> int:
    return _TILE_GPU if t.device.type == "cuda" else _TILE_CPU


def _quantize(x, residual, block_size, codes, scales, codec, bits=8, stochastic=False, key=0, fmt=_E4M3):
    n = x.numel()
    if n == 0:
        return
    if x.dtype == torch.float64:
        x = x.to(torch.float32)  # as the reference does
    xin, kind = kernel_view(x)
    chunk = min(block_size, SUM_TILE if codec == _SIGN else _tile(x))
    rows = max(1, _tile(x) // chunk)
    nblocks = -(-n // block_size)
    ef = residual is not None
    with device_guard(x):
        _quantize_kernel[(triton.cdiv(nblocks, rows),)](
            xin, residual.view(-1) if ef else xin, codes, scales, n, nblocks, key, BLOCK_SIZE=block_size,
            ROWS=rows, CHUNK=chunk, LOG2=chunk.bit_length() - 1, KIND=kind, EF=ef, CODEC=codec, BITS=bits,
            STOCHASTIC=bool(stochastic), FMT=fmt, num_warps=8, enable_fp_fusion=False,
        )


def _decode(codes, scales, block_size, out, add, codec, bits=8, fmt=_E4M3):
    n = out.numel()
    if n == 0:
        return
    tile = _tile(out)
    with device_guard(out):
        _decode_kernel[(triton.cdiv(n, tile),)](
            codes, scales, out.view(-1), n, BLOCK_SIZE=block_size, TILE=tile, ADD=add, CODEC=codec, BITS=bits,
            FMT=fmt, num_warps=8, enable_fp_fusion=False,
        )


def _fmt(name: str) -> int:
    return _E4M3 if name == "e4m3" else _E5M2


@kernel("triton")
def quantize_packed(x, bits, block_size, stochastic, key, codes, scales):
    """Packed ``bits``-bit absmax codes of a contiguous 1-D tensor (reference_lowbit.quantize_packed)."""
    _quantize(x, None, block_size, codes, scales, _PACKED, bits, stochastic, key)


@kernel("triton")
def quantize_packed_ef(x, residual, bits, block_size, stochastic, key, codes, scales):
    """:func:`quantize_packed` of ``x + residual``, the residual updated in the same kernel."""
    _quantize(x, residual, block_size, codes, scales, _PACKED, bits, stochastic, key)


@kernel("triton")
def dequantize_packed(codes, scales, bits, block_size, out):
    """``out = code * scale`` (float32, out's numel elements)."""
    _decode(codes, scales, block_size, out, False, _PACKED, bits)


@kernel("triton")
def dequantize_packed_add_(acc, codes, scales, bits, block_size):
    """``acc += code * scale`` (the product rounded first)."""
    _decode(codes, scales, block_size, acc, True, _PACKED, bits)


@kernel("triton")
def quantize_sign(x, block_size, codes, scales):
    """Scaled sign of a contiguous 1-D tensor (reference_lowbit.quantize_sign)."""
    _quantize(x, None, block_size, codes, scales, _SIGN, 1)


@kernel("triton")
def quantize_sign_ef(x, residual, block_size, codes, scales):
    """:func:`quantize_sign` of ``x + residual``, the residual updated in the same kernel."""
    _quantize(x, residual, block_size, codes, scales, _SIGN, 1)


@kernel("triton")
def dequantize_sign(codes, scales, block_size, out):
    """``out = bit ? -scale : scale``."""
    _decode(codes, scales, block_size, out, False, _SIGN, 1)


@kernel("triton")
def dequantize_sign_add_(acc, codes, scales, block_size):
    """``acc += bit ? -scale : scale``."""
    _decode(codes, scales, block_size, acc, True, _SIGN, 1)


@kernel("triton")
def quantize_fp8(x, fmt, block_size, codes, scales):
    """Blockwise-scaled fp8 codes of a contiguous 1-D tensor (reference_lowbit.quantize_fp8)."""
    _quantize(x, None, block_size, codes, scales, _FP8, fmt=_fmt(fmt))


@kernel("triton")
def quantize_fp8_ef(x, residual, fmt, block_size, codes, scales):
    """:func:`quantize_fp8` of ``x + residual``, the residual updated in the same kernel."""
    _quantize(x, residual, block_size, codes, scales, _FP8, fmt=_fmt(fmt))


@kernel("triton")
def dequantize_fp8(codes, scales, fmt, block_size, out):
    """``out = float(code) * scale``."""
    _decode(codes, scales, block_size, out, False, _FP8, fmt=_fmt(fmt))


@kernel("triton")
def dequantize_fp8_add_(acc, codes, scales, fmt, block_size):
    """``acc += float(code) * scale``."""
    _decode(codes, scales, block_size, acc, True, _FP8, fmt=_fmt(fmt))
