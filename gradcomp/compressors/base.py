"""The compressor interface shared by every codec."""

from __future__ import annotations

import abc
import inspect

import torch

from gradcomp import _validate as v
from gradcomp import wire as W
from gradcomp.compressors._common import check_acc, check_no_grad, check_wire_out, flat
from gradcomp.errors import PayloadError

__all__ = ["Compressor", "Decoder", "decoder", "decompress", "decompress_add_", "overrides", "takes_out"]


class Decoder(abc.ABC):
    """How the payloads of one wire codec decode, from their bytes alone.

    Each codec's row of :data:`gradcomp.wire.CODECS` holds its decoder,
    registered by the compressor module that writes the codec; transports that
    only receive (the parameter server, a worker's pulls) decode with it
    through :func:`decompress` / :func:`decompress_add_`, and a compressor's
    own :meth:`Compressor.decompress` uses the same one. Every method takes a
    payload already decoded and validated by :func:`gradcomp.decode` and an
    optional kernel ``backend`` (None: the fastest usable).
    """

    @abc.abstractmethod
    def values(self, p: W.Payload, backend: str | None = None) -> torch.Tensor:
        """Flat decoded values (``p.numel`` elements on ``p``'s device): float32
        for lossy codecs (float64 for fp16 of float64), the original dtype for raw."""

    def into(self, p: W.Payload, out: torch.Tensor, backend: str | None = None) -> None:
        """Write the decoded values into flat contiguous ``out`` (the payload's dtype and numel)."""
        out.copy_(self.values(p, backend))

    def add_(self, p: W.Payload, acc: torch.Tensor, backend: str | None = None) -> None:
        """``acc += decoded values`` for flat contiguous float32 ``acc`` (the payload's numel)."""
        acc.add_(self.values(p, backend).to(torch.float32))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def decoder(codec: str | int) -> Decoder:
    """The decoder of a codec (its name, or the id in a header).

    Raises:
        PayloadError: an unknown codec id. ValueError: an unknown codec name.
    """
    return W.codec(codec).decoder  # every built-in codec's module is imported with this package


