"""This rank's contribution to a collective, with error feedback where it applies.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019) corrects the
error of compressing *this rank's own data*. A collective uses this rank's
data in two ways:

* compressed alone (:meth:`Local.compress`): the chunk the ring's first hop
  sends, the chunks two-phase sends to their owners, the whole tensor in the
  sparse allgather. Error feedback applies here.
* added exactly in float32 to a partial sum (:meth:`Local.exact_into`): the chunks
  the ring merges at later hops, the chunk two-phase's owner keeps. No error
  is made, so none is remembered.

Partial and final sums are compressed without error feedback, except two-phase's
owner's sum with a server residual (:func:`gradcomp.comm.dense.compress_owned`).

Residuals come from one of two places:

* an :class:`~gradcomp.ErrorFeedback` compressor: residual key ``(key, j)``
  for chunk ``j`` (``key`` alone for the sparse allgather, which compresses
  the whole tensor); chunks added exactly have no residual;
* an explicit flat float32 ``residual`` tensor shaped like the input (the DDP
  hook's per-parameter memory): compressed ranges get ``p = x + r;
  r <- p - D(C(p))``, ranges added exactly contribute ``x + r`` and reset
  ``r`` to zero (the remembered error is delivered in full).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

import torch

from gradcomp import _validate as v
from gradcomp import timeline as _timeline

from gradcomp.compressors import Compressor, ErrorFeedback, split
from gradcomp.compressors.base import overrides, takes_out
from gradcomp.wire import Payload

__all__ = ["Local"]


class Local:
    """The flat float32 input of this rank plus its error-feedback state.

    Args:
        x: 1-D float32 tensor, n elements (read only).
        compressor: the user's compressor or ErrorFeedback (:func:`~gradcomp.compressors.split`).
        key: residual key prefix for an ErrorFeedback compressor.
        residual: optional contiguous float32 tensor of n elements, updated in
            place (exclusive with an ErrorFeedback compressor).

    Attributes:
        inner: the compressor for partial and final sums (ErrorFeedback unwrapped).
        mode: ``"keyed"`` (ErrorFeedback residuals), ``"flat"`` (the
            ``residual`` tensor) or ``"none"``.
    """

    def __init__(self, x: torch.Tensor, compressor: Compressor, key: Hashable = None,
                 residual: torch.Tensor | None = None):
        self.x = x
        self.key = key
        self.residual = residual
        self.inner, self._ef = split(compressor)
        if self._ef is not None:
            self.mode = "keyed"
        elif residual is not None:
            # an ErrorFeedback whose one residual is, on each call, a slice of `residual`
            self.mode, self._ef = "flat", ErrorFeedback(self.inner)
        else:
            self.mode = "none"
        self._out_ok = takes_out(self._ef if self._ef is not None else self.inner)

    def over(self, x: torch.Tensor) -> "Local":
        """The same compressor, key and residual memory over another flat float32
        tensor ``x`` of the same number of elements (e.g. a region's sum that its
        owner compresses with error feedback)."""
        other = Local.__new__(Local)
        other.__dict__.update(self.__dict__)
        other.x = x
        return other

    def exact_into(self, lo: int, hi: int, dst: torch.Tensor) -> torch.Tensor:
        """Write elements ``[lo, hi)`` of this rank's contribution into ``dst``
        (float32, ``hi - lo`` elements; it may be the same memory as the input),
        to be summed exactly. A flat residual there is added and reset to zero.

        Returns:
            ``dst``.
        """
        src = self.x[lo:hi]
        if dst.data_ptr() != src.data_ptr() or dst.numel() == 0:  # in place: already there
            dst.copy_(src)
        if self.mode == "flat":
            r = self.residual[lo:hi]
            dst.add_(r)
            r.zero_()
        return dst

    def has_parts(self) -> bool:
        """The compressor writes payloads in parts (:meth:`~gradcomp.Compressor.part_align`)
        and error feedback, if any, is gradcomp's own (so :meth:`compress_parts` applies)."""
        return self.inner.part_align() > 0 and (self._ef is None or not overrides(self._ef, "compress"))

    def compress_parts(self, lo: int, hi: int, chunk: Hashable, q: Payload,
                       parts: list[tuple[int, int]]) -> Iterator[None]:
        """:meth:`compress` of elements ``[lo, hi)`` into the opened payload ``q``
        (:meth:`~gradcomp.Int8Quantizer.open_wire`) one part at a time, yielding
        after each part of ``parts`` (element ranges relative to ``lo``, in
        order, covering ``[0, hi - lo)``). Same payload and residual, bit for
        bit, as :meth:`compress`; the residual is kept (or dropped when
        non-finite) after the last part. Needs :meth:`has_parts`."""
        x = self.x[lo:hi]
        key = self.key if chunk is None else (self.key, chunk)
        if self.mode == "keyed":
            r = self._ef.residual_for(key, hi - lo, x.device)
        elif self.mode == "flat":
            r = self.residual[lo:hi]
        else:
            r = None
        for a, b in parts:
            with _timeline.span("compress"):
                self.inner.compress_part_(x[a:b], q, a, b, None if r is None else r[a:b])
            yield
        if self.mode == "keyed":
            self._ef.keep(key, r)
        elif self.mode == "flat" and not v.all_finite(r):
            r.zero_()  # as compress: a non-finite residual starts again from zero

    def compress(self, lo: int, hi: int, chunk: Hashable, out: torch.Tensor | None = None) -> Payload:
        """:meth:`_compress`, recorded as a ``"compress"`` span of the active timeline."""
        with _timeline.span("compress"):
            return self._compress(lo, hi, chunk, out)

    def _compress(self, lo: int, hi: int, chunk: Hashable, out: torch.Tensor | None = None) -> Payload:
        """Compress elements ``[lo, hi)`` of this rank's contribution alone,
        with error feedback when configured.

        Args:
            lo, hi: element range.
            chunk: the chunk's id in the residual key ``(key, chunk)``; None
                means the whole tensor (key ``key``).
            out: optional wire buffer (dense compressors), see
                :meth:`~gradcomp.Compressor.compress`; not used with a
                compressor subclass whose ``compress`` does not take it.
        """
        x = self.x[lo:hi]
        if not self._out_ok:
            out = None
        kw = {} if out is None else {"out": out}
        if self.mode == "none":
            return self.inner.compress(x, **kw)
        if self.mode == "keyed":
            return self._ef.compress(x, key=self.key if chunk is None else (self.key, chunk), **kw)
        r = self.residual[lo:hi]
        self._ef.residuals[0] = r
        p = self._ef.compress(x, key=0, **kw)
        new = self._ef.residuals.pop(0, None)
        if new is None:  # non-finite input: the residual starts again from zero
            r.zero_()
        elif new is not r:
            r.copy_(new)
        return p
