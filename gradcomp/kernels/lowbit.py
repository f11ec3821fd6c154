"""Public kernel functions of the sub-byte and fp8 block codecs (packed int4/int2, sign, fp8).

Each validates its arguments, flattens its input, allocates the outputs not given and calls its
op (``torch.ops.gradcomp.<name>``, or the forced backend's kernel), as the int8 functions of
:mod:`gradcomp.kernels` do. The numerics are :mod:`gradcomp.kernels.reference_lowbit`'s; every
backend matches them bit for bit. Codes are uint8: packed ``8 // bits`` to a byte for the
integer codes (1 bit for sign), one fp8 bit pattern per byte for fp8.
"""

from __future__ import annotations

import torch

from gradcomp import _validate as v
from gradcomp.kernels._args import check_out, check_rounding_stream, nblocks
from gradcomp.kernels._args import flat_contiguous as flat
from gradcomp.kernels.reference_lowbit import FP8_FORMATS, PACKED_BITS, packed_nbytes, sign_nbytes
from gradcomp.kernels.registry import select

__all__ = ["quantize_packed", "quantize_packed_ef", "dequantize_packed", "dequantize_packed_add_",
           "reduce_quantize_packed", "quantize_sign", "quantize_sign_ef", "dequantize_sign",
           "dequantize_sign_add_", "quantize_fp8", "quantize_fp8_ef", "dequantize_fp8", "dequantize_fp8_add_",
           "check_bits", "check_fp8_format"]


def check_bits(bits) -> int:
    """``bits`` when it is a packed code width (:data:`PACKED_BITS`), else ValueError naming them."""
    if isinstance(bits, bool) or bits not in PACKED_BITS:
        raise ValueError(f"bits must be one of {PACKED_BITS}, got {bits!r}")
    return int(bits)


def check_fp8_format(fmt) -> str:
    """``fmt`` when it is an fp8 format name (:data:`FP8_FORMATS`), else ValueError naming them."""
    return v.choice("format", fmt, FP8_FORMATS)


def _outputs(x, ncodes, block_size, out_codes, out_scales):
    codes = check_out("out_codes", out_codes, ncodes, torch.uint8, x.device)
    scales = check_out("out_scales", out_scales, nblocks(x.numel(), block_size), torch.float32, x.device)
    if codes is None:
        codes = torch.empty(ncodes, dtype=torch.uint8, device=x.device)
    if scales is None:
        scales = torch.empty(nblocks(x.numel(), block_size), dtype=torch.float32, device=x.device)
    return codes, scales


def _check_codes(codes, scales, ncodes, n, block_size, device=None):
    v.tensor("codes", codes, (torch.uint8,))
    v.tensor("scales", scales, (torch.float32,))
    if codes.numel() != ncodes:
        raise ValueError(f"codes must have {ncodes} bytes for {n} elements, got {codes.numel()}")
    if scales.numel() != nblocks(n, block_size):
        raise ValueError(f"scales must have ceil(n / block_size) = {nblocks(n, block_size)} elements, "
                         f"got {scales.numel()}")
    dev = codes.device if device is None else device
    if codes.device != dev or scales.device != dev:
        raise ValueError(f"codes, scales and the output must be on one device, got {codes.device}, "
                         f"{scales.device} and {dev}")


def _dest(out, n, device):
    """The float32 output of a dequantize call: ``out`` checked, else a new tensor."""
    if out is None:
        return torch.empty(n, dtype=torch.float32, device=device)
    return check_out("out", out, n, torch.float32, device)


# ------------------------------------------------------------------ packed int


