"""Compression of what crosses a pipeline stage boundary, metered per boundary.

A stage sends its output activations forward and the gradients of its inputs
backward. :class:`BoundaryCodec` turns such a tensor into wire bytes with a
gradcomp compressor (int8 blockwise absmax by default) and back, counting the
bytes in a :class:`~gradcomp.TrafficMeter` under one phase per boundary and
direction: ``"fwd 0->1"`` (activations from stage 0 to stage 1), ``"bwd 1->0"``
(their gradients), so the meter reads as traffic per boundary.

With ``error_feedback=True`` the compression error of a tensor is remembered
per key and added to the next tensor sent under that key (Seide et al. 2014;
for activations Wang et al. 2022, "Fine-tuning language models over slow
networks using activation compression with guarantees", AC-SGD, keep one
residual per sample; here the key is the micro-batch slot and direction, so a
residual is added to the same slot of the next step).

The receiver knows each message's size in advance from the tensor's shape and
dtype (:meth:`BoundaryCodec.wire_nbytes`), which is fixed per boundary: only
dense compressors can cross a boundary.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import torch

from gradcomp.compressors import Compressor, ErrorFeedback, Int8Quantizer, split
from gradcomp.meter import TrafficMeter

__all__ = ["BoundaryCodec", "boundary_phase"]


def boundary_phase(direction: str, src: int, dst: int) -> str:
    """Meter phase name of one boundary and direction, e.g. ``"fwd 0->1"``."""
    return f"{direction} {src}->{dst}"


class BoundaryCodec:
    """Encodes and decodes stage-boundary tensors; meters their bytes.

    Args:
        compressor: a dense gradcomp compressor; ``"int8"`` (the default):
            ``Int8Quantizer()`` (256-element blocks, nearest rounding); or
            None: tensors travel as their own bytes (no header), the engine's
            plain path.
        error_feedback: wrap the compressor in :class:`~gradcomp.ErrorFeedback`
            (residual per key).
        meter: where bytes are counted (a new meter when None). ``raw`` bytes
            are the tensor's own bytes (``numel * element_size``).

    Attributes:
        seconds: wall time spent compressing and decompressing (seconds).

    Raises:
        TypeError: ``compressor`` is not a gradcomp compressor.
        ValueError: a sparse compressor (wire size not fixed by the shape), or
            error feedback without a compressor.
    """

    def __init__(self, compressor: Compressor | ErrorFeedback | str | None = "int8",
                 error_feedback: bool = False, meter: TrafficMeter | None = None):
        if isinstance(compressor, str) and compressor == "int8":
            compressor = Int8Quantizer()
        self._ef = None
        if compressor is not None:
            codec, self._ef = split(compressor, "compressor", " or None")
            if codec.sparse or codec.wire_nbytes((1,)) is None:
                raise ValueError(f"a stage boundary needs a dense compressor whose wire size the "
                                 f"shape fixes, got {type(codec).__name__}")
            if error_feedback and self._ef is None:
                compressor = self._ef = ErrorFeedback(codec)
        elif error_feedback:
            raise ValueError("error_feedback needs a compressor")
        self.compressor = compressor
        self.meter = meter if meter is not None else TrafficMeter()
        self.seconds = 0.0

    @property
    def plain(self) -> bool:
        """True when tensors travel uncompressed as their own bytes."""
        return self.compressor is None

    def wire_nbytes(self, shape, dtype: torch.dtype = torch.float32) -> int:
        """Bytes on the wire for a tensor of ``shape`` and ``dtype``."""
        if self.compressor is None:
            return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        return int(self.compressor.wire_nbytes(torch.Size(shape), dtype))

    def encode(self, t: torch.Tensor, phase: str, key: Hashable = None) -> torch.Tensor:
        """The wire bytes of ``t`` (1-D uint8; for a plain codec the tensor itself),
        counted as sent under ``phase``; ``key`` selects the error-feedback residual."""
        t0 = time.perf_counter()
        t = t.detach()
        if self.compressor is None:
            wire = t.contiguous()
        elif self._ef is not None:
            wire = self._ef.compress(t, key=key).wire
        else:
            wire = self.compressor.compress(t).wire
        self.seconds += time.perf_counter() - t0
        self.meter.record_send(wire.numel() * wire.element_size(), t.numel() * t.element_size(), phase)
        return wire

    def receive_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A buffer to receive the wire of a tensor shaped like ``like`` into
        (``like`` itself for a plain codec)."""
        if self.compressor is None:
            return like
        return torch.empty(self.wire_nbytes(like.shape, like.dtype), dtype=torch.uint8,
                           device=like.device)

    def decode_into(self, wire: torch.Tensor, out: torch.Tensor, phase: str) -> torch.Tensor:
        """Decode received ``wire`` into ``out`` (in place, outside autograd),
        counted as received under ``phase``; returns ``out``.

        Raises:
            gradcomp.PayloadError: malformed bytes. ValueError: a payload whose
                dtype or size differs from ``out``'s.
        """
        self.meter.record_recv(wire.numel() * wire.element_size(), out.numel() * out.element_size(), phase)
        if self.compressor is None:
            if wire is not out:
                with torch.no_grad():
                    out.copy_(wire)
            return out
        t0 = time.perf_counter()
        with torch.no_grad():
            self.compressor.decompress(wire, out=out.detach())
        self.seconds += time.perf_counter() - t0
        return out
