"""Blockwise absmax int8 quantization (8-bit, one float32 scale per block)."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping

import torch

from gradcomp import _validate as v
from gradcomp import kernels
from gradcomp import wire as W
from gradcomp.compressors.base import Compressor, new_wire

__all__ = ["Int8Quantizer"]


class Int8Quantizer(Compressor):
    """Blockwise symmetric absmax quantization to int8 codes in [-127, 127].

    Each block of ``block_size`` elements gets one float32 scale
    ``absmax / 127``; the last block may be short and its scale comes from its
    own elements only. Rounding is ``"nearest"`` (half to even) or
    ``"stochastic"`` (unbiased, ``E[decompress(compress(x))] = x``, as in QSGD,
    Alistarh et al. 2017), drawn from a counter-based hash of
    ``(seed, call counter, element index)``: reproducible, identical on every
    backend, and different at every call because the counter advances on every
    :meth:`compress` (it is part of :meth:`state_dict`). Blockwise absmax
    scaling follows Dettmers et al. 2022 (8-bit optimizers).

    A block containing NaN or Inf decodes to NaN (never silently finite).

    Wire size: ``header + n + 4 * ceil(n / block_size)`` bytes.

    Args:
        block_size: a power of two from 32 to 65536 (elements).
        rounding: ``"nearest"`` or ``"stochastic"``.
        seed: integer seed of the stochastic-rounding stream.
        backend: force a kernel backend (default: the fastest usable).

    Raises:
        ValueError / TypeError: invalid arguments (the message names them).
    """

    codec = "int8"

    def __init__(self, block_size: int = 256, rounding: str = "nearest", seed: int = 0,
                 backend: str | None = None):
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
        h = W.build_header("int8", dtype, shape, param=self.block_size, flags=flags)
        w = new_wire(h, 4 * nb + n, device, out)
        scales = w[len(h): len(h) + 4 * nb].view(torch.float32)
        codes = w[len(h) + 4 * nb:].view(torch.int8)
        p = W.Payload(wire=w, codec="int8", dtype=dtype, shape=torch.Size(shape),
                      block_size=self.block_size, stochastic=bool(flags),
                      scales=scales, codes=codes)
        return p

    def _encode(self, x, dtype, shape, out=None):
        p = self._alloc(dtype, shape, x.device, out)
        if x.numel():
            kernels.quantize_int8(x, self.block_size, self.rounding, self.seed, self._next_counter(),
                                  out_q=p.codes, out_scales=p.scales, backend=self.backend)
        return p

    def _encode_ef(self, x, residual, dtype, shape, out=None):
        """Fused error feedback: quantize ``x + residual`` and update ``residual``
        in place in one pass (``kernels.quantize_int8_ef``)."""
        p = self._alloc(dtype, shape, x.device, out)
        if x.numel():
            kernels.quantize_int8_ef(x, residual, self.block_size, self.rounding, self.seed,
                                     self._next_counter(), out_q=p.codes, out_scales=p.scales,
                                     backend=self.backend)
        return p

    def _decode_flat(self, p):
        return kernels.dequantize_int8(p.codes, p.scales, p.block_size, check_int8=not p.int8_checked,
                                       backend=self.backend)

    def _decode_into(self, p, out):
        kernels.dequantize_int8(p.codes, p.scales, p.block_size, out=out, check_int8=not p.int8_checked,
                                backend=self.backend)

    def decompress_add_(self, p, acc):
        """``acc += decompress(p)`` in one fused pass (float32 accumulate)."""
        from gradcomp.compressors.base import _check_acc

        p = self._payload(p)
        _check_acc(acc, p)
        if p.numel:
            kernels.dequantize_int8_add_(acc.view(-1), p.codes, p.scales, p.block_size,
                                         check_int8=not p.int8_checked, backend=self.backend)
        return acc

    def reduce_compress_(self, p, acc, *, divisor=1, out=None, decode=False):
        """As :meth:`Compressor.reduce_compress_`, in one pass
        (``kernels.reduce_quantize_int8``) when ``p`` has this block size."""
        from gradcomp.compressors.base import _check_acc, _check_wire_out

        p = self._payload(p)
        if p.block_size != self.block_size or self._overrides("compress", "decompress", "decompress_add_"):
            return super().reduce_compress_(p, acc, divisor=divisor, out=out, decode=decode)
        _check_acc(acc, p)
        divisor = v.integer("divisor", divisor, 1)
        if out is not None:
            _check_wire_out(self, out, acc)
        q = self._alloc(acc.dtype, acc.shape, acc.device, out)
        if p.numel:
            kernels.reduce_quantize_int8(acc, p.codes, p.scales, self.block_size, divisor, self.rounding,
                                         self.seed, self._next_counter(), out_q=q.codes, out_scales=q.scales,
                                         decode=decode, check_int8=not p.int8_checked, backend=self.backend)
        return q

    def wire_nbytes(self, shape, dtype=torch.float32):
        return W.dense_nbytes("int8", shape, dtype, self.block_size)

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
        new = Int8Quantizer(self.block_size, self.rounding, self.seed, self.backend)
        new.counter = self.counter
        return new

    def __repr__(self):
        return (f"Int8Quantizer(block_size={self.block_size}, rounding={self.rounding!r}, "
                f"seed={self.seed})")
