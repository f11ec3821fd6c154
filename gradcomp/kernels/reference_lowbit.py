"""Pure-PyTorch oracle of the sub-byte and fp8 block codecs (packed int4/int2, scaled sign, fp8).

Every backend reproduces these functions bit for bit. The input is read as float32 (as for
int8, :mod:`gradcomp.kernels.reference`), split into blocks of ``block_size`` elements (the last
one may be short) with one float32 scale each; a block holding NaN/Inf gets scale NaN (bits
``0x7FC00000``) and codes 0, so it decodes to NaN everywhere.

* packed int (``bits`` 4 or 2, ``qmax = 2**(bits-1) - 1``, 7 or 1): int8's numerics with
  ``qmax`` for 127: ``y = (x / m) * qmax``, rounded half to even or stochastically
  (``floor(y + u)``, the counter hash of :func:`~gradcomp.kernels.reference.stream_key`),
  clamped to ``[-qmax, qmax]``; ``scale = m / qmax``. Codes are two's complement in ``bits``
  bits, packed ``8 // bits`` to a byte, element ``j`` of a byte in bits ``j*bits ..``.
* sign (EF-SignSGD, Karimireddy et al. 2019): one bit per element, 1 when ``x < 0``, packed
  8 to a byte (element ``j`` in bit ``j``); ``scale = min(mean |x|, max |x|)`` of the block,
  the sum of ``|x|`` taken in the order of :func:`block_abs_sum`; decoded ``+-scale``.
* fp8 (``"e4m3"``: float8_e4m3fn, ``"e5m2"``): ``y = x * (F / m)`` (F = 448 or 57344, the
  largest finite value; ``(x / m) * F`` where ``F / m`` overflows) cast half to even (PyTorch's
  cast; ``|y|`` tops F by one ulp at most: cast to F); ``scale = m / F``; decoded ``code * scale``.

Decoding is the float32 product ``code * scale``; adding is ``acc + product``.
"""

from __future__ import annotations

import torch

from gradcomp.kernels.reference import uniform_key

__all__ = ["PACKED_BITS", "FP8_FORMATS", "FP8_MAX", "SUM_TILE", "qmax", "packed_nbytes", "sign_nbytes",
           "pack", "unpack", "block_abs_sum", "quantize_packed", "quantize_packed_ef", "dequantize_packed",
           "dequantize_packed_add_", "quantize_sign", "quantize_sign_ef", "dequantize_sign",
           "dequantize_sign_add_", "quantize_fp8", "quantize_fp8_ef", "dequantize_fp8",
           "dequantize_fp8_add_", "fp8_dtype"]

#: code widths of the packed integer codec
PACKED_BITS = (4, 2)
#: fp8 formats and their largest finite values
FP8_FORMATS = ("e4m3", "e5m2")
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
#: the sign codec sums |x| in tiles of this many elements (see block_abs_sum)
SUM_TILE = 256
_NAN_BITS = 0x7FC00000