def decompress(p: "W.Payload | torch.Tensor", *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decompress any payload (or its wire bytes) by the decoder of the codec its header names.

    No compressor is needed: everything decoding needs travels in the header.

    Args:
        p: a payload or its wire bytes (1-D uint8, decoded and validated).
        out: optional contiguous tensor of the payload's dtype, numel and device
            to write the values to (any shape).

    Returns:
        A new tensor of the payload's shape, dtype and device, or ``out``.

    Raises:
        PayloadError: malformed bytes (an unknown codec id included).
        TypeError / ValueError: ``p`` is neither a payload nor a uint8 tensor; a bad ``out``.
    """
    p = _as_payload(p)
    dec = decoder(p.codec)
    return _decompress(p, out, dec.values, dec.into)


def decompress_add_(p: "W.Payload | torch.Tensor", acc: torch.Tensor) -> torch.Tensor:
    """``acc += decompress(p)`` in place, by the decoder of ``p``'s codec.

    Args:
        p: a payload or its wire bytes.
        acc: contiguous float32 tensor with ``p``'s number of elements, same device.

    Returns:
        ``acc``.

    Raises:
        PayloadError: malformed bytes. TypeError / ValueError: a bad ``p`` or ``acc``.
    """
    p = _as_payload(p)
    check_acc(acc, p)
    if p.numel:
        decoder(p.codec).add_(p, acc.view(-1))
    return acc


class Compressor(abc.ABC):
    """A stateless-on-the-wire gradient codec (GRACE's compressor role).

    A compressor never communicates: it turns a tensor into a
    :class:`~gradcomp.wire.Payload` (whose ``wire`` bytes are all that travel)
    and back.

    Decoding belongs to the codec (:class:`Decoder`, from
    :data:`gradcomp.wire.CODECS`): a subclass writes payloads (``_encode``)
    and may override ``_decode_flat`` (and then ``_decode_into`` /
    ``_add_into`` follow it) to decode them its own way.

    Attributes:
        codec: the wire codec name this compressor writes.
        summable: False: payloads are never summed in compressed form.
        sparse: the codec's (True for TopK / Threshold: dense collectives reject them).
        lossy: the codec's (False only for NoCompression).
    """

    codec: str = ""
    summable: bool = False

    @property
    def sparse(self) -> bool:
        """Whether this compressor's codec is sparse (:data:`gradcomp.wire.CODECS`)."""
        return W.codec(self.codec).sparse

    @property
    def lossy(self) -> bool:
        """Whether this compressor's codec is lossy (:data:`gradcomp.wire.CODECS`)."""
        return W.codec(self.codec).lossy

    # ---- public API -------------------------------------------------------
    def compress(self, t: torch.Tensor, *, out: torch.Tensor | None = None) -> W.Payload:
        """Compress ``t``.

        Args:
            t: float32/float16/bfloat16/float64 tensor of any shape on any device
                (non-contiguous input is read as its contiguous copy).
            out: optional 1-D contiguous ``torch.uint8`` tensor on ``t``'s device
                of exactly ``wire_nbytes(t.shape, t.dtype)`` bytes to write the
                wire into (dense compressors only): reusing one across calls
                saves allocating (and page-faulting) a new wire each time.

        Returns:
            A :class:`~gradcomp.wire.Payload`; ``payload.wire`` is a 1-D uint8
            tensor on ``t``'s device (``out`` when given).

        Raises:
            TypeError: ``t`` is not a dense floating tensor. ValueError: a meta
                tensor; a bad ``out`` or a compressor without a fixed wire size.
        """
        v.data_tensor("t", t)
        t = t.detach()  # compression is not differentiable: no autograd graph in the payload
        if out is None:
            return self._encode(flat(t), t.dtype, t.shape)
        check_wire_out(self, out, t)
        return self._encode(flat(t), t.dtype, t.shape, out=out)

    def decompress(self, p: "W.Payload | torch.Tensor", *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decompress a payload (or its wire bytes) to a tensor with the original
        shape and dtype, on the payload's device.

        Args:
            p: a payload or its wire bytes (decoded and validated).
            out: optional contiguous tensor of the payload's dtype, number of
                elements and device to write the values to (any shape); no
                temporary of the payload's size is allocated for int8.

        Returns:
            A new tensor, or ``out``.

        Raises:
            ValueError: the payload's codec does not belong to this compressor; a bad ``out``.
            PayloadError: wire bytes are malformed.
        """
        return _decompress(self._payload(p), out, self._decode_flat, self._decode_into)

    def decompress_add_(self, p: "W.Payload | torch.Tensor", acc: torch.Tensor) -> torch.Tensor:
        """``acc += decompress(p)`` in place.

        Args:
            acc: contiguous float32 tensor with ``p``'s number of elements, same device.

        Returns:
            ``acc``.
        """
        p = self._payload(p)
        check_acc(acc, p)
        if p.numel:
            self._add_into(p, acc.view(-1))
        return acc

    def reduce_compress_(self, p: "W.Payload | torch.Tensor", acc: torch.Tensor, *, divisor: int = 1,
                         out: torch.Tensor | None = None, decode: bool = False) -> W.Payload:
        """One reduce step of a compressed collective, in place on ``acc``.

        Same results, bit for bit, as::

            self.decompress_add_(p, acc)
            if divisor != 1: acc.div_(divisor)
            q = self.compress(acc, out=out)
            if decode: self.decompress(q, out=acc)

        (:class:`Int8Quantizer` runs it in one native pass on CPU.)

        Args:
            p: the payload (or wire bytes) to add; its codec is this compressor's.
            acc: contiguous float32 tensor with ``p``'s number of elements, same
                device; its shape is the compressed tensor's.
            divisor: positive integer the sum is divided by (e.g. the group size
                for an average).
            out: optional wire buffer, as for :meth:`compress`.
            decode: leave in ``acc`` the decompressed result (what every receiver
                of the returned payload decodes) instead of the sum.

        Returns:
            The payload of the (divided) sum.
        """
        divisor = v.integer("divisor", divisor, 1)
        self.decompress_add_(p, acc)
        if divisor != 1:
            acc.div_(divisor)
        q = self.compress(acc) if out is None else self.compress(acc, out=out)
        if decode:
            self.decompress(q, out=acc)
        return q

    def _overrides(self, *names: str) -> bool:
        return overrides(self, *names)

    def _takes_out(self) -> bool:
        return takes_out(self)

    def wire_nbytes(self, shape, dtype: torch.dtype = torch.float32) -> int | None:
        """Exact wire size in bytes for a tensor of ``shape`` (None when it depends
        on the data, as for Threshold)."""
        return None

    def part_align(self) -> int:
        """Element alignment of the *parts* this compressor can write a payload in (0: none).

        A compressor with ``part_align() == a > 0`` writes and reads the payload
        of a flat float32 tensor of ``n`` elements in independent parts, element
        ranges ``[lo, hi)`` with ``lo`` a multiple of ``a`` (``hi`` too, or
        ``n``), through :meth:`open_wire`, :meth:`part_ranges`,
        :meth:`compress_part_`, :meth:`reduce_compress_part_` and
        :meth:`decompress_part_`; the payload assembled from all parts equals,
        bit for bit, the one written whole. The segment-pipelined ring
        (:mod:`gradcomp.comm.pipelined`) uses it to send a payload while its
        next parts are being computed. :class:`Int8Quantizer` with nearest
        rounding has parts (``a`` = its block size); the others have none.
        """
        return 0

    def state_dict(self) -> dict:
        """Counters that make the compressor's output reproducible after a restart."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""

    def clone(self) -> "Compressor":
        """A fresh compressor with the same settings (new state)."""
        import copy

        return copy.deepcopy(self)

    # ---- codec hooks --------------------------------------------------------
    @abc.abstractmethod
    def _encode(self, x: torch.Tensor, dtype: torch.dtype, shape, out: torch.Tensor | None = None) -> W.Payload:
        """Encode flat contiguous ``x`` (its dtype may differ from ``dtype``, the
        original dtype recorded in the header: error feedback passes float32)
        into ``out`` when given (checked by the caller: the exact wire size)."""

    def _encode_ef(self, x: torch.Tensor, residual: torch.Tensor, dtype: torch.dtype, shape,
                   out: torch.Tensor | None = None) -> W.Payload | None:
        """Fused error feedback: the payload of ``x + residual`` with ``residual`` (flat
        float32) updated in place to the new error, in one kernel pass; None when the codec
        has no fused kernel (the caller then encodes the sum and decodes it)."""
        return None

    def _decode_flat(self, p: W.Payload) -> torch.Tensor:
        """Flat decoded values: float32 for lossy codecs, the original dtype for
        raw (the codec's :class:`Decoder`, on this compressor's backend)."""
        return decoder(p.codec).values(p, getattr(self, "backend", None))

    def _decode_into(self, p: W.Payload, out: torch.Tensor) -> None:
        """Write the decoded values into flat ``out`` (the payload's dtype and numel)."""
        if self._own_decode():
            out.copy_(self._decode_flat(p))
        else:
            decoder(p.codec).into(p, out, getattr(self, "backend", None))

    def _add_into(self, p: W.Payload, acc: torch.Tensor) -> None:
        """``acc += decoded values`` for flat float32 ``acc`` (the payload's numel)."""
        if self._own_decode():
            acc.add_(self._decode_flat(p).to(torch.float32))
        else:
            decoder(p.codec).add_(p, acc, getattr(self, "backend", None))

    def _residual(self, p: W.Payload, px: torch.Tensor) -> torch.Tensor:
        """Error feedback's new residual ``px - decoded(p)`` (flat float32), where
        ``p`` is this compressor's encoding of ``px``. ``px`` is the caller's own
        temporary: a codec may write the result into it when its payload holds
        no view of it."""
        return px - self._decode_flat(p).to(torch.float32)

    def _own_decode(self) -> bool:
        """The class decodes its own way (it redefines ``_decode_flat``)."""
        return type(self)._decode_flat is not Compressor._decode_flat

    def _codecs(self) -> tuple[str, ...]:
        return (self.codec,)

    def _payload(self, p) -> W.Payload:
        p = _as_payload(p)
        if p.codec not in self._codecs():
            raise ValueError(
                f"payload codec {p.codec!r} does not match compressor {type(self).__name__} "
                f"(codec {self.codec!r})"
            )
        return p

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def overrides(obj, *names: str) -> bool:
    """True when ``obj``'s class (a compressor or an error feedback) redefines
    one of these methods outside gradcomp (a user subclass): fused paths then
    step aside so that the subclass's methods run."""
    for name in names:
        fn = getattr(type(obj), name)
        if getattr(fn, "__module__", "").split(".")[0] != "gradcomp":
            return True
    return False


def takes_out(obj) -> bool:
    """Whether ``obj.compress`` takes ``out=`` (a subclass written before the
    argument existed may override it without)."""
    if not overrides(obj, "compress"):
        return True
    try:
        return "out" in inspect.signature(obj.compress).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False


def _as_payload(p) -> W.Payload:
    if isinstance(p, torch.Tensor):
        p = W.decode(p)
    if not isinstance(p, W.Payload):
        raise TypeError(f"p must be a gradcomp Payload or uint8 wire tensor, got {type(p).__name__}")
    return p


def _decompress(p: W.Payload, out, values, into) -> torch.Tensor:
    """:meth:`Compressor.decompress` of a checked payload with these decode hooks."""
    if out is None:
        return values(p).to(p.dtype).view(p.shape)
    if (not isinstance(out, torch.Tensor) or out.dtype != p.dtype or out.numel() != p.numel
            or out.device != p.device or not out.is_contiguous()):
        got = (f"{'a non-contiguous ' if not out.is_contiguous() else ''}{out.dtype} tensor of "
               f"{out.numel()} elements on {out.device}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise ValueError(f"out must be a contiguous {p.dtype} tensor of {p.numel} elements on "
                         f"{p.device}, got {got}")
    check_no_grad("out", out)
    if p.numel:
        into(p, out.detach().view(-1))
    return out


def new_wire(header: bytes, body_nbytes: int, device, out: torch.Tensor | None = None) -> torch.Tensor:
    """A wire of ``len(header) + body_nbytes`` bytes with the header written:
    ``out`` (already checked to have that size) or a new tensor."""
    w = torch.empty(len(header) + body_nbytes, dtype=torch.uint8, device=device) if out is None else out
    w[: len(header)].copy_(W.header_tensor(header, device))
    return w


__all__ += ["new_wire", "PayloadError"]
