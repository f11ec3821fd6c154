"""Scaled sign compression: one bit per element and one float32 scale per block (EF-SignSGD)."""

from __future__ import annotations

import math

import torch

from gradcomp import _validate as v
from gradcomp import kernels
from gradcomp import wire as W
from gradcomp.compressors.base import Compressor, Decoder, new_wire

__all__ = ["SignQuantizer"]


class SignQuantizer(Compressor):
    """Scaled sign: ``scale * sign(x)`` per block, one bit per element (Karimireddy et al. 2019,
    "Error Feedback Fixes SignSGD and other Gradient Compression Schemes"; 1-bit SGD, Seide
    et al. 2014).

    Each block of ``block_size`` elements sends the sign bit of every element (1 where
    ``x < 0``) and one float32 scale, the block's mean absolute value (summed in a fixed
    order, identical on every backend; capped by the absmax, which it can only exceed when
    the float32 sum overflows). An element decodes to ``+scale`` or ``-scale``.

    Run it with error feedback (:class:`~gradcomp.ErrorFeedback`, fused into one kernel
    pass): the scaled sign is a biased compressor, ``E[C(x)] != x``. Without the residual,
    the error of every step is lost: coordinates smaller than their block's mean are
    inflated to it, the direction of the sum can differ from the gradient's, and SGD with
    sign compression can converge to a wrong point or diverge even on convex problems
    (Karimireddy et al. 2019, counterexamples in section 3). With error feedback the error
    is added back the next step and the method converges at the rate of SGD.

    A block holding NaN or Inf decodes to NaN. Wire size: ``header + 4 ceil(n / block_size)
    + ceil(n / 8)`` bytes, ``1 + 32 / block_size`` bits per element (1.03 at 1024, a 31x
    compression ratio against float32, header aside); layout in docs/wire-format.md.

    Args:
        block_size: a power of two from 32 to 65536 (elements).
        backend: force a kernel backend (default: the fastest usable).

    Raises:
        ValueError / TypeError: invalid arguments (the message names them and the allowed values).
    """

    codec = "sign"

    def __init__(self, block_size: int = 1024, backend: str | None = None):
        self.block_size = v.block_size(block_size)
        self.backend = v.backend(backend)

    def _alloc(self, dtype, shape, device, out=None):
        nb = -(-math.prod(shape) // self.block_size)
        h = W.build_header("sign", dtype, shape, param=self.block_size)
        w = new_wire(h, self.wire_nbytes(shape, dtype) - len(h), device, out)
        return W.Payload(wire=w, codec="sign", dtype=dtype, shape=torch.Size(shape), block_size=self.block_size,
                         scales=w[len(h): len(h) + 4 * nb].view(torch.float32), codes=w[len(h) + 4 * nb:])

    def _encode(self, x, dtype, shape, out=None):
        p = self._alloc(dtype, shape, x.device, out)
        if x.numel():
            kernels.quantize_sign(x, self.block_size, out_codes=p.codes, out_scales=p.scales, backend=self.backend)
        return p

    def _encode_ef(self, x, residual, dtype, shape, out=None):
        """Fused error feedback: the signs of ``x + residual``, the residual updated in the same pass."""
        p = self._alloc(dtype, shape, x.device, out)
        if x.numel():
            kernels.quantize_sign_ef(x, residual, self.block_size, out_codes=p.codes, out_scales=p.scales,
                                     backend=self.backend)
        return p

    def wire_nbytes(self, shape, dtype=torch.float32):
        return W.dense_nbytes("sign", shape, dtype, self.block_size)

    def __repr__(self):
        return f"SignQuantizer(block_size={self.block_size})"


class _SignDecoder(Decoder):
    """``+-scale`` per element from the sign bits; adding fuses the two."""

    def values(self, p, backend=None):
        return kernels.dequantize_sign(p.codes, p.scales, p.numel, p.block_size, backend=backend)

    def into(self, p, out, backend=None):
        if out.dtype != torch.float32:
            return super().into(p, out, backend)
        kernels.dequantize_sign(p.codes, p.scales, p.numel, p.block_size, out=out, backend=backend)

    def add_(self, p, acc, backend=None):
        kernels.dequantize_sign_add_(acc, p.codes, p.scales, p.block_size, backend=backend)


W.register_decoder("sign", _SignDecoder())
