"""The compressor interface shared by every codec."""

from __future__ import annotations

import torch

from gradcomp import _validate as v
from gradcomp import wire as W
from gradcomp.errors import PayloadError

__all__ = ["Compressor"]


class Compressor:
    """A stateless-on-the-wire gradient codec (GRACE's compressor role).

    A compressor never communicates: it turns a tensor into a
    :class:`~gradcomp.wire.Payload` (whose ``wire`` bytes are all that travel)
    and back.

    Attributes:
        codec: the wire codec name this compressor writes.
        summable: False: payloads are never summed in compressed form.
        sparse: True for TopK / Threshold (dense collectives reject them).
        lossy: False only for NoCompression.
    """

    codec: str = ""
    summable: bool = False
    sparse: bool = False
    lossy: bool = True

    # ---- public API -------------------------------------------------------
    def compress(self, t: torch.Tensor) -> W.Payload:
        """Compress ``t``.

        Args:
            t: float32/float16/bfloat16/float64 tensor of any shape on any device
                (non-contiguous input is read as its contiguous copy).

        Returns:
            A :class:`~gradcomp.wire.Payload`; ``payload.wire`` is a 1-D uint8
            tensor on ``t``'s device.

        Raises:
            TypeError: ``t`` is not a dense floating tensor. ValueError: a meta tensor.
        """
        v.data_tensor("t", t)
        t = t.detach()  # compression is not differentiable: no autograd graph in the payload
        return self._encode(_flat(t), t.dtype, t.shape)

    def decompress(self, p: "W.Payload | torch.Tensor") -> torch.Tensor:
        """Decompress a payload (or its wire bytes) to a tensor with the original
        shape and dtype, on the payload's device.

        Raises:
            ValueError: the payload's codec does not belong to this compressor.
            PayloadError: wire bytes are malformed.
        """
        p = self._payload(p)
        return self._decode_flat(p).to(p.dtype).view(p.shape)

    def decompress_add_(self, p: "W.Payload | torch.Tensor", acc: torch.Tensor) -> torch.Tensor:
        """``acc += decompress(p)`` in place.

        Args:
            acc: contiguous float32 tensor with ``p``'s number of elements, same device.

        Returns:
            ``acc``.
        """
        p = self._payload(p)
        _check_acc(acc, p)
        acc.view(-1).add_(self._decode_flat(p).to(torch.float32))
        return acc

    def wire_nbytes(self, shape, dtype: torch.dtype = torch.float32) -> int | None:
        """Exact wire size in bytes for a tensor of ``shape`` (None when it depends
        on the data, as for Threshold)."""
        return None

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
    def _encode(self, x: torch.Tensor, dtype: torch.dtype, shape) -> W.Payload:
        """Encode flat contiguous ``x`` (its dtype may differ from ``dtype``, the
        original dtype recorded in the header: error feedback passes float32)."""
        raise NotImplementedError

    def _decode_flat(self, p: W.Payload) -> torch.Tensor:
        """Flat decoded values: float32 for lossy codecs, the original dtype for raw."""
        raise NotImplementedError

    def _codecs(self) -> tuple[str, ...]:
        return (self.codec,)

    def _payload(self, p) -> W.Payload:
        if isinstance(p, torch.Tensor):
            p = W.decode(p)
        if not isinstance(p, W.Payload):
            raise TypeError(f"p must be a gradcomp Payload or uint8 wire tensor, got {type(p).__name__}")
        if p.codec not in self._codecs():
            raise ValueError(
                f"payload codec {p.codec!r} does not match compressor {type(self).__name__} "
                f"(codec {self.codec!r})"
            )
        return p

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _check_acc(acc: torch.Tensor, p: W.Payload) -> None:
    if not isinstance(acc, torch.Tensor):
        raise TypeError(f"acc must be a torch.Tensor, got {type(acc).__name__}")
    if acc.dtype != torch.float32 or not acc.is_contiguous():
        raise ValueError(f"acc must be a contiguous float32 tensor, got "
                         f"{'a non-contiguous ' if not acc.is_contiguous() else ''}{acc.dtype}")
    if acc.numel() != p.numel:
        raise ValueError(f"acc must have {p.numel} elements (the payload's), got {acc.numel()}")
    if acc.device != p.device:
        raise ValueError(f"acc must be on the payload's device {p.device}, got {acc.device}")


def new_wire(header: bytes, body_nbytes: int, device) -> torch.Tensor:
    """Allocate a wire of ``len(header) + body_nbytes`` bytes with the header written."""
    w = torch.empty(len(header) + body_nbytes, dtype=torch.uint8, device=device)
    w[: len(header)].copy_(W.header_tensor(header, device))
    return w


__all__ += ["new_wire", "PayloadError"]