def quantize_packed(x: torch.Tensor, bits: int = 4, block_size: int = 256, rounding: str = "nearest",
                    seed: int = 0, counter: int = 0, *, out_codes=None, out_scales=None, backend=None):
    """Blockwise symmetric absmax quantization to ``bits``-bit codes, packed (int8's numerics
    with ``qmax = 2**(bits-1) - 1``; Dettmers et al. 2022; stochastic rounding as QSGD).

    Args:
        x: float32/float16/bfloat16/float64 tensor of any shape and device, n elements.
        bits: 4 (codes in [-7, 7], two per byte) or 2 (codes in [-1, 1], four per byte).
        block_size: a power of two in [32, 65536]. rounding: ``"nearest"`` or ``"stochastic"``.
        seed, counter: the random stream of stochastic rounding.
        out_codes, out_scales: optional uint8 ``[ceil(n bits / 8)]`` / float32 ``[ceil(n / block_size)]``.
        backend: force a kernel backend.

    Returns:
        ``(codes, scales)`` on x's device; a block with NaN/Inf has scale NaN and codes 0.

    Raises:
        TypeError / ValueError: bad arguments (named). BackendUnavailable: forced backend unusable.
    """
    v.tensor("x", x)
    bits, block_size = check_bits(bits), v.block_size(block_size)
    stochastic, key = check_rounding_stream(rounding, seed, counter)
    codes, scales = _outputs(x, packed_nbytes(x.numel(), bits), block_size, out_codes, out_scales)
    select("quantize_packed", x.device.type, backend)(flat(x), bits, block_size, stochastic, key, codes, scales)
    return codes, scales


def quantize_packed_ef(x: torch.Tensor, residual: torch.Tensor, bits: int = 4, block_size: int = 256,
                       rounding: str = "nearest", seed: int = 0, counter: int = 0, *, out_codes=None,
                       out_scales=None, backend=None):
    """Fused error feedback (Seide et al. 2014; Karimireddy et al. 2019) in one pass:
    ``p = x + residual; (codes, scales) = Q(p); residual <- p - D(codes, scales)``.

    Args:
        residual: contiguous float32, x's numel, x's device; updated in place.
        Others as :func:`quantize_packed`.
    """
    v.tensor("x", x)
    res = check_out("residual", residual, x.numel(), torch.float32, x.device)
    bits, block_size = check_bits(bits), v.block_size(block_size)
    stochastic, key = check_rounding_stream(rounding, seed, counter)
    codes, scales = _outputs(x, packed_nbytes(x.numel(), bits), block_size, out_codes, out_scales)
    select("quantize_packed_ef", x.device.type, backend)(flat(x), res, bits, block_size, stochastic, key,
                                                         codes, scales)
    return codes, scales