def qmax(bits: int) -> int:
    """Largest code magnitude of a ``bits``-bit symmetric code: ``2**(bits-1) - 1``."""
    return (1 << (bits - 1)) - 1


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of ``n`` packed ``bits``-bit codes: ``ceil(n * bits / 8)``."""
    return -(-n * bits // 8)


def sign_nbytes(n: int) -> int:
    """Bytes of ``n`` sign bits: ``ceil(n / 8)``."""
    return -(-n // 8)


def fp8_dtype(fmt: str) -> torch.dtype:
    """The torch dtype of an fp8 format name."""
    return torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2


def _nan(device) -> torch.Tensor:
    return torch.tensor(_NAN_BITS, dtype=torch.int32).view(torch.float32).to(device)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat float32 values of x as ``[nblocks, block_size]``, the last block padded with zeros."""
    xf = x.reshape(-1).to(torch.float32)
    n = xf.numel()
    nb = -(-n // block_size)
    pad = nb * block_size - n
    if pad:
        xf = torch.cat([xf, xf.new_zeros(pad)])
    return xf.view(nb, block_size)


def _absmax(b: torch.Tensor):
    """``(m, finite, safe_m)`` per block: absmax, no NaN/Inf, and m where usable else 1."""
    m = b.abs().amax(dim=1)
    finite = torch.isfinite(b).all(dim=1)
    live = finite & (m > 0)
    return m, finite, torch.where(live, m, torch.ones_like(m))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (any int dtype, values fitting ``bits`` bits as two's complement) packed
    ``8 // bits`` to a uint8, element ``j`` of a byte in bits ``j*bits ..``; unused bits 0."""
    per = 8 // bits
    c = codes.reshape(-1).to(torch.int32) & ((1 << bits) - 1)
    pad = -c.numel() % per
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=c.device)
    return (c.view(-1, per) << shifts).sum(dim=1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int, signed: bool = True) -> torch.Tensor:
    """The first ``n`` fields of ``packed`` (uint8) as int32, sign-extended when ``signed``."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    f = ((packed.reshape(-1).to(torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]
    if signed:
        f = torch.where(f >= (1 << (bits - 1)), f - (1 << bits), f)
    return f


def _expand(scales: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    return scales.repeat_interleave(block_size)[:n]


# ------------------------------------------------------------------ packed int


def quantize_packed(x: torch.Tensor, bits: int, block_size: int, stochastic: bool, key: int):
    """Blockwise absmax quantization to ``bits``-bit codes (module docstring).

    Args:
        x: floating tensor of n elements (read flat, as float32).
        bits: 4 or 2. block_size: elements per block.
        stochastic, key: stochastic rounding and its stream key (:func:`stream_key`).

    Returns:
        ``(codes, scales)``: uint8 ``[ceil(n * bits / 8)]`` and float32 ``[ceil(n / block_size)]``.
    """
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device), torch.empty(0, device=x.device)
    b = _blocks(x, block_size)
    m, finite, safe_m = _absmax(b)
    q = qmax(bits)
    y = (b / safe_m[:, None]) * float(q)
    if stochastic:
        c = torch.floor(y + uniform_key(b.numel(), key, device=x.device).view_as(b))
    else:
        c = torch.round(y)
    c = c.clamp_(-q, q)
    c = torch.where((finite & (m > 0))[:, None], c, torch.zeros_like(c))
    scales = torch.where(finite, m / float(q), _nan(x.device))
    return pack(c.reshape(-1)[:n].to(torch.int32), bits), scales


def dequantize_packed(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, n: int):
    """``code * scale`` per element: float32 ``[n]``."""
    return unpack(codes, bits, n).to(torch.float32) * _expand(scales, n, block_size)


def dequantize_packed_add_(acc, codes, scales, bits: int, block_size: int):
    """``acc += code * scale`` (the product rounded first); acc float32, flat."""
    acc.view(-1).add_(dequantize_packed(codes, scales, bits, block_size, acc.numel()))
    return acc


def quantize_packed_ef(x, residual, bits: int, block_size: int, stochastic: bool, key: int):
    """Fused error feedback: ``p = x + residual``; ``(codes, scales) = Q(p)``;
    ``residual <- p - D(codes, scales)`` (residual float32, flat, updated in place)."""
    p = x.reshape(-1).to(torch.float32) + residual.view(-1)
    codes, scales = quantize_packed(p, bits, block_size, stochastic, key)
    residual.view(-1).copy_(p - dequantize_packed(codes, scales, bits, block_size, p.numel()))
    return codes, scales


# ------------------------------------------------------------------------ sign


def _fold(a: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension (a power of two) by halving: ``a[..., :h] + a[..., h:]``."""
    while a.shape[-1] > 1:
        h = a.shape[-1] // 2
        a = a[..., :h] + a[..., h:]
    return a[..., 0]


def block_abs_sum(a: torch.Tensor) -> torch.Tensor:
    """Per row of ``a`` (``[nblocks, block_size]``, float32 ``|x|``, block_size a power of two):
    the sum in a fixed order every backend follows. Tiles of ``t = min(block_size, SUM_TILE)``
    elements are each summed by halving (``v[:t/2] + v[t/2:]`` until one is left); the tiles'
    sums are then added left to right."""
    nb, bs = a.shape
    t = min(bs, SUM_TILE)
    tiles = _fold(a.view(nb, bs // t, t))
    s = tiles[:, 0]
    for j in range(1, tiles.shape[1]):
        s = s + tiles[:, j]
    return s


def quantize_sign(x: torch.Tensor, block_size: int):
    """Scaled sign: bits ``x < 0`` (uint8 ``[ceil(n / 8)]``) and float32 scales
    ``min(mean |x|, max |x|)`` per block (``[ceil(n / block_size)]``)."""
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device), torch.empty(0, device=x.device)
    b = _blocks(x, block_size)
    m, finite, _ = _absmax(b)
    count = torch.full_like(m, float(block_size))
    count[-1] = float(n - (b.shape[0] - 1) * block_size)
    mean = block_abs_sum(b.abs()) / count
    scales = torch.where(finite, torch.minimum(mean, m), _nan(x.device))
    neg = (b < 0) & finite[:, None]
    return pack(neg.reshape(-1)[:n], 1), scales


def dequantize_sign(codes, scales, block_size: int, n: int):
    """``-scale`` where the bit is 1, ``+scale`` where 0: float32 ``[n]``."""
    s = _expand(scales, n, block_size)
    return torch.where(unpack(codes, 1, n, signed=False) == 1, -s, s)


def dequantize_sign_add_(acc, codes, scales, block_size: int):
    """``acc += decoded``; acc float32, flat."""
    acc.view(-1).add_(dequantize_sign(codes, scales, block_size, acc.numel()))
    return acc


def quantize_sign_ef(x, residual, block_size: int):
    """Fused error feedback of the sign codec (as :func:`quantize_packed_ef`)."""
    p = x.reshape(-1).to(torch.float32) + residual.view(-1)
    codes, scales = quantize_sign(p, block_size)
    residual.view(-1).copy_(p - dequantize_sign(codes, scales, block_size, p.numel()))
    return codes, scales


# ------------------------------------------------------------------------- fp8


def quantize_fp8(x: torch.Tensor, fmt: str, block_size: int):
    """Blockwise-scaled fp8: codes (uint8 bit patterns of ``fmt``, ``[n]``) and float32 scales."""
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device), torch.empty(0, device=x.device)
    b = _blocks(x, block_size)
    m, finite, safe_m = _absmax(b)
    f = FP8_MAX[fmt]
    # F / m correctly rounded (a tensor division: ``f / tensor`` is reciprocal-then-multiply);
    # where it overflows (m below F / FLT_MAX) the codes are (x / m) * F
    inv = (torch.full_like(safe_m, f) / safe_m)[:, None]
    y = torch.where(inv.isfinite(), b * inv, (b / safe_m[:, None]) * f)
    c = y.to(fp8_dtype(fmt)).view(torch.uint8)
    c = torch.where((finite & (m > 0))[:, None], c, torch.zeros_like(c))
    scales = torch.where(finite, m / f, _nan(x.device))
    return c.reshape(-1)[:n].contiguous(), scales


def dequantize_fp8(codes, scales, fmt: str, block_size: int):
    """``float(code) * scale`` per element: float32 ``[n]`` (n = codes.numel())."""
    v = codes.reshape(-1).view(fp8_dtype(fmt)).to(torch.float32)
    return v * _expand(scales, codes.numel(), block_size)


def dequantize_fp8_add_(acc, codes, scales, fmt: str, block_size: int):
    """``acc += decoded``; acc float32, flat."""
    acc.view(-1).add_(dequantize_fp8(codes, scales, fmt, block_size))
    return acc


def quantize_fp8_ef(x, residual, fmt: str, block_size: int):
    """Fused error feedback of the fp8 codec (as :func:`quantize_packed_ef`)."""
    p = x.reshape(-1).to(torch.float32) + residual.view(-1)
    codes, scales = quantize_fp8(p, fmt, block_size)
    residual.view(-1).copy_(p - dequantize_fp8(codes, scales, fmt, block_size))
    return codes, scales

