"""Blockwise-scaled fp8 (float8_e4m3fn or float8_e5m2 codes, one float32 scale per block)."""

from __future__ import annotations

import math

import torch

from gradcomp import _validate as v
from gradcomp import kernels
from gradcomp import wire as W
from gradcomp.compressors.base import Compressor, Decoder, new_wire

__all__ = ["FP8"]

#: fp8 format name -> wire codec
FP8_CODECS = {"e4m3": "fp8e4m3", "e5m2": "fp8e5m2"}


class FP8(Compressor):
    """fp8 on the wire with a float32 scale per block (as fp8 training recipes scale per
    block: Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; DeepSeek-V3's 1x128 tiles).

    Per block of ``block_size`` elements, ``scale = absmax / F`` maps the block's largest
    magnitude to the format's largest finite value F (448 for ``"e4m3"``, PyTorch's
    ``float8_e4m3fn``: 3 mantissa bits, relative rounding error up to 2**-4; 57344 for
    ``"e5m2"``, ``float8_e5m2``: 2 mantissa bits, a wider range for the small elements of a
    block). Codes are ``fp8(x * (F / absmax))`` rounded half to even, decoded
    ``float(code) * scale``. A block holding NaN or Inf decodes to NaN, so AMP's
    GradScaler sees a non-finite gradient and skips the step, as with the other codecs.

    Wire size: ``header + 4 ceil(n / block_size) + n`` bytes (3.94x against float32 at
    block 256, header aside); layout in docs/wire-format.md.

    Args:
        format: ``"e4m3"`` or ``"e5m2"``.
        block_size: a power of two from 32 to 65536 (elements).
        backend: force a kernel backend (default: the fastest usable).

    Raises:
        ValueError / TypeError: invalid arguments (the message names them and the allowed values).
    """

    def __init__(self, format: str = "e4m3", block_size: int = 256, backend: str | None = None):
        self.format = kernels.lowbit.check_fp8_format(format)
        self.codec = FP8_CODECS[self.format]
        self.block_size = v.block_size(block_size)
        self.backend = v.backend(backend)

    def _alloc(self, dtype, shape, device, out=None):
        nb = -(-math.prod(shape) // self.block_size)
        h = W.build_header(self.codec, dtype, shape, param=self.block_size)
        w = new_wire(h, self.wire_nbytes(shape, dtype) - len(h), device, out)
        return W.Payload(wire=w, codec=self.codec, dtype=dtype, shape=torch.Size(shape),
                         block_size=self.block_size, scales=w[len(h): len(h) + 4 * nb].view(torch.float32),
                         codes=w[len(h) + 4 * nb:])

    def _encode(self, x, dtype, shape, out=None):
        p = self._alloc(dtype, shape, x.device, out)
        if x.numel():
            kernels.quantize_fp8(x, self.format, self.block_size, out_codes=p.codes, out_scales=p.scales,
                                 backend=self.backend)
        return p

    def _encode_ef(self, x, residual, dtype, shape, out=None):
        """Fused error feedback: the codes of ``x + residual``, the residual updated in the same pass."""
        p = self._alloc(dtype, shape, x.device, out)
        if x.numel():
            kernels.quantize_fp8_ef(x, residual, self.format, self.block_size, out_codes=p.codes,
                                    out_scales=p.scales, backend=self.backend)
        return p

    def wire_nbytes(self, shape, dtype=torch.float32):
        return W.dense_nbytes(self.codec, shape, dtype, self.block_size)

    def __repr__(self):
        return f"FP8(format={self.format!r}, block_size={self.block_size})"


class _FP8Decoder(Decoder):
    """fp8 codes widened exactly, times their block's scale; adding fuses the two."""

    def __init__(self, fmt: str):
        self.format = fmt

    def values(self, p, backend=None):
        return kernels.dequantize_fp8(p.codes, p.scales, self.format, p.block_size, backend=backend)

    def into(self, p, out, backend=None):
        if out.dtype != torch.float32:
            return super().into(p, out, backend)
        kernels.dequantize_fp8(p.codes, p.scales, self.format, p.block_size, out=out, backend=backend)

    def add_(self, p, acc, backend=None):
        kernels.dequantize_fp8_add_(acc, p.codes, p.scales, self.format, p.block_size, backend=backend)

    def __repr__(self):
        return f"_FP8Decoder({self.format!r})"


for _fmt, _codec in FP8_CODECS.items():
    W.register_decoder(_codec, _FP8Decoder(_fmt))