def dequantize_packed(codes: torch.Tensor, scales: torch.Tensor, n: int, bits: int = 4, block_size: int = 256,
                      *, out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """``code * scale`` per element (float32 product).

    Args:
        codes: uint8 ``[ceil(n bits / 8)]``; scales: float32 ``[ceil(n / block_size)]``, same device.
        n: number of elements. out: optional contiguous float32 tensor of n elements.

    Returns:
        float32 ``[n]`` (or ``out``).
    """
    n = v.integer("n", n, 0)
    bits, block_size = check_bits(bits), v.block_size(block_size)
    _check_codes(codes, scales, packed_nbytes(n, bits), n, block_size)
    dst = _dest(out, n, codes.device)
    select("dequantize_packed", codes.device.type, backend)(flat(codes), flat(scales), bits, block_size, dst)
    return dst if out is None else out


def dequantize_packed_add_(acc: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int = 4,
                           block_size: int = 256, *, backend: str | None = None) -> torch.Tensor:
    """``acc += code * scale`` in place (the product rounded first); acc: contiguous float32,
    its numel is the element count."""
    v.tensor("acc", acc, (torch.float32,))
    bits, block_size = check_bits(bits), v.block_size(block_size)
    n = acc.numel()
    _check_codes(codes, scales, packed_nbytes(n, bits), n, block_size, acc.device)
    dst = check_out("acc", acc, n, torch.float32, acc.device)
    select("dequantize_packed_add_", acc.device.type, backend)(dst, flat(codes), flat(scales), bits, block_size)
    return acc


def reduce_quantize_packed(acc: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int = 4,
                           block_size: int = 256, divisor: int = 1, rounding: str = "nearest", seed: int = 0,
                           counter: int = 0, *, out_codes=None, out_scales=None, decode: bool = False,
                           backend: str | None = None):
    """One reduce step of a compressed collective with packed codes; bit for bit::

        dequantize_packed_add_(acc, codes, scales, bits, block_size)
        if divisor != 1: acc.div_(divisor)
        codes2, scales2 = quantize_packed(acc, bits, block_size, rounding, seed, counter)
        if decode: dequantize_packed(codes2, scales2, acc.numel(), bits, block_size, out=acc)

    One pass per block with the native CPU backend; the composition elsewhere.

    Returns:
        ``(codes2, scales2)`` as :func:`quantize_packed`.
    """
    v.tensor("acc", acc, (torch.float32,))
    bits, block_size = check_bits(bits), v.block_size(block_size)
    n = acc.numel()
    _check_codes(codes, scales, packed_nbytes(n, bits), n, block_size, acc.device)
    dst = check_out("acc", acc, n, torch.float32, acc.device)
    divisor = v.integer("divisor", divisor, 1, 2**24)  # exact in float32
    v.flag("decode", decode)
    stochastic, key = check_rounding_stream(rounding, seed, counter)
    c2, s2 = _outputs(acc, packed_nbytes(n, bits), block_size, out_codes, out_scales)
    select("reduce_quantize_packed", acc.device.type, backend)(dst, flat(codes), flat(scales), bits, block_size,
                                                               divisor, stochastic, key, decode, c2, s2)
    return c2, s2


# ------------------------------------------------------------------------ sign


def quantize_sign(x: torch.Tensor, block_size: int = 1024, *, out_codes=None, out_scales=None, backend=None):
    """Scaled sign (EF-SignSGD, Karimireddy et al. 2019): one bit per element (1 where x < 0)
    and one float32 scale per block, ``min(mean |x|, max |x|)``.

    Args:
        x: floating tensor, n elements. block_size: a power of two in [32, 65536].
        out_codes, out_scales: optional uint8 ``[ceil(n / 8)]`` / float32 ``[ceil(n / block_size)]``.

    Returns:
        ``(codes, scales)``; a block with NaN/Inf has scale NaN and bits 0.
    """
    v.tensor("x", x)
    block_size = v.block_size(block_size)
    codes, scales = _outputs(x, sign_nbytes(x.numel()), block_size, out_codes, out_scales)
    select("quantize_sign", x.device.type, backend)(flat(x), block_size, codes, scales)
    return codes, scales


def quantize_sign_ef(x: torch.Tensor, residual: torch.Tensor, block_size: int = 1024, *, out_codes=None,
                     out_scales=None, backend=None):
    """Fused error feedback with the sign codec (as :func:`quantize_packed_ef`)."""
    v.tensor("x", x)
    res = check_out("residual", residual, x.numel(), torch.float32, x.device)
    block_size = v.block_size(block_size)
    codes, scales = _outputs(x, sign_nbytes(x.numel()), block_size, out_codes, out_scales)
    select("quantize_sign_ef", x.device.type, backend)(flat(x), res, block_size, codes, scales)
    return codes, scales


def dequantize_sign(codes: torch.Tensor, scales: torch.Tensor, n: int, block_size: int = 1024, *,
                    out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """``-scale`` where the bit is 1, ``+scale`` where 0: float32 ``[n]`` (or ``out``)."""
    n = v.integer("n", n, 0)
    block_size = v.block_size(block_size)
    _check_codes(codes, scales, sign_nbytes(n), n, block_size)
    dst = _dest(out, n, codes.device)
    select("dequantize_sign", codes.device.type, backend)(flat(codes), flat(scales), block_size, dst)
    return dst if out is None else out


def dequantize_sign_add_(acc: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_size: int = 1024,
                         *, backend: str | None = None) -> torch.Tensor:
    """``acc += decoded`` in place; acc: contiguous float32, its numel is the element count."""
    v.tensor("acc", acc, (torch.float32,))
    block_size = v.block_size(block_size)
    n = acc.numel()
    _check_codes(codes, scales, sign_nbytes(n), n, block_size, acc.device)
    dst = check_out("acc", acc, n, torch.float32, acc.device)
    select("dequantize_sign_add_", acc.device.type, backend)(dst, flat(codes), flat(scales), block_size)
    return acc


# ------------------------------------------------------------------------- fp8


def quantize_fp8(x: torch.Tensor, format: str = "e4m3", block_size: int = 256, *, out_codes=None,
                 out_scales=None, backend=None):
    """Blockwise-scaled fp8: per block ``scale = absmax / F`` (F = 448 for e4m3, 57344 for
    e5m2, the largest finite values of float8_e4m3fn / float8_e5m2) and the codes
    ``fp8(x * (F / absmax))``, rounded half to even (one division per block).

    Args:
        x: floating tensor, n elements. format: ``"e4m3"`` or ``"e5m2"``.
        block_size: a power of two in [32, 65536].
        out_codes, out_scales: optional uint8 ``[n]`` / float32 ``[ceil(n / block_size)]``.

    Returns:
        ``(codes, scales)``: fp8 bit patterns as uint8 (view them as the fp8 dtype) and scales;
        a block with NaN/Inf has scale NaN and codes 0.
    """
    v.tensor("x", x)
    fmt, block_size = check_fp8_format(format), v.block_size(block_size)
    codes, scales = _outputs(x, x.numel(), block_size, out_codes, out_scales)
    select("quantize_fp8", x.device.type, backend)(flat(x), fmt, block_size, codes, scales)
    return codes, scales


def quantize_fp8_ef(x: torch.Tensor, residual: torch.Tensor, format: str = "e4m3", block_size: int = 256, *,
                    out_codes=None, out_scales=None, backend=None):
    """Fused error feedback with the fp8 codec (as :func:`quantize_packed_ef`)."""
    v.tensor("x", x)
    res = check_out("residual", residual, x.numel(), torch.float32, x.device)
    fmt, block_size = check_fp8_format(format), v.block_size(block_size)
    codes, scales = _outputs(x, x.numel(), block_size, out_codes, out_scales)
    select("quantize_fp8_ef", x.device.type, backend)(flat(x), res, fmt, block_size, codes, scales)
    return codes, scales


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, format: str = "e4m3", block_size: int = 256, *,
                   out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """``float(code) * scale`` per element: float32 ``[codes.numel()]`` (or ``out``)."""
    fmt, block_size = check_fp8_format(format), v.block_size(block_size)
    v.tensor("codes", codes, (torch.uint8,))
    n = codes.numel()
    _check_codes(codes, scales, n, n, block_size)
    dst = _dest(out, n, codes.device)
    select("dequantize_fp8", codes.device.type, backend)(flat(codes), flat(scales), fmt, block_size, dst)
    return dst if out is None else out


def dequantize_fp8_add_(acc: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, format: str = "e4m3",
                        block_size: int = 256, *, backend: str | None = None) -> torch.Tensor:
    """``acc += decoded`` in place; acc: contiguous float32 of ``codes.numel()`` elements."""
    v.tensor("acc", acc, (torch.float32,))
    fmt, block_size = check_fp8_format(format), v.block_size(block_size)
    n = acc.numel()
    _check_codes(codes, scales, n, n, block_size, acc.device)
    dst = check_out("acc", acc, n, torch.float32, acc.device)
    select("dequantize_fp8_add_", acc.device.type, backend)(dst, flat(codes), flat(scales), fmt, block_size)
    return acc
