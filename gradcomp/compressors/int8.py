"""Blockwise absmax int8 quantization (8-bit, one float32 scale per block), with payload parts."""

from __future__ import annotations

import torch

from gradcomp import kernels
from gradcomp import wire as W
from gradcomp.compressors.base import Decoder
from gradcomp.compressors.intq import IntQuantizer

__all__ = ["Int8Quantizer"]


class Int8Quantizer(IntQuantizer):
    """Blockwise symmetric absmax quantization to int8 codes in [-127, 127]:
    :class:`IntQuantizer` with ``bits=8`` (same payloads, bit for bit), whose payloads can
    also be written and read in parts (:meth:`part_align`).

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
        super().__init__(8, block_size, rounding, seed, backend)

    # ---- parts (see Compressor.part_align) -----------------------------------
    def part_align(self):
        """The block size with nearest rounding (a block's codes depend on that
        block alone); 0 with stochastic rounding (its random stream is indexed
        by the element's place in the whole call) or in a subclass that
        redefines how payloads are written or read."""
        if self.rounding != "nearest" or self._overrides("compress", "decompress", "decompress_add_",
                                                         "reduce_compress_"):
            return 0
        return self.block_size

    def open_wire(self, numel, out=None, device="cpu"):
        """A payload of a flat float32 tensor of ``numel`` elements with its header
        written and its sections not yet: the parts fill them.

        Args:
            numel: elements of the tensor.
            out: optional wire buffer of ``wire_nbytes((numel,))`` bytes.
            device: where a new wire is allocated (``out``'s device otherwise).

        Returns:
            A :class:`~gradcomp.wire.Payload` whose ``scales`` / ``codes`` are views of its wire.
            The compressor's counter advances once, as for one :meth:`compress`.
        """
        dev = out.device if out is not None else torch.device(device)
        q = self._alloc(torch.float32, (numel,), dev, out)
        self._next_counter()
        return q

    def part_ranges(self, numel, lo, hi):
        """Byte ranges ``[(start, end), ...]`` of the wire of ``numel`` elements
        holding part ``[lo, hi)``: its scales, then its codes; the first part's
        scale range starts at byte 0 (it carries the header)."""
        h = W.header_nbytes(1)
        bs = self.block_size
        nb = -(-numel // bs)
        if lo == hi:  # an empty part: no bytes
            return [(h, h), (h + 4 * nb + lo, h + 4 * nb + lo)]
        first = 0 if lo == 0 else h + 4 * (lo // bs)
        return [(first, h + 4 * (-(-hi // bs))), (h + 4 * nb + lo, h + 4 * nb + hi)]

    def _part(self, p, lo, hi):
        bs = self.block_size
        return p.codes[lo:hi], p.scales[lo // bs: -(-hi // bs)]

    def compress_part_(self, x, q, lo, hi, residual=None):
        """Quantize ``x`` (float32, ``hi - lo`` elements: part ``[lo, hi)`` of the
        tensor) into payload ``q``'s sections; with ``residual`` (float32, same
        length) quantize ``x + residual`` and leave the new error in it, as
        error feedback does."""
        if lo == hi:
            return
        codes, scales = self._part(q, lo, hi)
        if residual is None:
            kernels.quantize_int8(x, self.block_size, self.rounding, self.seed, 0,
                                  out_q=codes, out_scales=scales, backend=self.backend)
        else:
            kernels.quantize_int8_ef(x, residual, self.block_size, self.rounding, self.seed, 0,
                                     out_q=codes, out_scales=scales, backend=self.backend)

    def reduce_compress_part_(self, p, acc, q, lo, hi, *, divisor=1, decode=False):
        """:meth:`reduce_compress_` of part ``[lo, hi)``: ``acc`` (float32,
        ``hi - lo`` elements) plus that part of payload ``p`` (divided by
        ``divisor``) is quantized into payload ``q``'s part; with ``decode``
        ``acc`` is left holding the decoded codes."""
        if lo == hi:
            return
        codes, scales = self._part(p, lo, hi)
        out_q, out_scales = self._part(q, lo, hi)
        kernels.reduce_quantize_int8(acc, codes, scales, self.block_size, divisor, self.rounding, self.seed,
                                     0, out_q=out_q, out_scales=out_scales, decode=decode,
                                     check_int8=not p.int8_checked, backend=self.backend)

    def decompress_part_(self, p, lo, hi, out):
        """Decode part ``[lo, hi)`` of payload ``p`` into ``out`` (float32, ``hi - lo`` elements)."""
        if lo == hi:
            return
        codes, scales = self._part(p, lo, hi)
        kernels.dequantize_int8(codes, scales, self.block_size, out=out, check_int8=not p.int8_checked,
                                backend=self.backend)

    def __repr__(self):
        return (f"Int8Quantizer(block_size={self.block_size}, rounding={self.rounding!r}, "
                f"seed={self.seed})")


class _Int8Decoder(Decoder):
    """Codes times their block's absmax scale; adding fuses the two in one pass
    (float32 accumulate). Codes and scales left unchecked by
    ``decode(..., check_int8=False)`` are checked by the kernel."""

    def values(self, p, backend=None):
        return kernels.dequantize_int8(p.codes, p.scales, p.block_size, check_int8=not p.int8_checked,
                                       backend=backend)

    def into(self, p, out, backend=None):
        kernels.dequantize_int8(p.codes, p.scales, p.block_size, out=out, check_int8=not p.int8_checked,
                                backend=backend)

    def add_(self, p, acc, backend=None):
        kernels.dequantize_int8_add_(acc, p.codes, p.scales, p.block_size, check_int8=not p.int8_checked,
                                     backend=backend)


W.register_decoder("int8", _Int8Decoder())
