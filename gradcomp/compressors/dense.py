"""Dense casts: NoCompression (raw), FP16 (with overflow-safe scaling), BF16."""

from __future__ import annotations

import math

import torch

from gradcomp import wire as W
from gradcomp.compressors.base import Compressor, Decoder, new_wire

__all__ = ["NoCompression", "FP16", "BF16"]

_FP16_MAX = 65504.0


class NoCompression(Compressor):
    """Sends the tensor's own bytes (original dtype): the uncompressed baseline.

    Wire size: ``header + n * itemsize`` bytes.
    """

    codec = "raw"

    def _encode(self, x, dtype, shape, out=None):
        x = x.to(dtype)
        h = W.build_header("raw", dtype, shape)
        w = new_wire(h, x.numel() * x.element_size(), x.device, out)
        data = w[len(h):].view(dtype)
        if x.numel():
            data.copy_(x)
        return W.Payload(wire=w, codec="raw", dtype=dtype, shape=torch.Size(shape), data=data)

    def wire_nbytes(self, shape, dtype=torch.float32):
        return W.dense_nbytes("raw", shape, dtype)


class FP16(Compressor):
    """IEEE half precision on the wire (2 bytes per element).

    The tensor is multiplied by ``2**-e`` with the smallest integer ``e``
    such that ``max |x| * 2**-e <= 65504`` (float16's largest value), and ``e``
    is stored in the header: a power of two, exact to undo. Large values stay
    finite (``e > 0``) and small ones keep float16's full precision instead of
    flushing to zero (``e < 0``, as in loss scaling, Micikevicius et al. 2018,
    "Mixed Precision Training"). ``e`` is clamped to ``[-126, 127]``
    (``[-1022, 1023]`` for float64) so that both scales are normal numbers.
    Elements more than 2**24 times smaller than ``max |x|`` flush towards zero
    as in a plain cast. NaN/Inf pass through (no scaling then).

    Wire size: ``header + 2 n`` bytes.
    """

    codec = "fp16"

    def _encode(self, x, dtype, shape, out=None):
        e = 0
        if x.numel():
            mn, mx = torch.aminmax(x)  # max |x| without an n-element temporary; NaN propagates
            amax = float(torch.maximum(mn.abs(), mx.abs()).to(torch.float64))
            if math.isfinite(amax) and amax > 0:
                lo, hi = W.FP16_EXPONENT_RANGE[x.dtype == torch.float64]
                e = math.ceil(math.log2(amax) - math.log2(_FP16_MAX))
                while math.ldexp(amax, -e) > _FP16_MAX:  # log2's rounding
                    e += 1
                while math.ldexp(amax, -(e - 1)) <= _FP16_MAX:
                    e -= 1
                e = min(max(e, lo), hi)
        h = W.build_header("fp16", dtype, shape, param=e)
        w = new_wire(h, 2 * x.numel(), x.device, out)
        data = w[len(h):].view(torch.float16)
        if x.numel():
            if e:
                src = x.to(torch.float64) if x.dtype == torch.float64 else x.to(torch.float32)
                data.copy_(src * (2.0 ** -e))  # a power of two: exact unless it underflows
            else:
                data.copy_(x)
        return W.Payload(wire=w, codec="fp16", dtype=dtype, shape=torch.Size(shape),
                         exponent=e, data=data)

    def wire_nbytes(self, shape, dtype=torch.float32):
        return W.dense_nbytes("fp16", shape, dtype)


class BF16(Compressor):
    """bfloat16 on the wire (2 bytes per element, float32's exponent range): a cast.

    Wire size: ``header + 2 n`` bytes.
    """

    codec = "bf16"

    def _encode(self, x, dtype, shape, out=None):
        h = W.build_header("bf16", dtype, shape)
        w = new_wire(h, 2 * x.numel(), x.device, out)
        data = w[len(h):].view(torch.bfloat16)
        if x.numel():
            data.copy_(x)
        return W.Payload(wire=w, codec="bf16", dtype=dtype, shape=torch.Size(shape), data=data)

    def wire_nbytes(self, shape, dtype=torch.float32):
        return W.dense_nbytes("bf16", shape, dtype)


# ---- decoders (one per codec, from the wire alone) ---------------------------------
class _RawDecoder(Decoder):
    """The values as they were sent, in the original dtype."""

    def values(self, p, backend=None):
        return p.data


class _FP16Decoder(Decoder):
    """float16 values times ``2**e`` (the header's exponent), exactly."""

    def values(self, p, backend=None):
        out = p.data.to(torch.float32)
        if p.exponent:
            if p.dtype == torch.float64:
                return p.data.to(torch.float64) * (2.0 ** p.exponent)
            out = out * (2.0 ** p.exponent)
        return out

    def into(self, p, out, backend=None):
        if out.dtype not in (torch.float32, torch.float64):
            return super().into(p, out, backend)
        out.copy_(p.data)  # exact widening, then the exact power-of-two scaling
        if p.exponent:
            out.mul_(2.0 ** p.exponent)

    def add_(self, p, acc, backend=None):
        if p.exponent:
            return super().add_(p, acc, backend)
        acc.add_(p.data)  # float16 widened exactly to float32 inside the addition


class _BF16Decoder(Decoder):
    """bfloat16 values widened exactly."""

    def values(self, p, backend=None):
        return p.data.to(torch.float32)

    def into(self, p, out, backend=None):
        if out.dtype not in (torch.float32, torch.float64):
            return super().into(p, out, backend)
        out.copy_(p.data)  # exact widening

    def add_(self, p, acc, backend=None):
        acc.add_(p.data)  # bfloat16 widened exactly to float32 inside the addition


W.register_decoder("raw", _RawDecoder())
W.register_decoder("fp16", _FP16Decoder())
W.register_decoder("bf16", _BF16Decoder())
