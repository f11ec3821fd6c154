"""Blockwise absmax integer quantization to 8, 4 or 2 bits (one float32 scale per block)."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Mapping

import torch

from gradcomp import _validate as v
from gradcomp import kernels
from gradcomp import wire as W
from gradcomp.compressors._common import check_acc, check_wire_out
from gradcomp.compressors.base import Compressor, Decoder, new_wire

__all__ = ["IntQuantizer", "INT_BITS"]

#: the code widths of :class:`IntQuantizer`
INT_BITS = (8, 4, 2)


class IntQuantizer(Compressor):
    """Blockwise symmetric absmax quantization to ``bits``-bit integer codes.

    Each block of ``block_size`` elements gets one float32 scale ``absmax / qmax`` with
    ``qmax = 2**(bits-1) - 1`` (127, 7 or 1) and codes in ``[-qmax, qmax]``; the last block may
    be short and its scale comes from its own elements only (Dettmers et al. 2022, blockwise
    absmax). 4-bit codes are packed two to a byte, 2-bit codes four to a byte (ternary
    values ``{-1, 0, 1} * absmax``, as TernGrad, Wen et al. 2017, but per block); 8-bit codes
    are :class:`Int8Quantizer`'s payloads, bit for bit. Rounding is ``"nearest"`` (half to
    even) or ``"stochastic"`` (unbiased: ``E[decompress(compress(x))] = x``, QSGD, Alistarh
    et al. 2017) from a counter-based hash of ``(seed, call counter, element index)``:
    reproducible, identical on every backend, different at every call (the counter advances
    on every :meth:`compress` and is part of :meth:`state_dict`). At 4 and 2 bits the
    rounding error is large (up to ``absmax / 14`` and ``absmax / 2`` per element): use them
    with :class:`~gradcomp.ErrorFeedback`, whose fused kernel quantizes and keeps the
    residual in one pass. A block holding NaN or Inf decodes to NaN.

    Wire size: ``header + 4 ceil(n / block_size) + ceil(n bits / 8)`` bytes (layout:
    docs/wire-format.md); compression ratio against float32 at block 256: 3.94x (8 bits), 7.76x
    (4 bits), 15.06x (2 bits), header aside.

    Args:
        bits: 8, 4 or 2.
        block_size: a power of two from 32 to 65536 (elements).
        rounding: ``"nearest"`` or ``"stochastic"``.
        seed: integer seed of the stochastic-rounding stream.
        backend: force a kernel backend (default: the fastest usable).

    Raises:
        ValueError / TypeError: invalid arguments (the message names them and the allowed values).
    """

    def __init__(self, bits: int = 4, block_size: int = 256, rounding: str = "nearest", seed: int = 0,
                 backend: str | None = None):
        if isinstance(bits, bool) or bits not in INT_BITS:
            raise ValueError(f"bits must be one of {INT_BITS}, got {bits!r}")
        self.bits = int(bits)
        self.codec = f"int{self.bits}"
        self.block_size = v.block_size(block_size)
        self.rounding = v.rounding(rounding)
        self.seed = v.integer("seed", seed)
        self.backend = v.backend(backend)
        self.counter = 0
        self._lock = threading.Lock()

    def _next_counter(self) -> int:
        with self._lock:
            c = self.counter
            self.counter += 1
            return c

    def _alloc(self, dtype, shape, device, out=None):
        n = math.prod(shape)
        nb = -(-n // self.block_size)
        flags = W.FLAG_STOCHASTIC if self.rounding == "stochastic" else 0
        h = W.build_header(self.codec, dtype, shape, param=self.block_size, flags=flags)
        w = new_wire(h, W.dense_nbytes(self.codec, shape, dtype, self.block_size) - len(h), device, out)
        scales = w[len(h): len(h) + 4 * nb].view(torch.float32)
        codes = w[len(h) + 4 * nb:]
        return W.Payload(wire=w, codec=self.codec, dtype=dtype, shape=torch.Size(shape),
                         block_size=self.block_size, stochastic=bool(flags), scales=scales,
                         codes=codes.view(torch.int8) if self.bits == 8 else codes)

    def _quantize(self, x, residual, p, counter):
        """Write the codes and scales of ``x`` (``+ residual``, updated in place) into ``p``."""
        args = (self.block_size, self.rounding, self.seed, counter)
        outs = {"out_scales": p.scales, "backend": self.backend}
        if self.bits == 8:
            if residual is None:
                kernels.quantize_int8(x, *args, out_q=p.codes, **outs)
            else:
                kernels.quantize_int8_ef(x, residual, *args, out_q=p.codes, **outs)
        elif residual is None:
            kernels.quantize_packed(x, self.bits, *args, out_codes=p.codes, **outs)
        else:
            kernels.quantize_packed_ef(x, residual, self.bits, *args, out_codes=p.codes, **outs)

    def _encode(self, x, dtype, shape, out=None):
        p = self._alloc(dtype, shape, x.device, out)
        if x.numel():
            self._quantize(x, None, p, self._next_counter())
        return p

    def _encode_ef(self, x, residual, dtype, shape, out=None):
        """Fused error feedback: quantize ``x + residual`` and update ``residual``
        in place in one pass (``kernels.quantize_int8_ef`` / ``quantize_packed_ef``)."""
        p = self._alloc(dtype, shape, x.device, out)
        if x.numel():
            self._quantize(x, residual, p, self._next_counter())
        return p

    def reduce_compress_(self, p, acc, *, divisor=1, out=None, decode=False):
        """As :meth:`Compressor.reduce_compress_`, in one pass
        (``kernels.reduce_quantize_int8`` / ``reduce_quantize_packed``) when ``p`` has this block size."""
        p = self._payload(p)
        if p.block_size != self.block_size or self._overrides("compress", "decompress", "decompress_add_"):
            return super().reduce_compress_(p, acc, divisor=divisor, out=out, decode=decode)
        check_acc(acc, p)
        divisor = v.integer("divisor", divisor, 1)
        if out is not None:
            check_wire_out(self, out, acc)
        q = self._alloc(acc.dtype, acc.shape, acc.device, out)
        if p.numel:
            args = (self.block_size, divisor, self.rounding, self.seed, self._next_counter())
            if self.bits == 8:
                kernels.reduce_quantize_int8(acc, p.codes, p.scales, *args, out_q=q.codes, out_scales=q.scales,
                                             decode=decode, check_int8=not p.int8_checked, backend=self.backend)
            else:
                kernels.reduce_quantize_packed(acc, p.codes, p.scales, self.bits, *args, out_codes=q.codes,
                                               out_scales=q.scales, decode=decode, backend=self.backend)
        return q

    def wire_nbytes(self, shape, dtype=torch.float32):
        return W.dense_nbytes(self.codec, shape, dtype, self.block_size)

    def state_dict(self):
        return {"counter": self.counter, "seed": self.seed}

    def load_state_dict(self, state):
        """Restore ``counter`` (and ``seed``); a key left out keeps its value.

        Raises:
            TypeError / ValueError: ``state`` is not a mapping, or a value is not
                an int (``counter`` >= 0).
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping (from state_dict()), got {type(state).__name__}")
        counter = v.integer("state['counter']", state.get("counter", self.counter), 0)
        seed = v.integer("state['seed']", state.get("seed", self.seed))
        self.counter, self.seed = counter, seed

    def __getstate__(self):
        d = self.__dict__.copy()
        del d["_lock"]
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def __repr__(self):
        return (f"IntQuantizer(bits={self.bits}, block_size={self.block_size}, rounding={self.rounding!r}, "
                f"seed={self.seed})")


class _PackedDecoder(Decoder):
    """Packed int4 / int2 codes times their block's scale (float32); adding fuses the two."""

    def __init__(self, bits: int):
        self.bits = bits

    def values(self, p, backend=None):
        return kernels.dequantize_packed(p.codes, p.scales, p.numel, self.bits, p.block_size, backend=backend)

    def into(self, p, out, backend=None):
        if out.dtype != torch.float32:
            return super().into(p, out, backend)
        kernels.dequantize_packed(p.codes, p.scales, p.numel, self.bits, p.block_size, out=out, backend=backend)

    def add_(self, p, acc, backend=None):
        kernels.dequantize_packed_add_(acc, p.codes, p.scales, self.bits, p.block_size, backend=backend)

    def __repr__(self):
        return f"_PackedDecoder(bits={self.bits})"


W.register_decoder("int4", _PackedDecoder(4))
W.register_decoder("int2", _PackedDecoder(2))
